"""The largest per-device batch size under a memory budget: a bisection over batch sizes guided by the peaks measured.

[Note: the batch search]
``osdp plan`` asks, for OSDP and for each uniform baseline, the largest per-device batch ``b`` whose peak fits the
budget. Each answer to "does ``b`` fit?" (a probe) costs a prediction for a fixed plan and a minimum-memory solve for
OSDP, near the largest batch the costliest kind (neither a plan under the budget nor a bound above it comes at once).
Peak memory grows with the batch, so the answers are true up to some ``b`` and false beyond, and every sequence of
probes that ends with ``b`` fitting and ``b + 1`` not gives the same answer: the search keeps that bracket, and only
the choice of the next probe is free. Doubling from 1 and then halving the bracket spends ``2 log2 b`` probes, most of
them far from the answer. A probe also says how large the peak came out, and every figure of a profile is affine in
the batch size (``estimate.py``'s [Note: batch size]): the line through the last two probes' peaks says where it
crosses the budget, and the next probe goes there (then to its neighbour, which settles the bracket when the line was
right). A guess may do worse than the plain step (doubling, then halving): there are never more such misses than
plain steps, so that the search never takes much more than twice the probes the plain steps alone would. The guesses
choose which probes run, never the answer: it is the one the bracket proves, whatever the peaks said.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Probe", "largest_batch"]


@dataclass(frozen=True)
class Probe:
    """One answer of the search's question at a batch size.

    Attributes:
        fits: whether some plan (or the plan asked about) fits the budget at this batch size.
        peak: the peak the answer rests on, in the budget's units (a plan's peak, or the smallest budget found): only
            the next probe's choice depends on it; ``nan`` when unknown.
    """

    fits: bool
    peak: float = math.nan


def largest_batch(probe: Callable[[int], Probe], budget: float, *, limit: int = 1 << 16) -> int:
    """The largest ``b`` in ``[1, limit]`` with ``probe(b).fits``, for a ``probe`` that fits up to some size and not
    beyond; 0 if even ``b = 1`` does not fit. The probes are chosen from the peaks they report and ``budget`` (see
    [Note: the batch search]); the answer does not depend on those."""
    if limit < 1:
        return 0
    low, high = 0, limit + 1  # fits at low (0: none needed), not at high (limit + 1: never probed)
    points: list[tuple[int, float]] = []
    guessed, misses, plain = False, 0, 1  # the last probe a guess; guesses that did worse than a plain step would
    size = 1
    while True:
        answer = probe(size)
        before = (low, high)
        if answer.fits:
            low = size
        else:
            high = size
        if high - low <= 1:
            return low
        points.append((size, answer.peak))
        # The plain step doubles the size while none has failed, then halves the bracket. A guess that did worse
        # counts as a miss, and there are never more misses than plain steps.
        if before[1] > limit:
            progress = high <= limit or low >= 2 * before[0]
        else:
            progress = 2 * (high - low) <= before[1] - before[0]
        misses += guessed and not progress
        guess = _crossing(points, budget) if misses < plain else None
        guessed = guess is not None
        if guess is None:
            plain += 1
            guess = 2 * low if high > limit else (low + high) // 2
        size = min(max(guess, low + 1), high - 1)


def _crossing(points: list[tuple[int, float]], budget: float) -> int | None:
    """The largest batch size under ``budget`` on the line through the last two probes at distinct sizes whose peaks
    are known and grow with the batch; ``None`` where there is no such line."""
    known = [(b, p) for b, p in points if math.isfinite(p)]
    if len(known) < 2:
        return None
    b2, p2 = known[-1]
    b1, p1 = next(((b, p) for b, p in reversed(known) if b != b2), (b2, p2))
    if b1 == b2 or p1 == p2 or (p2 - p1) / (b2 - b1) <= 0:
        return None
    crossing = b2 + (budget - p2) / ((p2 - p1) / (b2 - b1))
    return math.floor(crossing) if math.isfinite(crossing) else None
