"""The OSDP planner: an integer linear program choosing each planning unit's option under the memory budget.

[Note: the ILP]
Variables: one binary ``x[u, o]`` per planning unit ``u`` (a segment, the root, a tied group) and option ``o``
(see ``candidates.py``), with ``sum_o x[u, o] = 1``; continuous auxiliaries ``L_i`` for the running memory level
between segments (``L_i = L_{i-1} + sum_o x[s_i, o] * net[s_i, o]``, so that no row grows with the model) and
one ``T`` for the optimizer step's temporaries (``T >= temp[u]`` for every unit: a maximum).

Constraints: every instant of the cost model's timeline (``lightning_osdp/cost_model/timeline.py``) is one row
``level + cross-segment buffers + sum_o x[s, o] * peak[s, o, class] <= budget``: per segment, its largest
forward instant before and after it frees the previous unit's pending all-gather output, and its largest
backward instant in each of four classes (whether the later segment's reduce-scatter input and the all-gather
output prefetched for the earlier segment are alive); plus the global instants (step start, loss, final
reductions, optimizer step). These are exactly the instants :func:`~lightning_osdp.cost_model.predict` takes
the maximum of, evaluated on the same numbers: the plan's predicted peak is the ILP's, not a bound of it.

Objective: the predicted step time, ``compute + sum_{u,o} x[u, o] * added_seconds[u, o]``, where each option's
added seconds (exposed communication, copies, optimizer, overhead) are precomputed: exposure is per unit
(``max(0, communication - overlap * its compute)``), so the objective is linear.

[Note: solving]
A model with runs of identical blocks is first solved by counting them (``runs.py``'s [Note: count and arrange]): a
master problem over how many blocks of each run take each option, a relaxation whose dual bound is a lower bound, and an
arrangement of its counts checked on every row, which is then a plan with the master's step time (it has a few hundred
variables where the ILP has thousands). When it proves the gap the solve ends there; otherwise its plan and bound stay
with the incumbent and the general path follows, which is also the whole solve of a model without runs. When the
master's last arrangement broke a row, it is repaired first: a small branch and bound with its blocks near the ends of
each run free and the rest held to it (the master's counts are a few blocks from the faster plan; rounding's plan,
within the gap of the master's tight bound, can be slower). That branch and bound first looks only under the value the
master's bound proves (:meth:`Incumbent.proving`), as its cutoff, and stops at the first plan there: the solve stops at
that plan whatever the search would have found next, as it stops at the master's first arrangement that fits, and a
cutoff that tight prunes most of HiGHS's tree and spares its heuristics the plans above it. Only when it finds none is
the neighbourhood searched without a cutoff, for the plan the next phases start from. Then the LP relaxation is solved
(integrality dropped): a lower bound, with few fractional choices; each choice rounded to the most memory-frugal option
the LP uses gives a plan that fits. Then, each stopping once the gap is proved: a small branch and bound over the
fractional choices and a spread of others (the rest fixed) looks for the swaps rounding misses (the *neighbourhood*, on
deep models only: on a shallow one it would free every choice); and HiGHS's branch and bound on the whole problem with
the incumbent as its cutoff, ``gapRel`` and a node limit, what it proves deciding between a proven optimum, a solution
within the gap, a work-limit solution with the gap proved, infeasibility and failure. Every search stops on work, not on
seconds: [Note: work limits].

Each phase (``runs.count_and_arrange``, ``_search_neighbourhood``, ``_relax`` and ``_round_relaxation``,
``_branch_and_bound``) hands what it found to one :class:`Incumbent`: a plan replaces the one held only if it fits and
is faster (:meth:`Incumbent.improves`), a bound only if it is tighter, and the incumbent says when the plan held is
within the gap (the solve then stops) and what proves it.

[Note: the certificate]
The status a solve reports is made in one place, :meth:`Incumbent.result`, from two numbers: the value of the plan
returned and the lower bound held. No phase reports a status of its own, and a bound enters only from a phase that
proved it: the LP relaxation when HiGHS solved it to optimality (pulp reads HiGHS's time and iteration limits as
"Optimal", and the objective of a simplex stopped on the way bounds nothing), HiGHS's dual bound, the count
master's dual bound, and a search's cutoff (``value * (1 - gap)``, or just above ``settle_at`` when a question is
asked: :meth:`Incumbent.cutoff`) when the search *ran to its end* and found nothing under it.
A run with a cutoff ``c`` proves ``min(its dual bound, c)``, not its dual bound: HiGHS bounds only the plans under
the cutoff, and its dual bound can come out above the cutoff and above the incumbent itself. Taking it whole was
the false certificate ("optimal", "within gap 0.001" for a plan 0.1-0.3% from a fitting faster one:
``tests/test_solver.py``, ``test_every_status_holds_against_the_enumerated_optimum``). So was the last phase's
"within gap" whenever its run handed back no usable plan (one HiGHS's tolerances let break a row of the budget),
proved by nothing (``test_a_last_phase_without_a_proof_does_not_report_the_gap``). A search that ends without
proving the gap says what stopped it: ``"work limit (within gap X)"`` (its node limits), or ``"time limit (within
gap X)"`` (the safety net, see [Note: work limits]), with the gap the bound does prove.

[Note: work limits]
The plan is a function of the problem (profile, budget, options) alone: the same on every run, under any load and on
any machine. Until 0.1.x every phase stopped on wall-clock seconds (a quarter, a tenth, the rest of ``time_limit``),
so a loaded machine searched less and could return another plan and status (6,835.715 against 6,814.459 ms on the
297-unit benchmark problem). Now each HiGHS branch and bound stops on a number of nodes (``mip_max_nodes``, per
phase in :data:`_NODES`: the count master 2,000, the neighbourhood 100, the last phase 50);
HiGHS is deterministic for a given model and options (its ``random_seed`` is fixed at
its default, its parallel tasks do not change its path), and the LP relaxation runs to its optimum. HiGHS ends a
node-limited run with ``kSolutionLimit``, which pulp does not map (``highs.HiGHS.findSolutionValues``); the run is then
incomplete, and proves only its dual bound. The root node is not bounded by a node limit but by HiGHS's own
deterministic effort: it is most of a phase's time at 297 units (2-6 s). The limits were sized on
``benchmarks/solver_speed.py --units 300``: the same plans as the 10 s wall-clock limit gave on a quiet machine, in
4-15 s of CPU (``docs/benchmarks.md``, "Planning speed").

``time_limit`` (``solver_time_limit``) remains as a safety net only: each HiGHS run may take that many seconds, the
whole solve ``highs.RUNS`` (3) times that (a phase not started once it is past; the last phase still runs for a
second when no plan is held). A limit that is not reached changes nothing. One that is reached makes the plan the
machine's as much as the problem's, and the status says so whatever was proved: ``"time limit (within gap X)"``.
``tests/test_deterministic.py`` solves one problem repeatedly beside busy processes, and under a generous and a
short limit, and gets one plan and status.

"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import time
import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import pulp

from lightning_osdp.budget import format_bytes
from lightning_osdp.cost_model.config import CostModelConfig
from lightning_osdp.cost_model.network import as_topology
from lightning_osdp.cost_model.parts import MemoryParts
from lightning_osdp.cost_model.prediction import NumericBackend, Prediction, _predict
from lightning_osdp.cost_model.structure import (
    ROOT,
    LocalUnit,
    ModelInfo,
    build_segment,
    free_run,
    global_unit,
    layout,
    segment_bounds,
)
from lightning_osdp.cost_model.timeline import (
    FreeCosts,
    GlobalChoice,
    SegmentChoice,
    SegmentCosts,
    TimelineInput,
    build_timeline,
    simulate_free,
    simulate_segment,
)
from lightning_osdp.cost_model.units import SHARDED_MODES
from lightning_osdp.plan import MODES, Decision, Plan
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.solve_report import SolveReport
from lightning_osdp.solver import reuse
from lightning_osdp.solver.candidates import (
    RECOMPUTE_CHOICES,
    Candidates,
    Recompute,
    SegmentCandidate,
    SegmentOption,
    planning_units,
    segment_options,
)
from lightning_osdp.solver.highs import MIN_SECONDS, Clock, HiGHS, SolverError, SolveResult, relative_gap, run_mip
from lightning_osdp.solver.linear import MIB, LinearBackend, LinExpr
from lightning_osdp.solver.runs import count_and_arrange
from lightning_osdp.topology import Topology

__all__ = [
    "DEFAULT_GAP",
    "SOLVERS",
    "InfeasibleBudgetError",
    "PlanningProblem",
    "SolverError",
    "check_gap",
    "check_solver",
    "minimum_budget",
    "minimum_plan",
    "solve",
]

#: The MILP solver every phase runs on (see ``highs.py``'s [Note: the MILP solver]): HiGHS, the only one.
DEFAULT_SOLVER = "highs"

#: The MILP solvers a solve accepts (``"cbc"`` too, deprecated: :func:`check_solver`).
SOLVERS = (DEFAULT_SOLVER,)

#: The relative optimality gap a solve stops at by default (of the predicted step time).
DEFAULT_GAP = 1e-3


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget. ``minimum`` is the smallest budget any plan meets (bytes)."""

    def __init__(self, message: str, *, budget: int, minimum: int, consumers: list[tuple[str, int]]) -> None:
        super().__init__(message)
        self.budget = budget
        self.minimum = minimum
        self.consumers = consumers

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields: the default reduction would call __init__(message) alone. The strategy broadcasts
        # this error from rank 0 to every rank.
        return (_rebuild_infeasible, (str(self), self.budget, self.minimum, self.consumers))


