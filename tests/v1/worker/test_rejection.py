"""The verify step's rejection sampling (``speculation.rejection_sample``):
greedy rows keep vLLM's rule, random rows leave each output token distributed
as the target's, and a seed reproduces."""

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from vllm_neuron_sched.testing.sampling import sampling_metadata
from vllm_neuron_sched.worker.history_rules import plan_bad_words
from vllm_neuron_sched.worker.logits_rules import NO_RULES, MinTokens, RowRules
from vllm_neuron_sched.worker.programs import EAGER
from vllm_neuron_sched.worker.spec.rejection import (
    REJECTED,
    draw_randomness,
    rejection_sample,
)
from vllm_neuron_sched.worker.spec.verify import VerifyPlan
from vllm_neuron_sched.worker.token_table import DeviceTokens

VOCAB = 6
WIDTH = 3  # 1 + K, K = 2


def _logits(rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows * WIDTH, VOCAB, generator=generator)


def test_greedy_rows_accept_while_the_draft_is_the_argmax() -> None:
    logits = _logits(2)
    argmax = logits.argmax(dim=-1).view(2, WIDTH)
    # Row 0: both drafts right, so the bonus follows; row 1: the first wrong.
    drafts = torch.stack([argmax[0, :2], (argmax[1, :2] + 1) % VOCAB]).int()
    out = rejection_sample(
        logits,
        WIDTH,
        torch.tensor([2, 2]),
        drafts,
        draw_randomness(sampling_metadata([0.0, 0.0]), 2, VOCAB, torch.float32),
        EAGER,
    )
    assert out[0].tolist() == argmax[0].tolist()
    assert out[1].tolist() == [argmax[1, 0].item(), REJECTED, REJECTED]


def test_random_rows_keep_the_target_distribution() -> None:
    """The first output token is distributed as softmax(logits / T) whatever
    the draft: accepted with p(d), else drawn from p without d."""
    logits = _logits(1)
    temperature = 0.8
    target = (logits[0] / temperature).softmax(dim=-1)
    draft = int(target.argsort()[-2])  # a likely draft, not the likeliest
    counts = torch.zeros(VOCAB)
    num_samples = 2000
    for seed in range(num_samples):
        generators = {0: torch.Generator().manual_seed(seed)}
        out = rejection_sample(
            logits,
            WIDTH,
            torch.tensor([1]),
            torch.tensor([[draft, 0]], dtype=torch.int32),
            draw_randomness(
                sampling_metadata([temperature], generators), 2, VOCAB, torch.float32
            ),
            EAGER,
        )
        counts[out[0, 0]] += 1
        assert (out[0] != REJECTED).sum() in (1, 2)  # a token always follows
    assert torch.allclose(counts / num_samples, target, atol=0.04)


def test_a_seed_reproduces() -> None:
    logits = _logits(2)
    drafts = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)

    def run() -> list[list[int]]:
        generators = {i: torch.Generator().manual_seed(7 + i) for i in range(2)}
        torch.rand(3)  # the global generator moves: seeded rows must not care
        return rejection_sample(
            logits,
            WIDTH,
            torch.tensor([2, 1]),
            drafts,
            draw_randomness(
                sampling_metadata([1.0, 0.7], generators), 2, VOCAB, torch.float32
            ),
            EAGER,
        ).tolist()

    assert run() == run()


def _verify_rows(
    histories: dict[int, tuple[list[int], list[int]]],
    drafts: dict[int, list[int]],
    **plan: Any,
) -> tuple[DeviceTokens, VerifyPlan]:
    """A token table whose slots hold these (prompt, output) histories and
    two drafts each, and a verify step's plan of those slots (``plan``: its
    other fields)."""

    tokens = DeviceTokens(4, history_len=16, num_drafts=2)
    for slot, (prompt, output) in histories.items():
        known = prompt + output
        slots = torch.tensor([slot])
        tokens.accept(
            slots,
            torch.tensor([0]),
            torch.tensor([known], dtype=torch.int32),
            torch.tensor([len(known)]),
        )
        tokens.set_drafts(slots, torch.tensor([drafts[slot]]), torch.tensor([2]))
    rows = len(histories)
    return tokens, VerifyPlan(
        width=WIDTH,
        num_rows=rows,
        num_rows_padded=rows,
        slots=torch.tensor(list(histories)),
        scheduled_drafts=torch.full((rows,), 2),
        prompt_lens=torch.tensor([len(prompt) for prompt, _ in histories.values()]),
        groups=[],
        tables={},
        **plan,
    )


