"""Runs of identical blocks solved by counting: a master problem over how many blocks of a run take each option,
and the arrangement of those counts checked on the exact rows.

[Note: count and arrange]
A run is a stretch of identical segments next to each other in forward order (a Transformer's blocks): the same
options with the same simulated costs. The step time depends only on how many of a run's blocks take each option,
and every row of the ILP (an instant of the timeline) sees the run's blocks through a few coefficient vectors: one
for the blocks before the instant (their forward net added to the level), one for those after it, and the two or
three blocks around it (pending and prefetched buffers, its own peak). :class:`CountBackend` walks the timeline once
more with each expression's coefficients over a run's positions kept as pieces of equal vectors, so that this
structure is read off the rows themselves, not assumed.

The *master* keeps the first ``head`` and last ``tail`` blocks of each run as binaries (like every other choice)
and the blocks between them, the *interior*, as one integer count per option. A row whose coefficient vector is the
same over the whole interior (the instants outside the interior: every global instant, the blocks at the ends) is a
linear function of the counts and is kept exactly. A row anchored inside the interior (its coefficients change
there) singles out a few positions: up to :data:`_LOCAL` of them, each is bounded by the least any option adds there
(beyond the interior's common vector), a weaker row that every plan still meets; a row singling out more is
dropped. The optimizer step's maximum of temporaries takes, per interior option, a binary "used" that the option's
count forces. Every plan of the ILP is a point of the master with the same step time, so the master is a
relaxation of the ILP: its dual bound is a lower bound of the optimum (``"count master"``).

Its counts are then *arranged*: the interior blocks are ordered, each candidate order evaluated on the ILP's own
rows (:meth:`~lightning_osdp.solver.linear.LinearBackend.peak`). The orders tried put the blocks whose forward keeps
least first (the level before every later instant is then the smallest the counts allow) and those whose backward
frees most last, the reverse ties, and each option's blocks all at the end or all at the start; an order that fits
is a plan of the ILP with the master's step time, so it is proved by the master's bound. When none fits, the rows
dropped are what the counts broke: the ends kept as binaries double (``head``, ``tail``) and the master is solved
again, so that every round either proves the plan or makes the master tighter (once the ends meet, the master *is*
the ILP). Past a few rounds (``ilp._ENDS``) the general path takes over with the master's bound, and repairs its last
arrangement first. Nothing is proved of an arrangement that was not found: the answer is always a plan checked on
every row, and a bound of a relaxation.

Why not a dynamic programme over the arrangements, which would prove that no order fits: its states are the count
vectors of a prefix, the product of the counts' ranges, and at 1,997 planning units (500 blocks, three or four
options used) that is millions of states; and a "no" would still need a cut excluding those counts, one count vector
at a time. The rows an arrangement breaks are those near the end of a run, where the level before an instant is
nearly the whole run's (forward nets are never negative), and those the growing ends take into the master exactly.
Where that does not close the gap (a budget so tight that the blocks which keep nothing in forward fill the run's end
and every instant there binds), the general path takes over with the master's bound.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pulp

from lightning_osdp.cost_model.parts import MemoryParts
from lightning_osdp.cost_model.timeline import SegmentChoice, TimelineInput, build_timeline
from lightning_osdp.solver.linear import MIB, option_coefficients

__all__ = ["CountBackend", "Master", "Run", "find_runs", "formulate_master"]

#: The fewest blocks a run needs for the count master to pay (shorter ones stay binaries).
MIN_RUN = 6

#: The most positions of an interior a row may single out to be bounded in the master (see ``formulate_master``).
_LOCAL = 4

Piece = tuple[int, int, np.ndarray]  # positions [start, end] of a run, and the coefficient vector they share


@dataclass(frozen=True)
class Run:
    """Identical segments next to each other: their keys in forward order, their options, and per option the level
    change over the segment's forward and over its backward (MiB), which the orders tried sort by."""

    keys: tuple[Hashable, ...]
    options: tuple[Hashable, ...]
    fwd_net: tuple[float, ...]
    bwd_net: tuple[float, ...]


def find_runs(spec: TimelineInput[Any], minimum: int | None = None) -> list[Run]:
    """The runs of at least ``minimum`` (default :data:`MIN_RUN`) identical segments in ``spec`` (adjacent items
    sharing one options dict: the problem simulates identical segments once and shares the result)."""
    minimum = MIN_RUN if minimum is None else minimum
    runs: list[Run] = []
    current: list[SegmentChoice] = []

    def close() -> None:
        if len(current) >= minimum:
            costs = current[0].options
            runs.append(
                Run(
                    tuple(s.key for s in current),
                    tuple(costs),
                    tuple(c.fwd_net.total / MIB for c in costs.values()),
                    tuple(c.bwd_net.total / MIB for c in costs.values()),
                )
            )
        current.clear()

    for item in spec.items:
        if isinstance(item, SegmentChoice) and current and item.options is current[0].options:
            current.append(item)
            continue
        close()
        if isinstance(item, SegmentChoice):
            current.append(item)
    close()
    return runs


