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

The *master* cuts each run into *gaps* of consecutive blocks (the first ``head`` and last ``tail`` blocks a gap each,
the blocks between one gap) and holds per gap one integer count per option. A row whose coefficient vector is the
same over a whole gap (every global instant, the instants at blocks in gaps of one) is a linear function of the
counts and is kept exactly. A row anchored inside a gap (its coefficients change there) takes the gap's most common
vector and, at each of the few other positions, the least any option adds beyond it: a weaker row that every plan
still meets; one that singles out more than :data:`_LOCAL` positions is left out. The optimizer step's maximum of
temporaries takes, per option of a run, a binary "used" that its counts force.

What those rows lose binds at tight budgets: the blocks that keep nothing in forward (full recomputation) fill a
run, each forward instant near its end sees the level of the whole run, and the master, which sees only the least
the gap's last block can add, picks counts no order fits. So rows are added for the *families* whose rows an
arrangement broke (:class:`Family`: the rows of one instant anchored at each block in turn, seeing the blocks before
a window through one vector ``a`` and those after it through ``b``). For a gap ``G`` whose every block anchors one of
the family's rows, and an option ``o`` used in ``G``, the row anchored at the last ``o`` block of ``G`` sees the
other ``o`` blocks of ``G`` before it (``a[o]`` each), its own window, and every other block of ``G`` at least at
``min(a, b)``; a binary ``used[G, o]`` (forced by the count) switches that row on. Without ``o`` it still bounds the
row anchored at the gap's last block, whatever that block takes. Every row holds for every plan, so the master stays
a relaxation of the ILP: its dual bound is a lower bound of the optimum (``"count master"``).

Its counts are then *arranged*: each gap's blocks are ordered, each candidate order evaluated on the ILP's own rows
(:meth:`~lightning_osdp.solver.linear.LinearBackend.peak`). The orders tried put the blocks whose forward keeps least
first (the level before every later instant is then the smallest the counts allow) and those whose backward frees most
last, the reverse ties, and each option's blocks all at the end or all at the start; once a row of a long run broke,
also each family's order of largest ``window - a`` first (the order that minimises the largest of its rows alone, when
``a`` is what a block keeps for the later ones). An order that fits is a plan of the ILP with the master's step time, so
it is proved by the master's bound. When none fits, on long runs the families of the rows it broke are added and the
master solved again; short runs (the blocks held apart an eighth of each or more), and long ones once no family is left
to add, double the ends kept as gaps of one (to :data:`_SHORT_ENDS` or :data:`_ENDS`): on a short run that makes the
master nearly the ILP, at little cost, where a family's rows cost HiGHS more than they prove. Past that the general path
takes over with the master's bound, and repairs its last arrangement first. Nothing is proved of an arrangement that was
not found: the answer is always a plan checked on every row, and a bound of a relaxation.

Weighed and not taken (``docs/benchmarks.md``, "Identical blocks counted, then arranged", has the figures):

- *Cutting gaps where the broken rows are anchored* (a lazy loop that makes those rows exact): the row that breaks
  moves one block towards the start of the run each round, the master's bound does not move, and each round costs
  more than the last.
- *Every block a gap of its own* (the ordered count formulation: exact, the ILP itself): with prefix-count variables
  (the counts of the first ``p`` blocks, so that a row reads two of them) its rows are sparse, but HiGHS needs many
  times the targets to prove the optimum, as on the ILP.
- *A dynamic programme over the arrangements*, which would prove that no order fits: its states are the count vectors
  of a prefix, the product of the counts' ranges (millions at 1,997 planning units), and a "no" would still need a
  cut excluding those counts, one count vector at a time; a family's rows exclude them by the row that breaks.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pulp

from lightning_osdp.cost_model.parts import MemoryParts
from lightning_osdp.cost_model.timeline import SegmentChoice, TimelineInput, build_timeline
from lightning_osdp.solver.highs import SolverError, run_mip
from lightning_osdp.solver.linear import MIB, LinearBackend, option_coefficients