def _rebuild_infeasible(message: str, budget: int, minimum: int, consumers: list[tuple[str, int]]) -> Any:
    return InfeasibleBudgetError(message, budget=budget, minimum=minimum, consumers=consumers)


class Incumbent:
    """The best plan the solver's phases have found so far, its value, and the lower bound that says how far from
    the optimum it can be, with what proves that bound (see [Note: solving]).

    Args:
        be: the ILP's pieces (a plan's peak and step time are evaluated on them).
        budget: the memory budget in bytes; ``None`` when the peak itself is minimised (then a plan's value is
            its peak, and every plan fits).
        gap: the relative gap at which the search stops.
        started: when the solve started (``time.perf_counter()``), for the seconds reported.
        time_limit: the wall-clock safety net, in seconds from ``started`` (see [Note: work limits]): the phases'
            runs are stopped at it, and a solve that hits it says so in its status.

    Attributes:
        chosen: the option per choice of the best plan found (``None`` until one fits).
        value: its objective (step time in ms, or peak in MiB); ``inf`` until one fits.
        lower: the best lower bound of the objective (``None`` until a phase proves one).
        proof: what proves ``lower``: ``"count master"``, ``"LP relaxation"`` or ``"branch and bound"``.
        clock: the safety net's :class:`Clock`.
    """

    def __init__(
        self, be: LinearBackend, *, budget: int | None, gap: float, started: float, time_limit: float = math.inf
    ) -> None:
        self.be = be
        self.rhs = None if budget is None else _rhs(budget)
        self.gap = gap
        self.started = started
        self.clock = Clock(time_limit, started)
        self.chosen: dict[Hashable, Hashable] | None = None
        self.value = math.inf
        self.lower: float | None = None
        self.proof = "LP relaxation"
        #: a value that settles the question asked (``minimum_budget(settle_at=...)``): a plan at or under it, or a
        #: bound above it
        self.settle_at: float | None = None

    @property
    def minimises_peak(self) -> bool:
        """Whether the objective is the peak (no budget) rather than the step time."""
        return self.rhs is None

    def score(self, chosen: Mapping[Hashable, Hashable]) -> tuple[float, float]:
        """``chosen``'s peak (MiB) and its value (step time in ms, or the peak when that is minimised)."""
        top = self.be.peak(chosen)
        return top, (top if self.rhs is None else self.be.step_time(chosen))

    def fits(self, top: float) -> bool:
        """Whether a peak of ``top`` MiB meets the budget."""
        return self.rhs is None or top <= self.rhs

    def improves(self, candidate: Mapping[Hashable, Hashable]) -> float | None:
        """``candidate``'s value when it fits and beats the incumbent, else ``None``."""
        top, value = self.score(candidate)
        return value if self.fits(top) and value < self.value else None

    def offer(self, candidate: dict[Hashable, Hashable] | None) -> bool:
        """Replace the incumbent by ``candidate`` if it :meth:`improves` it; whether it did."""
        if candidate is None:
            return False
        value = self.improves(candidate)
        if value is None:
            return False
        self.chosen, self.value = candidate, value
        return True

    def raise_bound(self, bound: float, proof: str) -> None:
        """Take ``bound`` (proved by ``proof``) if it is tighter than the lower bound held."""
        if self.lower is None or bound > self.lower:
            self.lower, self.proof = bound, proof

    def loss(self) -> float:
        """The relative gap between the incumbent's value and the lower bound."""
        return math.inf if self.lower is None else relative_gap(self.value, self.lower)

    def settled(self) -> bool:
        """Whether (``settle_at`` set) a plan at or under ``settle_at`` is held or a lower bound above it proved."""
        return self.settle_at is not None and (
            self.value <= self.settle_at
            or (self.lower is not None and self.lower >= self.settle_at * (1 + _SETTLE_MARGIN / 2))
        )

    def proving(self) -> float | None:
        """The value under which a plan would be :meth:`proved` by the lower bound held (``None`` without one): a
        search's cutoff that asks only for such a plan."""
        return None if self.lower is None else self.lower / (1 - self.gap)

    def cutoff(self) -> float | None:
        """What a search need look under, once a plan is held: better than it by more than the gap and, a question
        asked (``settle_at``), just above the value that settles it (a search that finds nothing under that proves
        the answer "no"); ``None`` while no plan is held."""
        if self.chosen is None:
            return None
        cutoff = self.value * (1 - self.gap)
        return cutoff if self.settle_at is None else min(cutoff, self.settle_at * (1 + _SETTLE_MARGIN))

    def proved(self) -> bool:
        """Whether a plan is held and proved within ``gap`` of the optimum by the bound held."""
        return self.chosen is not None and self.loss() <= self.gap + _ROUNDING

    def within_gap(self) -> bool:
        """Whether the search may stop: the plan held is :meth:`proved`, or the question asked is :meth:`settled`."""
        return self.proved() or self.settled()

    def elapsed(self) -> float:
        """Seconds since the solve started."""
        return time.perf_counter() - self.started

    def result(self, stopped: str = "work limit") -> tuple[dict[Hashable, Hashable] | None, SolveResult]:
        """The incumbent as the solve's answer, its status read from the plan's value and the bound held, and from
        nothing else (see [Note: the certificate]): ``"optimal"``, ``"within gap G"`` (the gap asked for) when the
        bound proves it, else ``stopped`` (what ended the search) with the gap the bound proves. A solve that hit
        the wall-clock safety net says so whatever it proved (``"time limit (within gap X)"``): its plan is the
        machine's load's as much as the problem's (see [Note: work limits])."""
        achieved = self.loss()
        if self.clock.hit:
            status = f"time limit (within gap {achieved:.2g})"
        elif self.proved():
            status = "optimal" if achieved <= 1e-9 + _ROUNDING else f"within gap {self.gap:g}"
        else:
            status = f"{stopped} (within gap {achieved:.2g})"
        return self.chosen, SolveResult(status, achieved, self.elapsed(), self.value, self.proof, self.lower)