@dataclass
class Expr:
    """``const + sum_key units[key][option] + sum_run pieces`` (+ the maximum it adds, for the optimizer step)."""

    const: float = 0.0
    units: dict[Hashable, np.ndarray] = field(default_factory=dict)
    runs: dict[int, list[Piece]] = field(default_factory=dict)
    maximum: list[Expr] | None = None


def _at(pieces: list[Piece], p: int) -> np.ndarray | None:
    i = bisect.bisect_right([s for s, _, _ in pieces], p) - 1
    return pieces[i][2] if i >= 0 and pieces[i][1] >= p else None


def _merge(a: list[Piece], b: list[Piece], sign: float) -> list[Piece]:
    cuts = sorted({s for s, _, _ in a} | {e + 1 for _, e, _ in a} | {s for s, _, _ in b} | {e + 1 for _, e, _ in b})
    out: list[Piece] = []
    for lo, hi in itertools.pairwise(cuts):
        va, vb = _at(a, lo), _at(b, lo)
        if va is None and vb is None:
            continue
        v = va if vb is None else (sign * vb if va is None else va + sign * vb)
        assert v is not None
        if out and out[-1][1] == lo - 1 and np.array_equal(out[-1][2], v):
            out[-1] = (out[-1][0], hi - 1, out[-1][2])
        else:
            out.append((lo, hi - 1, v))
    return out


def _combine(a: Expr, b: Expr, sign: float) -> Expr:
    if b.maximum is not None and (sign < 0 or a.maximum is not None):
        raise NotImplementedError("the timeline adds one maximum, once")
    units = dict(a.units)
    for k, v in b.units.items():
        units[k] = units[k] + sign * v if k in units else sign * v
    runs = dict(a.runs)
    for r, pieces in b.runs.items():
        runs[r] = _merge(runs[r], pieces, sign) if r in runs else [(s, e, sign * v) for s, e, v in pieces]
    return Expr(a.const + sign * b.const, units, runs, a.maximum if a.maximum is not None else b.maximum)


class CountBackend:
    """The timeline's backend for the count master (see [Note: count and arrange]): the same expressions as
    :class:`~lightning_osdp.solver.linear.LinearBackend`'s, flattened (no auxiliary variables), with a run's
    positions held as pieces of equal coefficient vectors."""

    def __init__(self, options: Mapping[Hashable, Sequence[Hashable]], runs: Sequence[Run]) -> None:
        self.options = {k: list(v) for k, v in options.items()}
        self.position = {key: (r, p) for r, run in enumerate(runs) for p, key in enumerate(run.keys)}
        self.rows: list[tuple[str, Expr]] = []
        self.objective = Expr()

    def _vector(self, key: Hashable, values: Mapping[Hashable, float]) -> Expr:
        v = np.array([values.get(o, 0.0) for o in self.options[key]], dtype=np.float64)
        if key in self.position:
            r, p = self.position[key]
            return Expr(runs={r: [(p, p, v)]})
        return Expr(units={key: v})

    def bounds(self, e: Expr) -> tuple[float, float]:
        """Lower and upper bounds of ``e`` over every assignment (as :meth:`LinearBackend.bounds` for a choice)."""
        lo = hi = e.const
        for v in e.units.values():
            lo, hi = lo + v.min(), hi + v.max()
        for pieces in e.runs.values():
            for s, t, v in pieces:
                lo, hi = lo + (t - s + 1) * v.min(), hi + (t - s + 1) * v.max()
        if e.maximum:
            inner = [self.bounds(m) for m in e.maximum]
            lo, hi = lo + max(b[0] for b in inner), hi + max(b[1] for b in inner)
        return lo, hi

    # ------------------------------------------------------------------ the timeline's Backend protocol
    def const(self, parts: MemoryParts) -> Expr:
        return Expr(parts.total / MIB)

    def choice(self, key: Hashable, values: Mapping[Hashable, MemoryParts]) -> Expr:
        return self._vector(key, {o: v.total / MIB for o, v in values.items()})

    def add(self, a: Expr, b: Expr) -> Expr:
        return _combine(a, b, 1.0)

    def sub(self, a: Expr, b: Expr) -> Expr:
        return _combine(a, b, -1.0)

    def checkpoint(self, label: str, value: Expr) -> None:
        self.rows.append((label, value))

    def checkpoint_options(
        self,
        label: str,
        base: Expr,
        cross: Sequence[Expr],
        key: Hashable,
        values: Mapping[Hashable, MemoryParts | None],
    ) -> None:
        if all(v is None for v in values.values()):
            return
        total = base
        for c in cross:
            total = self.add(total, c)
        coefficients = option_coefficients(values, sum(self.bounds(c)[1] for c in cross))
        self.checkpoint(label, self.add(total, self._vector(key, coefficients)))

    def materialize(self, value: Expr, name: str) -> Expr:
        return value

    def maximum(self, values: Sequence[Expr], name: str) -> Expr:
        return Expr(maximum=list(values)) if values else Expr()

    def seconds(self, key: Hashable, values: Mapping[Hashable, float]) -> None:
        self.objective = self.add(self.objective, self._vector(key, {o: v * 1e3 for o, v in values.items()}))

    def constant_seconds(self, seconds: float) -> None:
        self.objective = self.add(self.objective, Expr(seconds * 1e3))