if TYPE_CHECKING:
    from lightning_osdp.solver.ilp import Incumbent

__all__ = ["CountBackend", "Family", "Master", "Run", "count_and_arrange", "families", "find_runs", "formulate_master"]

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
    binaries: dict[Hashable, list[pulp.LpVariable]]  # per choice outside every run, one binary per option
    gaps: list[list[range]]  # per run, its positions cut into gaps
    counts: list[list[list[pulp.LpVariable]]]  # per run and gap, one integer per option
    relaxed: int  # rows some gap sees through more than one vector (bounded from below)

    def read(self, cb: CountBackend) -> tuple[dict[Hashable, Hashable], list[list[dict[int, int]]]]:
        """The options of the choices outside runs, and per run and gap the count of each option (by index)."""
        chosen = {
            key: cb.options[key][max(range(len(xs)), key=lambda i: xs[i].value() or 0.0)]
            for key, xs in self.binaries.items()
        }
        counts = [
            [{i: k for i, n in enumerate(ns) if (k := round(n.value() or 0.0)) > 0} for ns in gaps]
            for gaps in self.counts
        ]
        return chosen, counts


def formulate_master(
    cb: CountBackend,
    runs: Sequence[Run],
    rhs: float | None,
    cuts: Sequence[Collection[int]],
    families: Sequence[Family] = (),
) -> Master:
    """The count master with each run's positions cut into gaps where ``cuts`` (per run, positions that start a gap)
    say: the step time under ``rhs`` (MiB), or (``rhs=None``) the peak."""
    prob = pulp.LpProblem("osdp_counts", pulp.LpMinimize)
    binaries: dict[Hashable, list[pulp.LpVariable]] = {}
    for key, opts in cb.options.items():
        if key not in cb.position:
            binaries[key] = [pulp.LpVariable(f"x_{len(binaries)}_{i}", cat=pulp.LpBinary) for i in range(len(opts))]
            prob += pulp.lpSum(binaries[key]) == 1
    gaps: list[list[range]] = []
    counts: list[list[list[pulp.LpVariable]]] = []
    for r, run in enumerate(runs):
        edges = sorted({0, len(run.keys), *(c for c in cuts[r] if 0 < c < len(run.keys))})
        gaps.append([range(a, b) for a, b in itertools.pairwise(edges)])
        counts.append([])
        for j, gap in enumerate(gaps[r]):
            cat = pulp.LpBinary if len(gap) == 1 else pulp.LpInteger
            ns = [pulp.LpVariable(f"n_{r}_{j}_{i}", 0, len(gap), cat=cat) for i in range(len(run.options))]
            counts[r].append(ns)
            prob += pulp.lpSum(ns) == len(gap)

    def affine(e: Expr) -> tuple[pulp.LpAffineExpression, bool, int]:
        """``e`` over the master's variables, whether it is exact, and how many positions it is not: a gap that
        ``e`` sees through more than one vector (a row anchored inside it) takes its most common vector, each other
        position the least it adds beyond it (a bound every plan meets)."""
        terms: list[tuple[pulp.LpVariable, float]] = []  # each variable once (pulp keeps a variable's last term)

        def add(xs: Sequence[pulp.LpVariable], v: np.ndarray) -> None:
            terms.extend((x, c) for x, c in zip(xs, v.tolist(), strict=True) if c)

        const, off = e.const, 0
        for key, v in e.units.items():
            add(binaries[key], v)
        for r, pieces in e.runs.items():
            for gap, ns in zip(gaps[r], counts[r], strict=True):
                seen = [(min(t, gap[-1]) - max(s, gap[0]) + 1, v) for s, t, v in pieces if _overlaps(gap, s, t)]
                if not seen:
                    continue
                unseen = len(gap) - sum(n for n, _ in seen)
                if unseen:
                    seen.append((unseen, np.zeros_like(seen[0][1])))  # positions the row does not see
                u = max(seen, key=lambda t: t[0])[1]
                for n, v in seen:
                    if v is not u and not np.array_equal(v, u):
                        const += n * float((v - u).min())
                        off += n
                add(ns, u)
        return pulp.LpAffineExpression(terms, constant=const), off == 0, off

    objective, exact, _ = affine(cb.objective)
    if not exact:
        raise ValueError("identical blocks with different step times: not a run")
    peak = None
    if rhs is None:
        peak = pulp.LpVariable("peak_mib")
        prob += pulp.LpAffineExpression([(peak, 1.0)])
    else:
        prob += objective
    maxima: dict[int, pulp.LpVariable] = {}
    relaxed = 0

    def bound(row: pulp.LpAffineExpression) -> None:
        if peak is not None:
            prob.addConstraint(row - peak <= 0)
        else:
            assert rhs is not None
            prob.addConstraint(row <= rhs)

    for _, e in cb.rows:
        row, exact, off = affine(e)
        relaxed += not exact
        if off > _LOCAL:
            continue
        if e.maximum is not None:
            if id(e.maximum) not in maxima:
                maxima[id(e.maximum)] = _maximum(prob, e.maximum, affine, counts, runs, len(maxima))
            row = row + maxima[id(e.maximum)]
        bound(row)
    used: dict[tuple[int, int, int], pulp.LpVariable] = {}
    for f in families:
        r, size = f.run, len(runs[f.run].keys)
        for j, gap in enumerate(gaps[r]):
            if len(gap) < 2 or not set(gap) <= f.centres:
                continue
            outside = [(0, gap.start - 1, f.before)] if gap.start else []
            outside += [(gap.stop, size - 1, f.after)] if gap.stop < size else []
            base = affine(Expr(f.row.const, f.row.units, {r: outside}))[0]
            base += sum(
                float((w - (f.before if k < f.centre else f.after)).min())
                for k, w in enumerate(f.window)
                if k != f.centre
            )
            least, tail = np.minimum(f.before, f.after), f.window[f.centre] - f.before
            low = float(tail.min())
            base += pulp.LpAffineExpression(
                [(n, float(x)) for n, x in zip(counts[r][j], least, strict=True) if x], constant=low
            )
            bound(base)
            for i, n in enumerate(counts[r][j]):
                if f.before[i] == least[i] and tail[i] == low:
                    continue  # the row above
                last = base + float(f.before[i] - least[i]) * n
                if tail[i] > low:
                    if (r, j, i) not in used:
                        used[(r, j, i)] = pulp.LpVariable(f"last_{r}_{j}_{i}", cat=pulp.LpBinary)
                        prob += n - len(gap) * used[(r, j, i)] <= 0
                    last += float(tail[i] - low) * used[(r, j, i)]
                bound(last)
    return Master(prob, binaries, gaps, counts, relaxed)


