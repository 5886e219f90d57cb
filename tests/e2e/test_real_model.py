"""The main job on a real trained model (SmolLM2-135M-Instruct, made from its
GGUF wheel by ``testing/real_model.py``): greedy tokens and logprobs of our
sync, async and async n-gram engines equal stock vLLM CPU's, with EOS on, on
chat prompts of a few hundred tokens (several prefill chunks), run twice (the
second time from prefix-cache hits).

Opt-in (it fetches a 93 MB wheel, converts it once, and runs a 30-layer
model on every engine): ``python -m pytest tests/e2e/test_real_model.py
--real-model`` after ``pip install -e ".[real]"``.
"""

from typing import Any

import pytest

from vllm_neuron_sched.testing.in_process import in_process_llm
from vllm_neuron_sched.testing.oracle import (
    assert_logprobs_close,
    generate,
    start_each_in_subprocess,
)
from vllm_neuron_sched.testing.real_model import PASSAGE, chat_prompt
from vllm_neuron_sched.testing.workloads import MODES, STOCK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 1024,
    "max_num_seqs": 4,
    # Prompts of 200-400 tokens run as several chunks.
    "max_num_batched_tokens": 128,
    "block_size": 64,
    "seed": 0,
    "enforce_eager": True,
}
ROUNDS = 2
# float32 on 30 layers: stock and ours batch rows differently.
TOLERANCE = 2e-3
# Short answers end on EOS within the budget; the copying ones (a small model
# copies its prompt) run to it, the n-gram proposer's case.
QUESTIONS = (
    "In what year was the lamp converted to electricity? Answer with the year.",
    "Repeat the first two sentences of the text exactly.",
    "What was the keeper's name? Answer in a few words.",
    "Summarize the text in one sentence.",
)


def _prompts(tokenizer: Any) -> list[str]:
    """Chat prompts of a few hundred tokens: the passage once to three times,
    then a question."""
    return [
        chat_prompt(tokenizer, PASSAGE * (1 + i % 3) + "\n\n" + q)
        for i, q in enumerate(QUESTIONS)
    ]


def _params() -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": 64, "logprobs": 2}


@pytest.fixture(scope="module")
def real_model() -> str:
    from vllm_neuron_sched.testing.real_model import ensure_real_checkpoint

    return str(ensure_real_checkpoint())


@pytest.fixture(scope="module")
def prompts(real_model: str) -> list[str]:
    from transformers import AutoTokenizer

    return _prompts(AutoTokenizer.from_pretrained(real_model))


@pytest.fixture(scope="module")
def stock(real_model: str, prompts: list[str]) -> list[dict[str, Any]]:
    run = {
        "model": real_model,
        "prompts": prompts,
        "sampling": _params(),
        "engine_kwargs": ENGINE,
        "rounds": ROUNDS,
    }
    return start_each_in_subprocess([run], env=STOCK_ENV).result()[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_real_model_greedy_tokens_equal_stock(
    real_model: str, prompts: list[str], stock: list[dict[str, Any]], mode: str
) -> None:
    with in_process_llm(real_model, **ENGINE, **MODES[mode]) as llm:
        lengths = [len(llm.get_tokenizer().encode(p)) for p in prompts]
        assert min(lengths) > 200 and max(lengths) < 600, lengths
        ours = [
            record
            for _ in range(ROUNDS)
            for record in generate(llm, prompts, _params())
        ]
    # Real text, ended by the model: some answers stop on EOS.
    assert any(record["finish_reason"] == "stop" for record in ours)
    assert len(ours) == len(stock)
    for i, (record, expected) in enumerate(zip(ours, stock, strict=True)):
        assert record["token_ids"] == expected["token_ids"], (i, record["text"])
        assert record["finish_reason"] == expected["finish_reason"], i
        assert_logprobs_close(record["logprobs"], expected["logprobs"], TOLERANCE)