def test_penalties_count_each_querys_drafts() -> None:
    """Query j of a verify row is penalized for the row's output so far and
    its first j drafts (read from the device history), exactly as vLLM's
    ``apply_penalties`` does for that output; the prompt only counts for the
    repetition penalty."""
    from dataclasses import replace

    from vllm.model_executor.layers.utils import apply_penalties

    from vllm_neuron_sched.worker.spec.constraints import constrain_verify_logits

    vocab, width = 8, WIDTH
    # Slot 1: prompt [1, 2], output [3, 3]; slot 2: prompt [4], output [5].
    histories = {1: ([1, 2], [3, 3]), 2: ([4], [5])}
    drafts = {1: [3, 6], 2: [0, 5]}
    tokens, plan = _verify_rows(histories, drafts)
    metadata = replace(
        sampling_metadata([0.0, 0.0]),
        no_penalties=False,
        prompt_token_ids=torch.tensor([[1, 2], [4, vocab]]),
        presence_penalties=torch.tensor([0.5, 0.25]),
        frequency_penalties=torch.tensor([0.3, 0.1]),
        repetition_penalties=torch.tensor([1.5, 2.0]),
    )
    logits = torch.randn(2 * width, vocab, generator=torch.Generator().manual_seed(1))
    drafts_read = tokens.drafts_of(plan.slots).drafts
    constrained, left = constrain_verify_logits(
        logits, plan, tokens, drafts_read, metadata, EAGER
    )
    assert left.no_penalties  # the sampler does not apply them again
    for row, slot in enumerate((1, 2)):
        prompt, output = histories[slot]
        for j in range(width):
            expected = apply_penalties(
                logits[row * width + j][None].clone(),
                torch.tensor([prompt]),
                torch.tensor([output + drafts[slot][:j]]),
                metadata.presence_penalties[row : row + 1],
                metadata.frequency_penalties[row : row + 1],
                metadata.repetition_penalties[row : row + 1],
            )
            assert torch.allclose(constrained[row * width + j], expected[0])