@dataclass(eq=False)
class Family:
    """Rows of run ``run`` that see its blocks before a window through one vector, ``before``, and those after it
    through another, ``after``, with the same vectors in the window (one instant, anchored at each block in turn):
    one of them (``row``), the window's vectors, its ``centre`` (the place in it of widest spread), the positions
    the centre takes over the family's rows, and their indices in ``CountBackend.rows``."""

    run: int
    row: Expr
    before: np.ndarray
    window: list[np.ndarray]
    after: np.ndarray
    centre: int
    centres: set[int] = field(default_factory=set)
    rows: set[int] = field(default_factory=set)


def families(cb: CountBackend, runs: Sequence[Run]) -> list[Family]:
    """The :class:`Family` s of ``cb``'s rows, over every run."""
    groups: dict[Any, Family] = {}
    for index, (_, e) in enumerate(cb.rows):
        if len(e.runs) != 1 or e.maximum is not None:
            continue
        ((r, pieces),) = e.runs.items()
        if len(pieces) < 3 or len(pieces) > 5:
            continue
        (s0, _, a), *middle, (_, t1, b) = pieces
        starts = [s for s, _, _ in pieces]
        ends = [t + 1 for _, t, _ in pieces[:-1]]
        if s0 or t1 != len(runs[r].keys) - 1 or starts[1:] != ends or any(s != t for s, t, _ in middle):
            continue
        window = [v for _, _, v in middle]
        centre = max(range(len(window)), key=lambda k: float(np.ptp(window[k])))
        key = (r, a.tobytes(), *(v.tobytes() for v in window), b.tobytes(), e.const)
        key += tuple((k, v.tobytes()) for k, v in e.units.items())
        family = groups.setdefault(key, Family(r, e, a, window, b, centre))
        family.centres.add(middle[centre][0])
        family.rows.add(index)
    return list(groups.values())


