"""N-gram (prompt-lookup) drafts computed on the device.

The drafts are found in a device-side token history, so they exist under async
scheduling, where the host's history lags a step behind. They are exactly the
drafts of vLLM's CPU proposer (``_find_longest_matched_ngram_and_propose_tokens``),
so sync-mode acceptance counters match stock vLLM.

Semantics, for a row of ``T`` tokens: the longest ``n`` in ``[min_n, max_n]``
whose last ``n`` tokens also start at some ``j <= T - n - 1`` (the occurrence
may overlap the suffix); among those, the earliest ``j``. The drafts are
``tokens[j + n : j + n + k']`` with ``k' = min(k, max_model_len - T, T - j - n)``.

Occurrences are indexed by their END ``e = j + n - 1``: the bound ``e <= T - 2``
does not depend on ``n``, so one boolean ``[rows, max_len]`` mask, ANDed with
one shifted comparison per ``n``, holds the matches of every length in turn.
"""

import torch


def propose_ngram_drafts(
    tokens: torch.Tensor,  # [num_rows, max_len] int32, garbage past lengths
    lengths: torch.Tensor,  # [num_rows] int64: tokens known in each row
    k: int,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> drafts [num_rows, k] int32 (0 past each row's count), counts [num_rows]
    int64. Rows with ``lengths >= max_model_len`` get no drafts, as in vLLM's
    ``NgramProposer.propose``."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got {min_n=}, {max_n=}")
    device = tokens.device
    num_rows, max_len = tokens.shape
    drafts = torch.zeros(num_rows, k, dtype=torch.int32, device=device)
    counts = torch.zeros(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0 or max_len < 2 or k <= 0:
        return drafts, counts

    lengths = lengths.to(torch.int64)
    ends = torch.arange(max_len, device=device)
    # After step n, is_match[r, e]: tokens[e-n+1 : e+1] == tokens[T-n : T], e <= T-2.
    is_match = ends[None, :] <= (lengths - 2)[:, None]
    best_n = torch.zeros(num_rows, dtype=torch.int64, device=device)
    best_end = torch.zeros(num_rows, dtype=torch.int64, device=device)
    # An end e <= max_len - 2 bounds the match length by max_len - 1.
    for n in range(1, min(max_n, max_len - 1) + 1):
        m = n - 1
        suffix_token = tokens.gather(1, (lengths - 1 - m).clamp(min=0)[:, None])
        # Functional, no in-place update of a slice or view of another dtype:
        # inductor miscompiled those (drafts never accepted, an index out of
        # bounds), where eager and dynamo's eager backend agreed.
        shifted = torch.nn.functional.pad(
            tokens[:, : max_len - m] == suffix_token, (m, 0), value=False
        )
        is_match = is_match & shifted
        # The earliest matching end (max_len where none matches): a min over
        # the ends, where an argmax over the booleans as bytes had inductor's
        # CPU kernel fail its own bounds check (an end past the row) on the
        # real model.
        first_end = torch.where(is_match, ends[None, :], max_len).amin(dim=1)
        has_match = first_end < max_len
        # Matches are nested (length n implies n - 1), so the last n wins.
        best_n = torch.where(has_match, n, best_n)
        best_end = torch.where(has_match, first_end, best_end)

    start = best_end + 1  # j + n: the first token after the match
    counts = torch.minimum(
        torch.minimum(lengths - start, max_model_len - lengths),
        torch.full_like(lengths, k),
    ).clamp(min=0)
    counts = torch.where(best_n >= min_n, counts, 0)
    offsets = torch.arange(k, device=device)
    positions = (start[:, None] + offsets[None, :]).clamp(max=max_len - 1)
    drafts = torch.where(
        offsets[None, :] < counts[:, None], tokens.gather(1, positions), 0
    ).to(torch.int32)
    return drafts, counts
