"""Pairwise covering designs for the compatibility matrix's tests: rows of
settings, one setting of each factor per row, every two settings of two
factors together in some row.

allpairspy builds the rows, but with a filter (settings that cannot run
together) it can leave pairs out that some runnable row would hold: the
rows here are its rows and then one more for each pair it left out.
"""

from collections.abc import Callable, Sequence
from itertools import combinations
from typing import Any

from allpairspy import AllPairs

Row = list[Any]


def covering_rows(
    factors: Sequence[Sequence[Any]],
    is_runnable: Callable[[Row], bool] = lambda row: True,
) -> list[Row]:
    """Rows that hold every pair of two factors' settings that some
    runnable row can hold. ``is_runnable`` may see a row's first settings
    only (allpairspy asks as it builds a row)."""
    rows = [list(row) for row in AllPairs(list(factors), filter_func=is_runnable)]
    # Rows added here, each with the factors its pairs fixed: the others are
    # free to take a later pair.
    added: list[tuple[Row, set[int]]] = []
    for (i, j), (x, y) in uncovered_pairs(factors, rows):
        if any(row[i] == x and row[j] == y for row in rows):
            continue  # a row added for an earlier pair holds it
        # An added row takes the pair where its fixed factors agree with it.
        free = [
            row
            for row, fixed in added
            if all(row[k] == v for k, v in ((i, x), (j, y)) if k in fixed)
        ]
        for base in free + rows:
            row = list(base)
            row[i], row[j] = x, y
            if not is_runnable(row):
                continue
            if base in free:
                entry = next(e for e in added if e[0] is base)
                base[:] = row
                entry[1].update((i, j))
            else:
                rows.append(row)
                added.append((row, {i, j}))
            break
    return rows


def uncovered_pairs(
    factors: Sequence[Sequence[Any]], rows: Sequence[Row]
) -> list[tuple[tuple[int, int], tuple[Any, Any]]]:
    """((factor i, factor j), (setting of i, setting of j)) of every pair
    no row holds."""
    return [
        ((i, j), (x, y))
        for (i, a), (j, b) in combinations(enumerate(factors), 2)
        for x in a
        for y in b
        if not any(row[i] == x and row[j] == y for row in rows)
    ]