def _maximum(
    prob: pulp.LpProblem,
    values: list[Expr],
    affine: Any,
    counts: list[list[list[pulp.LpVariable]]],
    runs: Sequence[Run],
    index: int,
) -> pulp.LpVariable:
    """A variable at least every one of ``values`` (the optimizer step's temporaries, one per choice): a choice in a
    run takes, per option, the smallest of its blocks' values times a binary its count forces to 1."""
    top = pulp.LpVariable(f"maximum_{index}")
    smallest: dict[int, np.ndarray] = {}
    for e in values:
        if not e.runs:
            prob += affine(e)[0] - top <= 0
            continue
        if e.units or len(e.runs) > 1 or e.const:
            continue  # not one choice's value: left out (a relaxation)
        ((r, pieces),) = e.runs.items()
        for _, _, v in pieces:
            smallest[r] = v if r not in smallest else np.minimum(smallest[r], v)
    for r, v in smallest.items():
        for i in range(len(v)):
            if v[i]:
                used = pulp.LpVariable(f"used_{index}_{r}_{i}", cat=pulp.LpBinary)
                prob += pulp.lpSum(ns[i] for ns in counts[r]) - len(runs[r].keys) * used <= 0
                prob += float(v[i]) * used - top <= 0
    return top


def _overlaps(inside: range, s: int, t: int) -> bool:
    return len(inside) > 0 and s <= inside[-1] and t >= inside[0]


def _largest_first(run: Run, tail: np.ndarray, i: int) -> tuple[float, float]:
    return -float(tail[i]), run.fwd_net[i]


def arrangements(run: Run, counts: Mapping[int, int], tails: Sequence[np.ndarray] = ()) -> list[list[Hashable]]:
    """Orders of a gap's blocks to try (see [Note: count and arrange]), each a list of options; ``tails``: per row
    family, what an option's block adds at its instant beyond what it keeps for later ones (largest first)."""
    keys: list[Callable[[int], tuple[float, float]]] = [
        lambda i: (run.fwd_net[i], -run.bwd_net[i]),
        lambda i: (-run.bwd_net[i], run.fwd_net[i]),
        lambda i: (run.fwd_net[i], run.bwd_net[i]),
        lambda i: (-run.fwd_net[i], -run.bwd_net[i]),
    ]
    keys += [functools.partial(_largest_first, run, t) for t in tails]
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


#: The count master's relative gap, as a share of the solve's: its bound is what proves the plan, and its root closes
#: most of the gap. (A hundredth gave slower plans on the 1,997-unit problem: other counts, that no order fitted.)
_MASTER_GAP = 0.1

#: The most blocks at the end of a run the count master holds apart (its gaps of one block) before the general path
#: takes over (see [Note: count and arrange]), by whether the peak is minimised.
_ENDS = {False: 2, True: 16}

#: The same for the step time when every run is short (see ``count_and_arrange``).
_SHORT_ENDS = 4

#: How far (MiB) above its limit a row's value must be to count as broken: clear of HiGHS's feasibility tolerance.
_TOLERANCE = 1e-6


