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

[Note: what one probe tells the next]
OSDP's probe asks whether *some* plan fits at ``b``: a minimum-memory solve, stopped as soon as it holds a plan under
the budget or proves a bound above it (``settle_at``). What is true at one batch size and can be carried to another:

* *No plan fits at b*: then none fits at any larger size, since every instant of a plan's step is its parameters',
  gradients' and optimizer state's bytes, which do not depend on the batch, plus activations and buffers of
  activations, which do not shrink as it grows (every figure is affine in ``b``, ``estimate.py``'s [Note: batch
  size], with a slope that is a size of a batch's tensors). That is the bracket's upper end: no larger size is
  probed again. (A smallest peak proved at ``b`` is also a lower bound at every larger size; but the question is
  only asked below the smallest size known not to fit, where such a bound is under the budget and decides nothing,
  so none is carried.)
* *A plan fits at b*: the plan the probe found is a plan at every other size too (the planning units are chosen from
  parameter bytes, a segment's options from those and whether its modules save activations at all:
  ``solver/candidates.py``), and its peak there is one prediction, where a solve simulates every option of every
  segment. So a later probe first predicts the plans that fitted before, the latest first (:data:`_HELD`): one that
  fits answers "yes", with its peak as the probe's figure; only when none fits does the solve run. The answer is
  the solve's, whatever the peaks do between sizes (each "yes" is checked at its own size): the solve's minimum is
  at most that plan's peak, so the largest batch, and the plan solved there, are those of a search without held
  plans (``tests/test_batch_search.py``). The peak compared must be the one the solve judges a plan by, the larger
  of the prediction and the ILP's rows (``solver/ilp.py``'s ``_minimum``). The two are the same walk on the same
  numbers except after a ``no_shard`` segment, where the ILP bounds FSDP2's pending buffer from above
  (``cost_model/timeline.py``'s [Note: pending buffers across DDP segments]), so only plans that shard every unit
  are held (least-memory plans do; one that shards nothing is left to the solve, which weighs it apart). An option
  of the plan that the solve at the other size prunes is dominated there by one no larger in any term
  (``solver/ilp.py``'s ``_prune``), so the solve there has a plan at most as large.

A probe at the requested batch size and at the largest one found repeat solves of the same profile: those reuse the
problem built once (``solver/reuse.py``'s [Note: what a planning problem reuses]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lightning_osdp.cost_model import Prediction, predict
from lightning_osdp.cost_model.device_memory import DeviceMemory, plan_device_memory
from lightning_osdp.cost_model.units import SHARDED_MODES
from lightning_osdp.plan import Plan
from lightning_osdp.profiling import ModelProfile
from lightning_osdp.solver.policy import CARD_ROUNDS, PlannerOptions, planned_budget, with_headroom
from lightning_osdp.topology import Topology

__all__ = ["AnyPlanFits", "Probe", "largest_batch"]

#: How many plans that fitted an OSDP probe are predicted first at the next one, the latest first.
_HELD = 2


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


class AnyPlanFits:
    """OSDP's probe: whether some plan fits ``budget`` at a batch size, with what earlier probes found carried to the
    next (see [Note: what one probe tells the next]).

    Args:
        planner: the planner's options (the solve's).
        topology: the ranks.
        budget: the memory budget (the planner holds plans to its planned share, less the headroom).
        profile_at: the profile at a batch size.
        card_bytes: a GPU's memory: a plan must also fit it with what the allocator's figure leaves out (its device
            total, ``cost_model/device_memory.py``). Where the least-memory plan found does not, the question is
            asked again under the budget lowered by the excess, as the run's plan is solved again
            (``PlannerOptions.plan``'s [Note: the plan within the card]).
    """

    def __init__(
        self,
        planner: PlannerOptions,
        topology: Topology,
        budget: int,
        profile_at: Callable[[int], ModelProfile],
        card_bytes: int | None = None,
    ) -> None:
        self.planner = planner
        self.topology = topology
        self.budget = budget
        self.profile_at = profile_at
        self.card_bytes = card_bytes
        #: plans that fitted earlier probes and shard every unit, the latest last
        self.held: list[Plan] = []
        #: how many probes a held plan answered, and how many a solve did
        self.answered_by_held = 0
        self.solved = 0

    def __call__(self, batch_size: int) -> Probe:
        profile = self.profile_at(batch_size)
        planned = planned_budget(self.budget, self.planner.memory_headroom)
        for plan in reversed(self.held):
            prediction = predict(profile, plan, self.topology)
            if prediction.peak_bytes <= planned and self._on_card(profile, plan, prediction):
                self.answered_by_held += 1
                return Probe(True, with_headroom(prediction.peak_bytes, self.planner.memory_headroom))
        self.solved += 1
        plan, smallest = self.planner.smallest_plan(profile, self.topology, settle_at=self.budget)
        if smallest > self.budget:
            return Probe(False, smallest)
        for lowering in range(CARD_ROUNDS + 1):
            memory = self._device_memory(profile, plan)
            if memory is None or memory.fits(self.card_bytes or 0):
                if all(d.mode in SHARDED_MODES for d in plan.decisions.values()) and plan not in self.held:
                    self.held = [*self.held, plan][-_HELD:]
                return Probe(True, smallest)
            if lowering == CARD_ROUNDS:
                break
            # Over the card: whether a plan under the budget lowered by the excess fits, as the run lowers it
            # (PlannerOptions.plan's [Note: the plan within the card]), asked as a least-memory question again.
            budget = self.planner.budget_within_card(memory, self.card_bytes or 0)
            plan, lowered = self.planner.smallest_plan(profile, self.topology, settle_at=budget)
            if lowered > budget:
                break
        return Probe(False, smallest)

    def _on_card(self, profile: ModelProfile, plan: Plan, prediction: Prediction | None = None) -> bool:
        """Whether ``plan``'s device total fits the card (always, without one)."""
        memory = self._device_memory(profile, plan, prediction)
        return memory is None or memory.fits(self.card_bytes or 0)

    def _device_memory(
        self, profile: ModelProfile, plan: Plan, prediction: Prediction | None = None
    ) -> DeviceMemory | None:
        """``plan``'s device memory on the card (``None`` without one), from ``prediction`` when it is made."""
        if self.card_bytes is None:
            return None
        prediction = prediction if prediction is not None else predict(profile, plan, self.topology)
        return plan_device_memory(prediction, plan, self.topology)