def count_rows(
    spec: TimelineInput[Any], options: Mapping[Hashable, Sequence[Hashable]], runs: Sequence[Run]
) -> CountBackend:
    """The timeline of ``spec`` walked on :class:`CountBackend` (its rows and objective)."""
    cb = CountBackend(options, runs)
    build_timeline(spec, cb)
    return cb


@dataclass
class Master:
    """The count master in pulp (see [Note: count and arrange]) and how to read a plan's parts from its solution."""

    prob: pulp.LpProblem
    binaries: dict[Hashable, list[pulp.LpVariable]]  # per non-interior choice, one binary per option
    counts: list[list[pulp.LpVariable]]  # per run, one integer per option (its interior)
    interiors: list[range]  # per run, the interior's positions
    dropped: int  # rows anchored inside an interior: bounded from below, or left out

    def read(self, cb: CountBackend, runs: Sequence[Run]) -> tuple[dict[Hashable, Hashable], list[dict[int, int]]]:
        """The options of the choices held as binaries, and per run the count of each option (by index)."""
        chosen = {
            key: cb.options[key][max(range(len(xs)), key=lambda i: xs[i].value() or 0.0)]
            for key, xs in self.binaries.items()
        }
        counts = [
            {i: round(n.value() or 0.0) for i, n in enumerate(ns) if round(n.value() or 0.0) > 0} for ns in self.counts
        ]
        return chosen, counts


def formulate_master(cb: CountBackend, runs: Sequence[Run], rhs: float | None, head: int, tail: int) -> Master:
    """The count master with the first ``head`` and last ``tail`` blocks of each run as binaries: the step time
    under ``rhs`` (MiB), or (``rhs=None``) the peak."""
    prob = pulp.LpProblem("osdp_counts", pulp.LpMinimize)
    interiors = [range(min(head, len(run.keys)), max(len(run.keys) - tail, min(head, len(run.keys)))) for run in runs]
    binaries: dict[Hashable, list[pulp.LpVariable]] = {}
    for key, opts in cb.options.items():
        where = cb.position.get(key)
        if where is not None and where[1] in interiors[where[0]]:
            continue
        binaries[key] = [pulp.LpVariable(f"x_{len(binaries)}_{i}", cat=pulp.LpBinary) for i in range(len(opts))]
        prob += pulp.lpSum(binaries[key]) == 1
    counts = []
    for r, run in enumerate(runs):
        size = len(interiors[r])
        ns = [pulp.LpVariable(f"n_{r}_{i}", 0, size, cat=pulp.LpInteger) for i in range(len(run.options))]
        counts.append(ns)
        prob += pulp.lpSum(ns) == size

    def affine(e: Expr) -> tuple[pulp.LpAffineExpression, bool] | None:
        """``e`` over the master's variables, and whether it is exact: a row anchored inside an interior (its
        coefficients change there) is bounded from below, each of its few positions whose vector is not the
        interior's most common one taking the least any option adds there; ``None`` for one with many."""
        terms: list[tuple[pulp.LpVariable, float]] = []
        const, exact = e.const, True
        for key, v in e.units.items():
            terms.extend((x, float(c)) for x, c in zip(binaries[key], v, strict=True) if c)
        for r, pieces in e.runs.items():
            inside, keys = interiors[r], runs[r].keys
            within: list[tuple[int, np.ndarray]] = []  # (positions of the interior, vector)
            for s, t, v in pieces:
                explicit = [*range(s, min(t + 1, inside.start)), *range(max(s, inside.stop), t + 1)]
                for p in explicit:
                    terms.extend((x, float(c)) for x, c in zip(binaries[keys[p]], v, strict=True) if c)
                if _overlaps(inside, s, t):
                    within.append((min(t, inside[-1]) - max(s, inside[0]) + 1, v))
            if not within:
                continue
            zero = len(inside) - sum(n for n, _ in within)
            if zero:
                within.append((zero, np.zeros_like(within[0][1])))
            u = max(within, key=lambda t: t[0])[1]
            others = [(n, v) for n, v in within if not np.array_equal(v, u)]
            if sum(n for n, _ in others) > _LOCAL:
                return None
            for n, v in others:
                const += n * float((v - u).min())
                exact = False
            terms.extend((n, float(c)) for n, c in zip(counts[r], u, strict=True) if c)
        return pulp.LpAffineExpression(terms, constant=const), exact

    made = affine(cb.objective)
    if made is None or not made[1]:
        raise ValueError("identical blocks with different step times: not a run")
    objective = made[0]
    peak = None
    if rhs is None:
        peak = pulp.LpVariable("peak_mib")
        prob += pulp.LpAffineExpression([(peak, 1.0)])
    else:
        prob += objective
    maxima: dict[int, pulp.LpVariable] = {}
    dropped = 0
    for _, e in cb.rows:
        made = affine(e)
        if made is None or not made[1]:
            dropped += 1
        if made is None:
            continue
        row = made[0]
        if e.maximum is not None:
            if id(e.maximum) not in maxima:
                maxima[id(e.maximum)] = _maximum(prob, e.maximum, affine, counts, interiors, len(maxima))
            row = row + maxima[id(e.maximum)]
        if peak is not None:
            prob += row - peak <= 0
        else:
            assert rhs is not None
            prob += row <= rhs
    return Master(prob, binaries, counts, list(interiors), dropped)