def count_and_arrange(
    be: LinearBackend, incumbent: Incumbent, *, nodes: int, near: int
) -> str | tuple[dict[Hashable, Hashable], set[Hashable]] | None:
    """Runs of identical blocks counted, then arranged (see [Note: count and arrange]), the first phase of the solve
    (``ilp.py``'s [Note: solving]); the master runs for at most ``nodes`` of HiGHS's nodes. The master problem's dual
    bound is raised, an arrangement that fits every row offered, and when none does the families of the rows it broke
    are bounded in the master (long runs), or the ends held as gaps of one block double (short runs, and long ones with
    no family left to add), until the plan is proved or the ends reach :data:`_ENDS` (:data:`_SHORT_ENDS`). Returns
    ``"infeasible"`` when the master (a relaxation) proves no plan fits; when its last arrangement broke a row, that
    arrangement and the blocks near the ends of its runs (for ``ilp.PlanningProblem._search_neighbourhood`` to repair
    it: the first two and last ``near`` blocks of each run); else ``None``."""
    runs = find_runs(be.source)
    if not runs:
        return None
    cb = count_rows(be.source, be.options, runs)
    every: list[Family] | None = None  # found once an arrangement breaks a row
    taken: list[Family] = []  # the families the master bounds (those whose rows an arrangement broke)
    head, tail = 1, 2
    while not incumbent.clock.expired():
        cuts = [{*range(1, head + 1), *range(len(run.keys) - tail, len(run.keys))} for run in runs]
        master = formulate_master(cb, runs, incumbent.rhs, cuts, taken)
        try:
            _, result = run_mip(master.prob, dict, gap=incumbent.gap * _MASTER_GAP, clock=incumbent.clock, nodes=nodes)
        except SolverError:
            return None
        if result.status == "infeasible":
            return "infeasible"
        if result.lower is not None:
            incumbent.raise_bound(result.lower, "count master")
        tails = [[f.window[f.centre] - f.before for f in every or () if f.run == r] for r in range(len(runs))]
        chosen = _arrange(incumbent, runs, master, cb, tails)
        incumbent.offer(chosen)
        if incumbent.within_gap() or not master.relaxed:
            return None
        limit = result.objective if incumbent.rhs is None else incumbent.rhs
        broken = set(np.flatnonzero(be.rows(chosen) > limit + _TOLERANCE).tolist())
        # Short runs (the ends held apart an eighth of each or more) keep the master of binary ends, doubled: nearly
        # the ILP on them, and light; long ones take the families first.
        short = all(8 * (head + tail) >= len(run.keys) for run in runs)
        if not short:
            every = families(cb, runs) if every is None else every
            more = [f for f in every if f not in taken and f.rows & broken]
            if more:
                taken += more
                continue
        if tail >= max(_ENDS[incumbent.minimises_peak], _SHORT_ENDS if short else 0):
            ends = {key for run in runs for key in run.keys[:2] + run.keys[-near:]}
            return (chosen, ends) if not incumbent.fits(incumbent.score(chosen)[0]) else None
        head, tail = 2 * head, 2 * tail
    return None


def _arrange(
    incumbent: Incumbent, runs: Sequence[Run], master: Master, cb: CountBackend, tails: list[list[np.ndarray]]
) -> dict[Hashable, Hashable]:
    """The master's solution as a plan: each gap's counts in the order of smallest peak among those tried (see
    [Note: count and arrange]), gap by gap; its step time is the counts'."""
    chosen, counts = master.read(cb)
    orders = [[arrangements(run, c, tails[r]) for c in counts[r]] for r, run in enumerate(runs)]
    for r, run in enumerate(runs):
        for gap, tried in zip(master.gaps[r], orders[r], strict=True):
            chosen.update(zip((run.keys[p] for p in gap), tried[0], strict=True))
    for r, run in enumerate(runs):
        for gap, tried in zip(master.gaps[r], orders[r], strict=True):
            if len(tried) > 1:
                chosen = min(
                    ({**chosen, **dict(zip((run.keys[p] for p in gap), order, strict=True))} for order in tried),
                    key=lambda c: incumbent.score(c)[0],
                )
    return chosen
