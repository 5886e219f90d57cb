"""vLLM's ``SamplingMetadata`` for a batch of rows, as its input batch makes
it: what the unit tests of the sampling programs hand both them and vLLM's
sampler."""

import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata


def sampling_metadata(
    temperature: list[float],
    generators: dict[int, torch.Generator] | None = None,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
) -> SamplingMetadata:
    """Temperature 0 is a greedy row; ``top_k`` and ``top_p`` None when no
    row sets one (vLLM's batch leaves them out then)."""
    rows = len(temperature)
    greedy = all(t == 0.0 for t in temperature)
    return SamplingMetadata(
        temperature=None if greedy else torch.tensor(temperature),
        all_greedy=greedy,
        all_random=all(t > 0 for t in temperature),
        top_p=None if top_p is None else torch.tensor(top_p),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        spec_token_ids=None,
    )