def test_bad_words_mask_each_query_as_vllm_does() -> None:
    """Query j of a verify row masks a bad word's last token where the row's
    output and its first j drafts end with the rest of the word, exactly as
    vLLM's ``apply_bad_words`` over that output: a one-token word always, a
    prefix across output and drafts, never one reaching into the prompt, and
    two words ending in the same token each judged alone."""
    from vllm.v1.sample.ops.bad_words import apply_bad_words

    from vllm_neuron_sched.worker.spec.constraints import constrain_verify_logits

    vocab, width = 8, WIDTH
    # Slot 1: prompt [1, 2], output [3, 4]; slot 3: prompt [5], output [6].
    histories = {1: ([1, 2], [3, 4]), 3: ([5], [6])}
    drafts = {1: [5, 6], 3: [2, 3]}
    words = {
        # Pasts: [3, 4], [3, 4, 5], [3, 4, 5, 6]. [7] everywhere; [4, 5, 0]
        # at query 1; [2, 3, 4, 1] never (its 2 is the prompt's); [3, 4, 6]
        # at query 0 and [0, 0, 6], with the same last token, nowhere.
        0: [[7], [4, 5, 0], [2, 3, 4, 1], [3, 4, 6], [0, 0, 6]],
        # Pasts: [6], [6, 2], [6, 2, 3]. [6, 2] at query 0; [5, 6, 3] never
        # (its 5 is the prompt's); [6, 2, 3, 1] at query 2.
        1: [[6, 2], [5, 6, 3], [6, 2, 3, 1]],
    }
    tokens, plan = _verify_rows(
        histories, drafts, rules=RowRules(bad_words=plan_bad_words(2, words))
    )
    logits = torch.randn(2 * width, vocab, generator=torch.Generator().manual_seed(2))
    metadata = replace(sampling_metadata([0.0, 0.0]), bad_words_token_ids=words)
    drafts_read = tokens.drafts_of(plan.slots).drafts
    constrained, left = constrain_verify_logits(
        logits, plan, tokens, drafts_read, metadata, EAGER
    )
    assert not left.bad_words_token_ids  # the sampler does not apply them again
    expected = logits.clone()
    pasts = []
    for slot in (1, 3):
        output = histories[slot][1]
        pasts += [output + drafts[slot][:j] for j in range(width)]
    query_words = {i: words[i // width] for i in range(2 * width)}
    apply_bad_words(expected, query_words, pasts)
    assert torch.equal(constrained, expected)
    masked = torch.isneginf(constrained).view(2, width, vocab)
    assert masked[0, :, 7].all() and masked[0, 1, 0] and masked[0, 0, 6]
    assert masked[1, 0, 2] and masked[1, 2, 1]
    assert masked.sum() == width + 4  # nothing else


def _masks(*allowed: list[int]) -> np.ndarray:
    """One int32 word per mask (VOCAB < 32): bit t set when t is allowed."""
    return np.array([[sum(1 << t for t in tokens)] for tokens in allowed], np.int32)


def _grammar_step(
    spec_tokens: dict[str, list[int]], masks: np.ndarray, acceptable: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows "a" (structured) and "b" (not), each with both drafts the
    target's argmax: what the verify step outputs under the grammar."""
    from vllm.v1.core.sched.output import GrammarOutput

    from vllm_neuron_sched.worker.spec.grammar import (
        apply_verify_grammar,
        plan_grammar,
    )

    logits = _logits(2)
    argmax = logits.argmax(dim=-1).view(2, WIDTH)
    grammar = plan_grammar(
        GrammarOutput(["a"], masks, acceptable), ["a", "b"], spec_tokens, WIDTH
    )
    num_drafts = apply_verify_grammar(logits, torch.tensor([2, 2]), grammar)
    out = rejection_sample(
        logits,
        WIDTH,
        num_drafts,
        argmax[:, :2].int(),
        draw_randomness(sampling_metadata([0, 0]), 2, VOCAB, torch.float32),
        EAGER,
    )
    return out, argmax


def test_the_grammar_masks_each_query_and_stops_at_an_invalid_draft() -> None:
    """Sync scheduling: the scheduler read the drafts back, found the second
    one invalid and scheduled one; mask j is the grammar after j drafts."""
    logits = _logits(2)
    argmax = logits.argmax(dim=-1).view(2, WIDTH)
    second = int(argmax[0, 1])
    allowed = [t for t in range(VOCAB) if t != second]
    out, argmax = _grammar_step(
        {"a": [int(argmax[0, 0])], "b": [1, 2]},
        _masks(list(range(VOCAB)), allowed),
        [1],
    )
    query_1 = _logits(2)[1]
    query_1[second] = float("-inf")
    # Row a: the valid draft, then the grammar's choice at query 1.
    assert out[0].tolist() == [argmax[0, 0], query_1.argmax(), REJECTED]
    assert out[1].tolist() == argmax[1].tolist()  # row b: unconstrained


def test_drafts_the_grammar_did_not_check_are_never_accepted() -> None:
    """Async scheduling, drafts not read back: the scheduler's placeholders
    (-1) leave every mask after the first permissive, and no draft may be
    accepted, though both are the target's argmax."""
    out, argmax = _grammar_step(
        {"a": [-1, -1], "b": [-1, -1]},
        _masks(list(range(VOCAB)), list(range(VOCAB)), list(range(VOCAB))),
        [0],
    )
    assert out[0].tolist() == [argmax[0, 0], REJECTED, REJECTED]
    assert out[1].tolist() == argmax[1].tolist()


@pytest.mark.parametrize(
    "mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
)
def test_verify_logprobs_are_vllms_sampler_ones_in_every_mode(mode: str) -> None:
    """A verify step without drafts (width 1): each row's logprobs are what
    vLLM's own sampler reports in that logprobs mode, for a batch of a greedy
    row and a random row with top-k; the token each row output first, then
    the top ones."""
    from dataclasses import replace

    from vllm_neuron_sched.worker.spec.rejection import verify_logprobs

    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    metadata = replace(
        sampling_metadata([0.0, 0.7]),
        top_k=torch.tensor([VOCAB, 3]),
        max_num_logprobs=-1,
    )
    # What constrain_verify_logits gives, e.g. for a token no row may take:
    # the processed modes read it, the raw ones the forward's logits.
    constrained = logits.clone()
    constrained[:, 0] = float("-inf")
    sampler = Sampler(logprobs_mode=mode)
    source = constrained if mode.startswith("processed") else logits
    expected = sampler(source.clone(), metadata).logprobs_tensors.logprobs
    out = torch.tensor([[4], [1]], dtype=torch.int32)
    tensors = verify_logprobs(
        sampler, logits, constrained, out, replace(metadata, max_num_logprobs=2)
    )
    assert tensors.cu_num_generated_tokens == [0, 1, 2]
    for row, token in enumerate((4, 1)):
        assert tensors.logprob_token_ids[row, 0] == token
        assert torch.isclose(tensors.logprobs[row, 0], expected[row, token])
        top = expected[row].topk(2).values
        assert torch.allclose(tensors.logprobs[row, 1:], top)


def _verify_one_row(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    output: list[int],
    rules: RowRules = NO_RULES,
    grammar: object = None,
) -> list[int]:
    """One verify row with no drafts (width 1), its prompt [2] and ``output``
    in the device history, through the whole verification: what it outputs."""
    from types import SimpleNamespace

    from vllm_neuron_sched.worker.results import VerifyForward
    from vllm_neuron_sched.worker.sampling_state import SamplingState
    from vllm_neuron_sched.worker.spec.proposer import NgramProposer
    from vllm_neuron_sched.worker.spec.verify import VerifyPlan, verify_on_device
    from vllm_neuron_sched.worker.token_table import DeviceTokens

    tokens = DeviceTokens(2, history_len=16, num_drafts=2)
    known = [2, *output]
    slots = torch.tensor([1])
    tokens.accept(
        slots,
        torch.tensor([0]),
        torch.tensor([known], dtype=torch.int32),
        torch.tensor([len(known)]),
    )
    plan = VerifyPlan(
        width=1,
        num_rows=1,
        num_rows_padded=1,
        slots=slots,
        scheduled_drafts=torch.tensor([0]),
        prompt_lens=torch.tensor([1]),
        groups=[],
        tables={},
        rules=rules,
    )
    spec = SimpleNamespace(num_tokens=2, min_n=1, max_n=2, max_model_len=64)
    state = SamplingState(LogitsProcessors())
    state.histories["r"] = list(output)
    forward = VerifyForward(
        logits,
        torch.tensor([0]),
        torch.tensor([len(known)]),
        tokens.drafts_of(slots).drafts,
    )
    verified = verify_on_device(
        NgramProposer(spec),  # type: ignore[arg-type]
        Sampler(),
        tokens,
        state,
        forward,
        metadata,
        False,
        ["r"],
        plan,
        EAGER,
        draw_randomness(metadata, 2, logits.shape[1], torch.float32),
        grammar,  # type: ignore[arg-type]
    )
    return verified.token_ids([True])[0]


def test_a_bfloat16_models_verify_logits_are_penalized_in_float32() -> None:
    """vLLM's samplers cast the logits to float32 before anything transforms
    them. Token 0 (8.0, once output) under a repetition penalty of 1.3 is
    6.1538 in float32, below token 1's 6.15625, and rounds to 6.15625 in
    bfloat16, a tie that token 0 wins: the verify step answers float32's."""
    from dataclasses import replace

    logits = torch.tensor([[8.0, 6.15625, -5.0, -5.0]], dtype=torch.bfloat16)
    metadata = replace(
        sampling_metadata([0.0]),
        no_penalties=False,
        prompt_token_ids=torch.tensor([[2]]),
        repetition_penalties=torch.tensor([1.3]),
    )
    assert _verify_one_row(logits, metadata, output=[0]) == [1]


def test_min_tokens_leaves_a_structured_request_the_stops_its_grammar_allows() -> None:
    """The grammar allows only the stop token (its end) before min_tokens:
    vLLM's min_tokens processor keeps it rather than leave no token, and so
    does the verify step (it took token 0, and the request failed)."""
    from vllm.v1.core.sched.output import GrammarOutput

    from vllm_neuron_sched.worker.spec.grammar import plan_grammar

    stop = 3
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])
    grammar = plan_grammar(GrammarOutput(["r"], _masks([stop]), [0]), ["r"], {}, 1)
    stops = torch.zeros(1, 4, dtype=torch.bool)
    stops[0, stop] = True
    rules = RowRules(
        min_tokens=MinTokens(torch.tensor([8]), stops, torch.tensor([True]))
    )
    metadata = sampling_metadata([0.0])
    assert _verify_one_row(logits, metadata, [5], rules, grammar) == [stop]