@dataclass
class _Formulation:
    """The ILP in pulp (see :meth:`PlanningProblem._formulate`)."""

    prob: pulp.LpProblem
    xs: list[pulp.LpVariable]
    be: LinearBackend


#: How far above ``settle_at`` (relatively) a bound must be to settle the question "no": clear of HiGHS's tolerances
#: (a plan fits at ``settle_at`` less half a byte, a relative 1e-11 of a budget of GB).
_SETTLE_MARGIN = 2e-9

#: How far a relative gap may read above the one proved: a bound of ``value * (1 - gap)`` (what a cutoff search that
#: finds nothing proves) gives ``(value - bound) / value`` above ``gap`` by a rounding for half of all values.
_ROUNDING = 1e-12


class PlanningProblem:
    """The planning units, their options and the timeline input, built once per (profile, world size, options).

    Args:
        profile: the model's profile.
        world_size: ranks, or a :class:`~lightning_osdp.topology.Topology` (see
            :func:`~lightning_osdp.cost_model.network.as_topology`).
        modes: allowed modes (``hybrid_shard`` is left out when its shard group is the world and ``full_shard`` is
            allowed: the two are then the same thing, and one-node plans keep naming it ``full_shard``).
        splits: allowed split factors (already capped by ``max_split``).
        units: planning units overriding the automatic choice (see ``candidates.py``).
        config: cost-model constants.
        recompute: whether segments may recompute their activations (see ``candidates.py``).
    """

    def __init__(
        self,
        profile: ModelProfile,
        world_size: int | Topology,
        *,
        modes: Sequence[str] = MODES,
        splits: Sequence[int] = (1,),
        units: Iterable[str] | None = None,
        config: CostModelConfig | None = None,
        recompute: Recompute = False,
    ) -> None:
        _check_options(modes, splits)
        if not any(recompute is c or (isinstance(c, str) and recompute == c) for c in RECOMPUTE_CHOICES):
            raise ValueError(f"recompute must be True, False, 'auto', 'selective' or 'full', got {recompute!r}")
        topology = as_topology(world_size, profile)
        units = None if units is None else tuple(units)
        key = reuse.problem_key(
            profile, topology, modes=modes, splits=splits, units=units, config=config, recompute=recompute
        )
        known = reuse.known_problem(key)
        if known is not None:  # the same arguments: the same problem ([Note: what a planning problem reuses])
            self.__dict__.update(known.__dict__)
            return
        self.profile = profile
        self.topology = topology
        self.world_size = self.topology.world_size
        self.modes = _distinct_modes(modes, self.topology)
        self.splits = tuple(sorted(set(splits)))
        self.recompute: Recompute = recompute
        self.config = (config or CostModelConfig()).resolve(profile)
        self.info = ModelInfo(profile, self.topology, self.config)
        self.candidates: Candidates = planning_units(self.info, units=units)
        # Which modules are segments, groups or free does not depend on the modes chosen: one layout serves all.
        first = Decision(self.modes[0])
        representative = {ROOT: first}
        representative.update({s.entry: first for s in self.candidates.segments})
        representative.update({h: first for g in self.candidates.tie_groups for h in g})
        self.layout = layout(self.info, representative)
        #: per (choice, option): the decisions it puts in the plan, and its label for reports
        self.option_decisions: dict[tuple[Hashable, Hashable], tuple[tuple[str, Decision], ...]] = {}
        self.option_labels: dict[tuple[Hashable, Hashable], str] = {}
        globals_ = self._global_choices()
        items = self._segment_choices()
        self.option_count = sum(len(s.options) for s in items if isinstance(s, SegmentChoice))
        self.option_count += sum(len(g.options) for g in globals_)
        self.spec: TimelineInput[LinExpr] = self._timeline_input(globals_, items)
        reuse.remember_problem(key, self)

    def _global_units(self) -> list[tuple[str, tuple[str, ...], list[str]]]:
        """The root and each tied list group: key (the first holder), holders, covered modules."""
        out: list[tuple[str, tuple[str, ...], list[str]]] = [(ROOT, (ROOT,), self.layout.root_cover)]
        out.extend((g[0], tuple(g), self.layout.group_cover[g[0]]) for g in self.layout.groups)
        return out

    def _global_choices(self) -> list[GlobalChoice]:
        """One choice per global unit, one option per mode (the same mode for every holder)."""
        choices = []
        for key, holders, cover in self._global_units():
            options: dict[Hashable, LocalUnit] = {m: global_unit(self.info, key, holders, cover, m) for m in self.modes}
            choices.append(GlobalChoice(key, options, is_root=key == ROOT))
            for m in self.modes:
                self.option_decisions[(key, m)] = tuple((h, Decision(m)) for h in holders)
                self.option_labels[(key, m)] = m
        return choices

    def _segment_choices(self) -> list[SegmentChoice | FreeCosts]:
        """The layout's items in forward order (segments with their options, free runs simulated); identical
        segments share one dict of options (``runs.py`` finds its runs by it)."""
        by_entry = {s.entry: s for s in self.candidates.segments}
        # Identical segments (same shapes and figures: the blocks of a Transformer) share their simulations and
        # pruning: on deep models that is most of the solver's Python time.
        cache: dict[tuple[Any, ...], tuple[list[SegmentOption], dict[Hashable, SegmentCosts], tuple[int, int]]] = {}
        items: list[SegmentChoice | FreeCosts] = []
        for item in self.layout.items:
            if isinstance(item, list):
                items.append(simulate_free(free_run(self.info, item)))
                continue
            signature = (self._signature(item), tuple(n[len(item) :] for n in by_entry[item].inner))
            if signature not in cache:
                bounds = segment_bounds(self.info, item, self.layout.excluded)
                cache[signature] = (*self._simulate_options(by_entry[item]), bounds)
            relative, kept_costs, bounds = cache[signature]
            for j, option in enumerate(relative):
                decisions = tuple((item + name[len(relative_entry(option)) :], d) for name, d in option.decisions)
                self.option_decisions[(item, j)] = decisions
                self.option_labels[(item, j)] = option.label
            items.append(SegmentChoice(item, kept_costs, *bounds))
        return items

    def _simulate_options(
        self, candidate: SegmentCandidate
    ) -> tuple[list[SegmentOption], dict[Hashable, SegmentCosts]]:
        """A segment's options, each simulated, less those another option dominates (see :func:`_prune`)."""
        options = segment_options(self.info, candidate, self.modes, self.splits, self.recompute)
        costs: dict[int, SegmentCosts] = {}
        for i, option in enumerate(options):
            segment = build_segment(self.info, candidate.entry, dict(option.decisions), excluded=self.layout.excluded)
            simulated = simulate_segment(
                segment,
                self.config.optimizer_temporaries,
                release_after_forward=self.config.release_all_gather_after_forward,
            )
            costs[i] = dataclasses.replace(simulated, units=())
        kept = _prune(costs)
        return [options[i] for i in kept], {j: costs[i] for j, i in enumerate(kept)}

    def _timeline_input(
        self, globals_: list[GlobalChoice], items: list[SegmentChoice | FreeCosts]
    ) -> TimelineInput[LinExpr]:
        profile = self.profile
        return TimelineInput(
            globals=globals_,
            items=items,
            compute_seconds=sum(mp.fwd_seconds + mp.bwd_seconds for mp in profile.modules.values())
            + self.config.step_overhead_seconds,
            extra_activation_bytes=profile.extra_activation_bytes,
            last_output_bytes=profile.modules[self.info.leaves[-1]].output_bytes if self.info.leaves else 0,
            buffer_bytes=sum(int(getattr(mp, "buffer_bytes", 0) or 0) for mp in profile.modules.values()),
            optimizer_temporaries=self.config.optimizer_temporaries,
            release_after_forward=self.config.release_all_gather_after_forward,
            globals_bound_pending=max(
                global_unit(self.info, key, holders, cover, "full_shard").bytes.flat
                for key, holders, cover in self._global_units()
            ),
        )

    def _signature(self, entry: str) -> tuple[Any, ...]:
        # Identical blocks (same shapes and figures) share their simulations: the solver's cost on deep models.
        info = self.info
        prefix = len(entry)
        rows = []
        for n in info.subtree(entry):
            mp = info.modules[n]
            rows.append(
                (
                    n[prefix:],
                    mp.type,
                    tuple(map(tuple, mp.param_shapes)),
                    mp.param_bytes,
                    mp.trainable_param_bytes,
                    mp.optim_state_bytes,
                    info.optim_scalar[n],
                    mp.activation_bytes,
                    mp.output_bytes,
                    info.input_bytes.get(n, 0),
                    mp.fwd_seconds,
                    mp.bwd_seconds,
                    n in self.layout.excluded,
                    info.pos[n] <= info.first_trainable_pos,
                    info.splittable(n),
                    mp.input_bytes,
                    mp.input_saved_bytes,
                    (mp.recompute_forward_bytes, mp.selective_kept_bytes, mp.selective_forward_bytes),
                    mp.selective_replay_seconds,
                    mp.recompute_replay_seconds,
                    mp.forward_peak_bytes,
                )
            )
        return tuple(rows)

    # ------------------------------------------------------------------ ILP
    def build(self, *, peak_only: bool = False) -> LinearBackend:
        """The timeline as linear expressions over the option binaries. With ``peak_only`` (for the problem whose
        objective is the peak), each segment keeps only the options no other option of it beats in memory alone
        (:func:`_prune` without the time: see [Note: the minimum-memory problem])."""
        spec = self.spec
        if peak_only:
            # Identical segments share one dict of options (see _segment_choices): each is pruned once.
            kept: dict[int, dict[Hashable, SegmentCosts]] = {}
            items: list[SegmentChoice | FreeCosts] = []
            for item in spec.items:
                if isinstance(item, SegmentChoice):
                    if id(item.options) not in kept:
                        kept[id(item.options)] = {o: item.options[o] for o in _prune(item.options, time=False)}
                    item = dataclasses.replace(item, options=kept[id(item.options)])
                items.append(item)
            spec = dataclasses.replace(spec, items=items)
        be = LinearBackend()
        be.source = spec
        for g in spec.globals:
            be.register(g.key, list(g.options))
        for item in spec.items:
            if isinstance(item, SegmentChoice):
                be.register(item.key, list(item.options))
        build_timeline(spec, be)
        return be

    def _formulate(self, be: LinearBackend, budget: int | None) -> tuple[pulp.LpProblem, list[pulp.LpVariable]] | None:
        """The ILP in pulp: step time under ``budget``, or (``budget=None``) the peak. ``None`` when a checkpoint no
        option touches exceeds the budget."""
        prob = pulp.LpProblem("osdp", pulp.LpMinimize)
        xs = [pulp.LpVariable(v.name, cat=pulp.LpBinary if v.binary else pulp.LpContinuous) for v in be.variables]

        def affine(e: LinExpr) -> pulp.LpAffineExpression:
            return pulp.LpAffineExpression([(xs[i], c) for i, c in e.terms.items() if c], constant=e.const)

        peak: pulp.LpVariable | None = None
        if budget is None:
            peak = pulp.LpVariable("peak_mib", cat=pulp.LpContinuous)
            prob += pulp.LpAffineExpression([(peak, 1.0)])
        else:
            prob += affine(be.objective)
        for key, options in be.options.items():
            prob += pulp.lpSum(xs[be.binaries[(key, o)]] for o in options) == 1
        for i, v in enumerate(be.variables):
            if v.definition is not None:
                prob += affine(v.definition - LinExpr({i: 1.0})) == 0
            for e in v.maximum_of:
                prob += affine(e - LinExpr({i: 1.0})) <= 0
        rhs = None if budget is None else _rhs(budget)
        for _, e in be.checkpoints:
            if not e.terms:
                if rhs is not None and e.const > rhs:
                    return None
                if peak is None:
                    continue
            if peak is None:
                assert rhs is not None
                prob += affine(e) <= rhs
            else:
                prob += affine(e) - peak <= 0
        return prob, xs

    # ------------------------------------------------------------------ solving (see [Note: solving])
    def solve_ilp(
        self,
        be: LinearBackend,
        *,
        budget: int | None,
        gap: float,
        time_limit: float,
        solver: str = DEFAULT_SOLVER,
        settle_at: int | None = None,
    ) -> tuple[dict[Hashable, Hashable] | None, SolveResult]:
        """Minimise step time under ``budget`` (bytes), or (``budget=None``) minimise the peak. Returns the chosen
        option per choice (``None`` when infeasible) and how the solve ended (see [Note: solving]).

        The phases run in order, each handing a plan and/or a lower bound to one :class:`Incumbent`, and the
        solve stops as soon as the incumbent is within ``gap`` of the bound; every phase runs on HiGHS (``solver``
        is checked by :func:`check_solver`). With ``settle_at`` (bytes; the peak minimised) the phases also stop
        once a plan at or under it is held, or a lower bound above it proved (the question
        ``minimum_budget(settle_at=...)`` asks)."""
        check_solver(solver)
        started = time.perf_counter()
        formulated = self._formulate(be, budget)
        if formulated is None:
            return None, SolveResult("infeasible", None, 0.0, math.nan)
        incumbent = Incumbent(be, budget=budget, gap=gap, started=started, time_limit=time_limit)
        if settle_at is not None and budget is None:
            incumbent.settle_at = _rhs(settle_at)
        counted = count_and_arrange(be, incumbent, nodes=_NODES["master"], near=_NEIGHBOURHOOD)
        if counted == "infeasible":
            return None, SolveResult("infeasible", None, incumbent.elapsed(), math.nan, "count master")
        if incumbent.within_gap():
            return incumbent.result("settled")
        f = _Formulation(*formulated, be=be)
        if isinstance(counted, tuple):
            # The master's counts, arranged, broke a row near the end of a run: repaired there first (the master's
            # counts are the faster plan, when they are a few blocks from one; rounding's, within the gap of the
            # master's tight bound, can be slower than the plans the solver returned before the master).
            self._search_neighbourhood(f, incumbent, {}, *counted)
            if incumbent.within_gap():
                return incumbent.result("settled")
        relaxed = self._relax(f, incumbent)
        if relaxed == "infeasible":
            return None, SolveResult("infeasible", None, incumbent.elapsed(), math.nan)
        if relaxed == "optimal":
            fractional = self._round_relaxation(f, incumbent)
            if incumbent.within_gap():
                return incumbent.result("settled")
            if incumbent.clock.expired() and incumbent.chosen is not None:
                return incumbent.result("time limit")
            self._search_neighbourhood(f, incumbent, fractional)
            if incumbent.within_gap():
                return incumbent.result("settled")
        return self._branch_and_bound(f, incumbent)

    def _relax(self, f: _Formulation, incumbent: Incumbent) -> str:
        """Phase 1: the LP relaxation, the first lower bound (multiple-choice knapsacks being what they are, its
        solution has very few fractional choices). Returns ``"optimal"``, ``"infeasible"`` or ``"stopped"``.

        Only an LP solved to optimality gives a bound: pulp reads HiGHS's time and iteration limits as "Optimal",
        and the objective of a simplex stopped on the way bounds nothing (see [Note: the certificate])."""
        import highspy

        f.prob.solve(HiGHS(msg=False, mip=False, timeLimit=max(incumbent.clock.left(), MIN_SECONDS)))
        status = f.prob.solverModel.getModelStatus()
        if status == highspy.HighsModelStatus.kTimeLimit:
            incumbent.clock.hit = True
        if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
            return "infeasible"
        if status != highspy.HighsModelStatus.kOptimal:
            return "stopped"
        incumbent.raise_bound(float(f.prob.solverModel.getInfo().objective_function_value), "LP relaxation")
        return "optimal"

    def _round_relaxation(self, f: _Formulation, incumbent: Incumbent) -> dict[Hashable, list[Hashable]]:
        """Phase 1, continued: the LP's solution rounded to a plan (see :meth:`_round`), offered to the incumbent.
        Returns the fractional choices with the options the LP used."""
        rounded, fractional = self._round(f.be, f.xs)
        top = incumbent.score(rounded)[0]
        # The few fractional choices: first make the plan fit (the option that lowers the peak most), then
        # take the fastest option the LP used that still fits.
        for key in fractional:
            if incumbent.fits(top):
                break
            trials = [({**rounded, key: o}, o) for o in fractional[key]]
            rounded = min(trials, key=lambda t: incumbent.score(t[0])[0])[0]
            top = incumbent.score(rounded)[0]
        if not incumbent.offer(rounded) or incumbent.settled():
            return fractional
        for key in fractional:
            added = f.be.objective.terms  # each option's added milliseconds
            for o in sorted(fractional[key], key=lambda o: added.get(f.be.binaries[(key, o)], 0.0)):
                current = incumbent.chosen
                assert current is not None  # the rounded plan, or a better one
                if o == current[key]:
                    break
                if incumbent.offer({**current, key: o}):
                    break
        return fractional

    def _search_neighbourhood(
        self,
        f: _Formulation,
        incumbent: Incumbent,
        fractional: Mapping[Hashable, Sequence[Hashable]],
        start: Mapping[Hashable, Hashable] | None = None,
        near: set[Hashable] | None = None,
    ) -> None:
        """Rounding lost more than the gap: branch and bound over the fractional choices, the global units and a
        spread of other segments, every other choice fixed to the incumbent's. It finds the swaps rounding misses
        (one block to full_shard so that another can stay no_shard), in a problem small enough to solve at once.
        With ``start`` (the count master's arrangement that broke a row) the choices ``near`` the ends of its runs
        are freed instead of a spread, the rest fixed to ``start``: the blocks whose instants it broke; the search then
        first looks only under :meth:`Incumbent.proving` and stops at the first plan there (see [Note: solving]), and
        only when that proves nothing searches the whole neighbourhood."""
        be, xs = f.be, f.xs
        start = incumbent.chosen if start is None else start
        keys = list(be.options)
        if start is None or len(keys) < 2 * _NEIGHBOURHOOD:
            return  # every choice would be free: the whole problem, the last phase's
        free = set(fractional) | {g.key for g in self.spec.globals}
        free.update(keys[:: max(len(keys) // _NEIGHBOURHOOD, 1)] if near is None else near)
        free.update(keys[-2:])
        fixed = []
        for key in keys:
            if key in free:
                continue
            for o in be.options[key]:
                x = xs[be.binaries[(key, o)]]
                x.lowBound = x.upBound = 1.0 if start[key] == o else 0.0
                fixed.append(x)
        proving = incumbent.proving() if near is not None else None
        try:
            for cutoff in ([proving] if proving is not None else []) + [None]:
                with contextlib.suppress(SolverError):
                    incumbent.offer(
                        run_mip(
                            f.prob,
                            functools.partial(_chosen, be, xs),
                            gap=incumbent.gap / 4,
                            clock=incumbent.clock,
                            nodes=_NODES["neighbourhood"],
                            cutoff=cutoff,
                            first=cutoff is not None,
                        )[0]
                    )
                if incumbent.within_gap():
                    break
        finally:
            for x in fixed:
                x.lowBound, x.upBound = 0, 1

    def _branch_and_bound(
        self, f: _Formulation, incumbent: Incumbent
    ) -> tuple[dict[Hashable, Hashable] | None, SolveResult]:
        """The last phase: the solver's branch and bound on the whole problem, for ``_NODES["last"]`` nodes. With
        an incumbent, the solver only looks for plans better than it by more than the gap (a cutoff): a complete
        search that finds none proves the incumbent within the gap. The status is the incumbent's
        (:meth:`Incumbent.result`): what was proved, whatever the run said of its own plan. Past the safety net
        it runs only when no plan is held, for a second at least."""
        if incumbent.clock.expired() and incumbent.chosen is not None:
            return incumbent.result("time limit")
        try:
            chosen, result = run_mip(
                f.prob,
                functools.partial(_chosen, f.be, f.xs),
                gap=incumbent.gap,
                clock=incumbent.clock,
                nodes=_NODES["last"],
                cutoff=incumbent.cutoff(),
                seconds=1.0,
                first=incumbent.settle_at is not None,
            )
        except SolverError:
            if incumbent.chosen is None:
                raise
            return incumbent.result("work limit")
        if incumbent.chosen is None and result.status == "infeasible":
            return None, SolveResult("infeasible", None, incumbent.elapsed(), math.nan)
        if result.status != "infeasible":
            incumbent.offer(chosen)  # checked against the rows
        if result.lower is not None:
            # HiGHS's dual bound holds whatever its plan (it bounds its tolerance-feasible set, which holds every plan
            # that fits exactly); "infeasible" under the cutoff has one only when the search ran to its end.
            incumbent.raise_bound(result.lower, "branch and bound")
        if incumbent.chosen is None:
            # The run's plan breaks a row (HiGHS's tolerances): no plan, and none proved to exist.
            return None, SolveResult("infeasible", None, incumbent.elapsed(), math.nan)
        return incumbent.result(result.stopped or "unproven")

    def _round(
        self, be: LinearBackend, xs: list[pulp.LpVariable]
    ) -> tuple[dict[Hashable, Hashable], dict[Hashable, list[Hashable]]]:
        """Round an LP solution: every choice takes, among the options the LP uses, the one with the smallest
        memory footprint (so that the rounded plan stays within the budget the LP met). Also returns the
        fractional choices with the options the LP used."""
        footprint: dict[Hashable, dict[Hashable, float]] = {}
        for g in self.spec.globals:
            footprint[g.key] = {
                o: float(
                    u.bytes.params + u.bytes.optim + u.bytes.grad + u.bytes.bucket + u.bytes.gathered + u.bytes.flat
                )
                for o, u in g.options.items()
            }
        for item in self.spec.items:
            if isinstance(item, SegmentChoice):
                footprint[item.key] = {o: float(_footprint(c)) for o, c in item.options.items()}
        chosen: dict[Hashable, Hashable] = {}
        fractional: dict[Hashable, list[Hashable]] = {}
        for key, options in be.options.items():
            values = {o: xs[be.binaries[(key, o)]].value() or 0.0 for o in options}
            support = [o for o in options if values[o] > 1e-6] or [max(options, key=lambda o: values[o])]
            chosen[key] = min(support, key=lambda o: (footprint[key][o], -values[o]))
            if len(support) > 1:
                fractional[key] = support
        return chosen, fractional

    def plan(self, chosen: dict[Hashable, Hashable]) -> Plan:
        """The plan of a chosen option per choice."""
        decisions: dict[str, Decision] = {}
        for key, option in chosen.items():
            decisions.update(dict(self.option_decisions[(key, option)]))
        return Plan(decisions)

    def predict(self, plan: Plan) -> Prediction:
        """The cost model's prediction of ``plan`` (same constants as the ILP)."""
        return _predict(self.profile, plan, self.topology, self.config)

    def peak_bytes(self, chosen: Mapping[Hashable, Hashable]) -> int:
        """The predicted peak of the plan of ``chosen`` (an option per choice), from the segments this problem has
        simulated: the timeline on numbers, as :meth:`predict` walks it, without simulating them again."""
        items = [
            dataclasses.replace(item, options={0: item.options[chosen[item.key]]})
            if isinstance(item, SegmentChoice)
            else item
            for item in self.spec.items
        ]
        globals_ = [dataclasses.replace(g, options={0: g.options[chosen[g.key]]}) for g in self.spec.globals]
        sharded = any(
            d.mode in SHARDED_MODES for key, option in chosen.items() for _, d in self.option_decisions[(key, option)]
        )
        numeric = dataclasses.replace(self.spec, items=items, globals=globals_, any_sharded=sharded)
        be = NumericBackend()
        build_timeline(cast(TimelineInput[MemoryParts], numeric), be)  # the same input, walked on numbers
        return be.peak.total


def _distinct_modes(modes: Sequence[str], topology: Topology) -> tuple[str, ...]:
    """``modes`` less ``hybrid_shard`` where it is ``full_shard`` under another name (one shard group: the world)."""
    if topology.replicas == 1 and "full_shard" in modes:
        return tuple(m for m in modes if m != "hybrid_shard")
    return tuple(modes)


def _check_options(modes: Sequence[str], splits: Sequence[int]) -> None:
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {tuple(modes)}")
    if any(k < 1 for k in splits) or 1 not in splits:
        raise ValueError(f"splits must be integers >= 1 and include 1, got {tuple(splits)}")


def _rhs(budget: int) -> float:
    # Peaks are whole bytes: half a byte of slack admits a peak equal to the budget and nothing above it (HiGHS's
    # feasibility tolerance, 1e-7 MiB, is a tenth of a byte; every plan is checked against the rows exactly).
    return (budget + 0.5) / MIB


def relative_entry(option: SegmentOption) -> str:
    """The entry module of the segment an option was generated for (its first decision)."""
    return option.decisions[0][0]


def _fields(c: SegmentCosts) -> list[MemoryParts | None]:
    return [
        c.fwd_pending,
        c.fwd_after,
        c.fwd_net,
        c.pending,
        c.prefetched,
        *c.bwd.values(),
        c.bwd_net,
        c.reduce_input,
        c.final_peak,
        c.final_net,
        c.final_reduce_input,
        c.persistent,
        c.grads,
        c.optimizer_temp,
        c.buckets,
    ]


K = TypeVar("K", bound=Hashable)


def _prune(costs: Mapping[K, SegmentCosts], *, time: bool = True) -> list[K]:
    """Options not dominated by another: one that is no slower and no larger in every term (every term enters the
    ILP's rows with a non-negative coefficient) can replace it in any plan. Among equals, the first is kept. With
    ``time=False`` the step time is not compared (for the problem whose objective is the peak alone)."""
    keys = list(costs)
    vectors = {k: [None if f is None else f.total for f in _fields(costs[k])] for k in keys}
    flags = {k: (costs[k].frees_pending, costs[k].frees_reduce_input, costs[k].has_final) for k in keys}
    kept: list[K] = []
    for k in keys:
        dominated = False
        for j in keys:
            if j == k or flags[j] != flags[k]:
                continue
            a, b = vectors[j], vectors[k]
            no_worse = (not time or costs[j].seconds <= costs[k].seconds + 1e-15) and all(
                x is None or (y is not None and x <= y) for x, y in zip(a, b, strict=True)
            )
            if not no_worse:
                continue
            equal = (not time or costs[j].seconds == costs[k].seconds) and a == b
            if not equal or keys.index(j) < keys.index(k):
                dominated = True
                break
        if not dominated:
            kept.append(k)
    return kept


#: Choices the neighbourhood search frees besides the fractional ones and the global units.
_NEIGHBOURHOOD = 12

#: The work limit of each phase's branch and bound, in HiGHS's nodes (``mip_max_nodes``): what stops the search, where
#: the gap does not, on every machine alike (see [Note: work limits]).
_NODES: dict[str, int] = {"master": 2000, "neighbourhood": 100, "last": 50}


def check_solver(solver: str) -> str:
    """The MILP solver ``solver`` names: ``"highs"``. ``"cbc"`` (the default until it was removed) still plans, on
    HiGHS, with a ``FutureWarning`` (see ``highs.py``'s [Note: the MILP solver]); anything else is a ``ValueError``."""
    if solver == "cbc":
        warnings.warn(
            "solver='cbc' is deprecated and ignored: CBC was removed, every plan is solved by HiGHS in process "
            "(solver='highs', the default); drop the argument",
            FutureWarning,
            stacklevel=3,
        )
        return DEFAULT_SOLVER
    if solver not in SOLVERS:
        raise ValueError(f"solver must be {DEFAULT_SOLVER!r} (the only one; 'cbc' was removed), got {solver!r}")
    return solver


def check_gap(gap: Any) -> float:
    """``gap`` if it is a relative optimality gap the solve can stop at (a finite number in ``[0, 1)``), else a
    ``TypeError``/``ValueError`` saying what is accepted."""
    if isinstance(gap, bool) or not isinstance(gap, numbers.Real):
        raise TypeError(f"gap must be a number in [0, 1) (a relative optimality gap, e.g. 1e-3), got {gap!r}")
    if not 0 <= float(gap) < 1:
        raise ValueError(f"gap must be in [0, 1) (a relative optimality gap, e.g. 1e-3), got {gap!r}")
    return float(gap)


def _chosen(be: LinearBackend, xs: list[pulp.LpVariable]) -> dict[Hashable, Hashable]:
    """The option each choice takes in the solution pulp holds (its largest binary)."""
    return {
        key: max(choices, key=lambda o: xs[be.binaries[(key, o)]].value() or 0.0) for key, choices in be.options.items()
    }


def _footprint(c: SegmentCosts) -> int:
    """A segment option's memory in one number, for rounding: what it keeps plus its largest transient."""
    peaks = [v.total for v in (c.fwd_pending, c.fwd_after, *c.bwd.values()) if v is not None]
    return c.persistent.total + c.grads.total + c.fwd_net.total + c.pending.total + max(peaks, default=0)


def _splits(splits: Sequence[int], max_split: int) -> tuple[int, ...]:
    if max_split < 1:
        raise ValueError(f"max_split must be >= 1, got {max_split}")
    return tuple(sorted({1, *(k for k in splits if 1 <= k <= max_split)}))


def _ilp_figures(be: LinearBackend, chosen: dict[Hashable, Hashable]) -> tuple[int, float]:
    return round(be.peak(chosen) * MIB), be.step_time(chosen) / 1e3


def minimum_budget(
    profile: ModelProfile,
    world_size: int | Topology | None = None,
    *,
    modes: Sequence[str] = MODES,
    max_split: int = 8,
    splits: Sequence[int] = (1, 2, 4, 8),
    units: Iterable[str] | None = None,
    config: CostModelConfig | None = None,
    gap: float = 1e-6,
    time_limit: float = 10.0,
    recompute: Recompute = "auto",
    solver: str = DEFAULT_SOLVER,
    settle_at: int | None = None,
) -> int:
    """The smallest per-device peak (bytes) any plan reaches under the given options: the ILP with the peak as
    its objective, on ``solver`` (as for :func:`solve`). Budgets below it are infeasible for :func:`solve`.

    With ``settle_at`` (bytes) only "is the minimum at most ``settle_at``?" is asked: the search stops once it holds
    a plan within it (the minimum it would end with is no larger) or proves a bound above it (the minimum can be no
    smaller), and the value returned is then at most ``settle_at`` exactly when the minimum is (``osdp plan``'s batch
    search asks this)."""
    return minimum_plan(
        profile,
        world_size,
        modes=modes,
        max_split=max_split,
        splits=splits,
        units=units,
        config=config,
        gap=gap,
        time_limit=time_limit,
        recompute=recompute,
        solver=solver,
        settle_at=settle_at,
    )[1]


def minimum_plan(
    profile: ModelProfile,
    world_size: int | Topology | None = None,
    *,
    modes: Sequence[str] = MODES,
    max_split: int = 8,
    splits: Sequence[int] = (1, 2, 4, 8),
    units: Iterable[str] | None = None,
    config: CostModelConfig | None = None,
    gap: float = 1e-6,
    time_limit: float = 10.0,
    recompute: Recompute = "auto",
    solver: str = DEFAULT_SOLVER,
    settle_at: int | None = None,
) -> tuple[Plan, int]:
    """:func:`minimum_budget` and the plan that reaches it (with ``settle_at``, the plan that settled the question:
    one at or under it when the value is)."""
    check_solver(solver)
    problem = PlanningProblem(
        profile,
        world_size or profile.world_size,
        modes=modes,
        splits=_splits(splits, max_split),
        units=units,
        config=config,
        recompute=recompute,
    )
    return _minimum(problem, gap=gap, time_limit=time_limit, solver=solver, settle_at=settle_at)


def _minimum(
    problem: PlanningProblem, *, gap: float, time_limit: float, solver: str, settle_at: int | None = None
) -> tuple[Plan, int]:
    """The plan of smallest peak, and the budget :func:`solve` accepts for it: its predicted peak, or the ILP's
    when larger (the ILP bounds pending buffers after DDP segments from above: timeline.py); ``settle_at`` as for
    :func:`minimum_budget`. The plan that shards nothing is weighed by its exact prediction, as :func:`solve` accepts
    it (:func:`_check_replicated`): where sharding saves less than it adds (a frozen backbone, whose parameters have
    no gradients or optimizer state), it is the smallest, and the ILP's bound alone would name a budget above it."""
    be = problem.build(peak_only=True)
    chosen, _ = problem.solve_ilp(be, budget=None, gap=gap, time_limit=time_limit, solver=solver, settle_at=settle_at)
    if chosen is None:
        raise SolverError("the minimum-memory problem is infeasible: this is a bug in the cost model")
    plan = problem.plan(chosen)
    minimum = max(problem.predict(plan).peak_bytes, _ilp_figures(be, chosen)[0])
    replicated = _all_no_shard(problem, be)
    if replicated is not None and replicated != chosen:
        exact = problem.predict(problem.plan(replicated)).peak_bytes
        if exact < minimum:
            return problem.plan(replicated), exact
    return plan, minimum


def solve(
    profile: ModelProfile,
    memory_budget: int | str,
    world_size: int | Topology | None = None,
    *,
    modes: Sequence[str] = MODES,
    max_split: int = 8,
    splits: Sequence[int] = (1, 2, 4, 8),
    gap: float = DEFAULT_GAP,
    time_limit: float = 10.0,
    units: Iterable[str] | None = None,
    config: CostModelConfig | None = None,
    recompute: Recompute = "auto",
    solver: str = DEFAULT_SOLVER,
) -> Plan:
    """The plan with the smallest predicted step time whose predicted per-device peak fits ``memory_budget``.

    Args:
        profile: the model's profile (:mod:`lightning_osdp.profiling`).
        memory_budget: per-device bytes, or a string such as ``"6GiB"``.
        world_size: ranks (default: the profile's), or a :class:`~lightning_osdp.topology.Topology` (nodes, ranks
            per node, ``hybrid_shard``'s shard group).
        modes: allowed modes; ``("no_shard",)`` is DDP, ``("full_shard",)`` FSDP, ``("shard_grad_op",)`` ZeRO-2,
            ``("hybrid_shard",)`` HSDP.
        max_split: largest operator-splitting factor (1 disables splitting).
        splits: split factors to consider (those above ``max_split`` are dropped).
        gap: the relative optimality gap (of the whole predicted step time).
        time_limit: the wall-clock safety net in seconds: each HiGHS run may take this long, the solve 3 times
            this; the plan does not depend on it unless it is reached, and the status then says ``"time limit"``
            (the search stops on work limits: see [Note: work limits]).
        units: planning units overriding the automatic choice (see ``lightning_osdp/solver/candidates.py``).
        config: cost-model constants.
        recompute: whether segments may recompute their activations: ``"auto"`` (where it pays), ``True`` (every
            segment that saves activations does), ``False`` (none does).
        solver: the MILP solver every phase runs on: ``"highs"`` (HiGHS in process, the only one; ``"cbc"`` is
            deprecated and plans on HiGHS with a ``FutureWarning``); see ``highs.py``'s [Note: the MILP solver].

    Returns:
        a :class:`~lightning_osdp.plan.Plan` whose ``report`` (a :class:`~lightning_osdp.SolveReport`) holds
        ``status`` (``"optimal"``, ``"within gap X"``, ``"work limit"`` or ``"time limit"``, the last two with the gap
        the lower bound proves when a plan is in hand), ``bound`` (what proves it: ``"LP relaxation"``, ``"count
        relaxation"``, ``"count master"``, ``"branch and bound"``
        or ``"exact check"``), the predicted peak and step time, the budget and
        the world size; ``plan.info`` holds the same figures under their historical names.

    Raises:
        InfeasibleBudgetError: no plan fits; its message states the smallest budget any plan meets and the
            largest consumers.
        SolverError: the solver found no solution within its node limits or ``time_limit``.
    """
    from lightning_osdp.budget import parse_memory_budget

    check_solver(solver)
    check_gap(gap)
    budget = parse_memory_budget(memory_budget)
    ws = world_size or profile.world_size
    started = time.perf_counter()
    problem = PlanningProblem(
        profile, ws, modes=modes, splits=_splits(splits, max_split), units=units, config=config, recompute=recompute
    )
    be = problem.build()
    chosen, result = problem.solve_ilp(be, budget=budget, gap=gap, time_limit=time_limit, solver=solver)
    chosen, result = _check_replicated(problem, be, budget, chosen, result)
    if chosen is None:
        raise _infeasible(problem, budget, time_limit, solver)
    plan = problem.plan(chosen)
    prediction = problem.predict(plan)
    ilp_peak, ilp_seconds = _ilp_figures(be, chosen)
    report = SolveReport(
        status=result.status,
        bound=result.bound,
        gap=gap,
        budget_bytes=budget,
        world_size=problem.world_size,
        prediction=prediction.summary(),
        ilp_peak_bytes=ilp_peak,
        ilp_step_seconds=ilp_seconds,
        planning_units=problem.candidates.count,
        options=problem.option_count,
        modes=tuple(problem.modes),
        splits=tuple(problem.splits),
        solve_seconds=time.perf_counter() - started,
        solver_seconds=result.seconds,
        recompute=problem.recompute,
    )
    info: dict[str, Any] = {"source": "lightning_osdp.solver"}
    if not problem.topology.is_flat or problem.topology.shard_group_size is not None:
        info["topology"] = problem.topology.to_dict()
    return Plan(plan.decisions, info=info, report=report)


def _check_replicated(
    problem: PlanningProblem,
    be: LinearBackend,
    budget: int,
    chosen: dict[Hashable, Hashable] | None,
    result: SolveResult,
) -> tuple[dict[Hashable, Hashable] | None, SolveResult]:
    """The ILP's answer, or the plan that shards nothing when it is faster and fits by the exact prediction.

    The ILP bounds FSDP2's pending buffers after DDP segments from above (timeline.py's [Note: pending buffers
    across DDP segments]); a plan that shards nothing has none, so it is checked exactly. (The ILP's step time is
    the predictor's, so only a faster replicated plan is predicted.)"""
    replicated = _all_no_shard(problem, be)
    # The peak from the problem's own simulations first: the prediction simulates every segment again, for nothing
    # at the budgets under the replicated plan's peak (most of them).
    if (
        replicated is not None
        and (chosen is None or be.step_time(replicated) < be.step_time(chosen))
        and problem.peak_bytes(replicated) <= budget
    ):
        exact = problem.predict(problem.plan(replicated))
        if exact.peak_bytes <= budget:
            if chosen is None:
                result = SolveResult("optimal", 0.0, result.seconds, exact.step_seconds * 1e3, "exact check")
            chosen = replicated
    return chosen, result


def _all_no_shard(problem: PlanningProblem, be: LinearBackend) -> dict[Hashable, Hashable] | None:
    """The choice of the plan that shards nothing (every choice's coarse ``no_shard``), if the options allow it."""
    chosen: dict[Hashable, Hashable] = {}
    for key, options in be.options.items():
        for o in options:
            decisions = problem.option_decisions[(key, o)]
            if all(d.mode == "no_shard" and d.split == 1 for _, d in decisions):
                chosen[key] = o
                break
        else:
            return None
    return chosen


def _infeasible(problem: PlanningProblem, budget: int, time_limit: float, solver: str) -> InfeasibleBudgetError:
    plan, minimum = _minimum(problem, gap=1e-6, time_limit=time_limit, solver=solver)
    prediction = problem.predict(plan)
    consumers = _consumers(problem)
    parts = ", ".join(
        f"{name.replace('_', ' ')} {format_bytes(v)}"
        for name, v in prediction.peak.as_dict().items()
        if name != "total" and v > 0
    )
    top = "; ".join(f"{name or '<root>'} {format_bytes(b)}" for name, b in consumers[:5])
    ranks = f"{problem.world_size} ranks" if problem.topology.is_flat else problem.topology.describe_ranks()
    message = (
        f"no plan fits the memory budget of {format_bytes(budget)} ({budget} bytes) per device on "
        f"{ranks}: the smallest budget any plan meets is {format_bytes(minimum)} "
        f"({minimum} bytes), with {plan.summary()} (peak at {prediction.peak_at!r}: {parts}). "
        f"Largest consumers (parameters, gradients and optimizer state unsharded, plus activations): {top}. "
        "Raise the budget, add ranks, or reduce the batch size (activations do not shard)"
        + (
            ", or let the planner recompute activations (activation_checkpointing='auto')."
            if problem.recompute is False
            else ", or let the planner recompute fully where selective recomputation keeps too much "
            "(activation_checkpointing='auto' or 'full')."
            if problem.recompute == "selective"
            else "."
        )
    )
    return InfeasibleBudgetError(message, budget=budget, minimum=minimum, consumers=consumers)


def _consumers(problem: PlanningProblem) -> list[tuple[str, int]]:
    """Segments, tied groups and the highest other modules containing no segment, by unsharded parameter state
    (parameters, gradients, optimizer state) plus activations."""
    info = problem.info
    segments = [s.entry for s in problem.candidates.segments]
    groups = {g[0]: g for g in problem.candidates.tie_groups}
    names: list[str] = [*segments, *groups]
    taken = {n for e in segments for n in info.subtree(e)} | {h for g in groups.values() for h in g}
    stack = list(info.children[ROOT])
    while stack:
        name = stack.pop()
        if name in taken:
            continue
        if any(s in taken for s in info.subtree(name)):
            stack.extend(info.children[name])
        else:
            names.append(name)
    out = []
    for name in names:
        sub = [n for h in groups.get(name, (name,)) for n in info.subtree(h)]
        state = sum(
            info.modules[n].param_bytes + info.modules[n].grad_bytes + info.modules[n].optim_state_bytes for n in sub
        )
        acts = sum(info.modules[n].activation_bytes for n in sub)
        out.append((name, state + acts))
    return sorted(out, key=lambda t: -t[1])