def _maximum(
    prob: pulp.LpProblem,
    values: list[Expr],
    affine: Any,
    counts: list[list[pulp.LpVariable]],
    interiors: list[range],
    index: int,
) -> pulp.LpVariable:
    """A variable at least every one of ``values`` (the optimizer step's temporaries, one per choice): a choice in an
    interior takes, per option, the smallest of its positions' values times a binary its count forces to 1."""
    top = pulp.LpVariable(f"maximum_{index}")
    smallest: dict[int, np.ndarray] = {}
    for e in values:
        inner = {r: p for r, p in e.runs.items() if any(_overlaps(interiors[r], s, t) for s, t, _ in p)}
        if not inner:
            made = affine(e)
            if made is not None:
                prob += made[0] - top <= 0
            continue
        if e.units or len(inner) > 1 or e.const:
            continue  # not one choice's value: left out (a relaxation)
        ((r, pieces),) = inner.items()
        for s, t, v in pieces:
            if _overlaps(interiors[r], s, t):
                smallest[r] = v if r not in smallest else np.minimum(smallest[r], v)
    for r, v in smallest.items():
        size = len(interiors[r])
        for i, n in enumerate(counts[r]):
            used = pulp.LpVariable(f"used_{index}_{r}_{i}", cat=pulp.LpBinary)
            prob += n - size * used <= 0
            if v[i]:
                prob += float(v[i]) * used - top <= 0
    return top


def _overlaps(inside: range, s: int, t: int) -> bool:
    return len(inside) > 0 and s <= inside[-1] and t >= inside[0]


def arrangements(run: Run, counts: Mapping[int, int]) -> list[list[Hashable]]:
    """Orders of an interior's blocks to try (see [Note: count and arrange]), each a list of options."""
    keys = [
        lambda i: (run.fwd_net[i], -run.bwd_net[i]),
        lambda i: (-run.bwd_net[i], run.fwd_net[i]),
        lambda i: (run.fwd_net[i], run.bwd_net[i]),
        lambda i: (-run.fwd_net[i], -run.bwd_net[i]),
    ]
    out: list[list[Hashable]] = []
    for key in keys:
        order = [run.options[i] for i in sorted(counts, key=key) for _ in range(counts[i])]
        if order not in out:
            out.append(order)
    # Each option's blocks all at the end, and all at the start, the rest in the first order.
    first = sorted(counts, key=keys[0])
    for i in first:
        rest = [run.options[j] for j in first if j != i for _ in range(counts[j])]
        for order in (rest + [run.options[i]] * counts[i], [run.options[i]] * counts[i] + rest):
            if order not in out:
                out.append(order)
    return out
