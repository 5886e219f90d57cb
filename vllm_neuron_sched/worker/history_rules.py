"""What vLLM's sampler applies from a request's past: the penalties and the
bad words, as device programs per query (``[rows, width, vocab]``: one query
per row in a plain step's sampling, ``1 + K`` in a verify step), over the
device histories (``token_table.py``), never the host's lists, which under
async scheduling still end in placeholders.

Each query's past is ``history[row, :end]``: the prompt, the outputs, and in a
verify step the drafts before the query. The bad words enter flat, as the
host lays them out (``plan_bad_words``), at a shape that holds every step's:
vLLM's own limits per request (``VLLM_MAX_NUM_BAD_WORDS`` words,
``VLLM_MAX_BAD_WORDS_TOTAL_TOKENS`` tokens, the layout vLLM's GPU runner
keeps them in) on the compiled device, powers of two elsewhere.
"""

from dataclasses import dataclass

import numpy as np
import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.utils.math_utils import next_power_of_2


def penalize_queries(
    queries: torch.Tensor,
    history: torch.Tensor,
    ends: torch.Tensor,
    prompt_lens: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """The device program, vLLM's penalties per query (its
    ``apply_penalties`` does the arithmetic): ``queries`` [rows, width,
    vocab]; ``history`` [rows, span] each row's tokens (its drafts after
    them); ``ends`` [rows, width] where each query's past ends; the row's
    prompt (``prompt_lens``, read from the history, so no batch-wide
    padding) counts for the repetition penalty, its outputs and the query's
    drafts for all three; the penalties are [rows]. -> a new tensor."""
    rows, width, vocab = queries.shape
    span = history.shape[1]
    position = torch.arange(span)[None, :]
    prompts = torch.where(position < prompt_lens[:, None], history, vocab)
    is_output = (position[:, None, :] >= prompt_lens[:, None, None]) & (
        position[:, None, :] < ends[:, :, None]
    )
    outputs = torch.where(is_output, history[:, None, :], vocab)
    return apply_penalties(
        queries.reshape(rows * width, vocab).clone(),
        prompts.repeat_interleave(width, 0),
        outputs.reshape(rows * width, span),
        presence.repeat_interleave(width),
        frequency.repeat_interleave(width),
        repetition.repeat_interleave(width),
    ).view(rows, width, vocab)


@dataclass(frozen=True)
class BadWords:
    """The rows' bad words, flat: each row's words' tokens one after another
    (``tokens`` [rows, T]), each token's word (``word_of``; padding belongs
    to word W, which no row has) and how many tokens before its word's last
    it is (``back``: 0 for the last); each word's last token (``last`` [rows,
    W]) and whether the row has that word (``is_word``)."""

    tokens: torch.Tensor
    word_of: torch.Tensor
    back: torch.Tensor
    last: torch.Tensor
    is_word: torch.Tensor


def plan_bad_words(
    num_rows: int,
    per_row: dict[int, list[list[int]]],
    shape: tuple[int, int] | None = None,
) -> BadWords | None:
    """Host side: the rows' tokenized bad words (vLLM's
    ``SamplingParams.bad_words_token_ids``) at ``shape`` (words, tokens per
    row: a compiled device's declared one), or padded to powers of two."""
    per_row = {row: words for row, words in per_row.items() if words}
    if not per_row:
        return None
    if shape is None:
        num_words = next_power_of_2(max(map(len, per_row.values())))
        num_tokens = next_power_of_2(
            max(sum(map(len, words)) for words in per_row.values())
        )
    else:
        num_words, num_tokens = shape
    tokens = np.zeros((num_rows, num_tokens), np.int64)
    word_of = np.full((num_rows, num_tokens), num_words, np.int64)
    back = np.zeros((num_rows, num_tokens), np.int64)
    last = np.zeros((num_rows, num_words), np.int64)
    is_word = np.zeros((num_rows, num_words), bool)
    for row, words in per_row.items():
        lengths = np.fromiter(map(len, words), np.int64, len(words))
        size = int(lengths.sum())
        tokens[row, :size] = [token for word in words for token in word]
        word_of[row, :size] = np.repeat(np.arange(len(words)), lengths)
        back[row, :size] = np.repeat(np.cumsum(lengths), lengths) - 1 - np.arange(size)
        last[row, : len(words)] = [word[-1] for word in words]
        is_word[row, : len(words)] = True
    return BadWords(*map(torch.from_numpy, (tokens, word_of, back, last, is_word)))


def mask_bad_words(
    queries: torch.Tensor,
    history: torch.Tensor,
    ends: torch.Tensor,
    first_output: torch.Tensor,
    words: BadWords,
) -> torch.Tensor:
    """The device program, vLLM's rule per query: ``queries`` [rows, width,
    vocab]; ``history``, ``ends`` as in ``penalize_queries``;
    ``first_output`` [rows] where the row's outputs start (only outputs
    count, as in vLLM). A word's last token is masked where the past ends
    with the rest of the word (a one-token word always)."""
    rows, width, _ = queries.shape
    span, num_words = history.shape[1], words.last.shape[1]
    back = words.back[:, None, :]
    # Where each word token must stand in the query's past: [rows, width, T].
    position = ends[:, :, None] - back
    past = history.gather(1, position.clamp(0, span - 1).reshape(rows, -1))
    holds = (back == 0) | (
        (position >= first_output[:, None, None])
        & (past.view_as(position) == words.tokens[:, None, :])
    )
    # A word matches where none of its tokens misses (padding: word W).
    misses = torch.zeros(rows, width, num_words + 1, dtype=torch.int32)
    misses.scatter_add_(
        2, words.word_of[:, None, :].expand(-1, width, -1), (~holds).int()
    )
    matched = (misses[..., :num_words] == 0) & words.is_word[:, None, :]
    # The minimum over each token's words: two words may end in the same
    # token, and one that matches masks it whatever the other does.
    return queries.scatter_reduce(
        2,
        words.last[:, None, :].expand(-1, width, -1),
        torch.where(matched, -torch.inf, torch.inf).to(queries.dtype),
        reduce="amin",
    )
