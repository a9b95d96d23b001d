"""The planning policy: how a user's memory budget becomes the budget the ILP plans against.

The strategy and ``osdp plan`` both call :func:`plan_model`, so that one budget gives one plan wherever it is
planned: a plan made with the CLI and passed back with ``OSDPStrategy(plan=...)`` was planned with the same
headroom as the one the strategy would have chosen itself.

[Note: headroom]
The cost model predicts what the profile measured; the headroom is the fraction of the budget the planner keeps
free for what a run allocates beyond that. The ILP plans against ``memory_budget * (1 - headroom)``; an infeasible
budget is reported in the user's terms, as the smallest ``memory_budget`` that passes with this headroom.

The default, 2% (5% until the profile measured the loss region), is what the measurements in ``docs/benchmarks.md``
("Memory around the loss") leave room for: on CPU the measured peaks stay within a fraction of a percent of the
predicted ones. What those runs cannot show is CUDA's: the caching allocator rounds every block up to 512 bytes (a
few MiB with a few thousand tensors alive), and cuBLAS and attention kernels keep workspaces the model does not count
(a few MiB more): together well under 2% of a budget of gigabytes. Fragmentation (memory the allocator reserved but
does not use) is not in the allocated figure the budget is held to: the default budget keeps ``CUDA_RESERVE_BYTES``
of the device free for it, the CUDA context and NCCL (``lightning_osdp/budget.py``); a budget set by hand near the
device's capacity should leave that room too, or use ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. A run that
does go over its budget says so at its first check and records the miss in its profile (``OSDPStrategy``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_osdp.budget import format_bytes, parse_memory_budget
from lightning_osdp.cost_model.config import CostModelConfig
from lightning_osdp.plan import MODES, Plan
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.solver.candidates import Recompute
from lightning_osdp.solver.ilp import DEFAULT_GAP, DEFAULT_SOLVER, InfeasibleBudgetError, minimum_plan, solve
from lightning_osdp.topology import Topology

if TYPE_CHECKING:
    from lightning_osdp.cost_model.device_memory import DeviceMemory

__all__ = [
    "DEFAULT_MEMORY_HEADROOM",
    "PlannerOptions",
    "plan_model",
    "planned_budget",
    "smallest_memory_budget",
    "smallest_memory_plan",
]

#: How many times a plan is solved again to fit its card (see [Note: the plan within the card]).
CARD_ROUNDS = 3

#: The fraction of the memory budget the planner keeps free by default (see [Note: headroom]).
DEFAULT_MEMORY_HEADROOM = 0.02


def _check_headroom(headroom: float) -> float:
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0.0 <= headroom < 0.5:
        raise ValueError(f"memory_headroom must be a number in [0, 0.5), got {headroom!r}")
    return float(headroom)


def planned_budget(memory_budget: int | str, headroom: float = DEFAULT_MEMORY_HEADROOM) -> int:
    """The budget the ILP plans against: ``memory_budget * (1 - headroom)`` bytes (see [Note: headroom])."""
    return int(parse_memory_budget(memory_budget) * (1 - _check_headroom(headroom)))


def plan_model(
    profile: ModelProfile,
    memory_budget: int | str,
    world_size: int | Topology | None = None,
    *,
    headroom: float = DEFAULT_MEMORY_HEADROOM,
    modes: Sequence[str] = MODES,
    max_split: int = 8,
    time_limit: float = 10.0,
    gap: float = DEFAULT_GAP,
    units: Iterable[str] | None = None,
    config: CostModelConfig | None = None,
    recompute: Recompute = "auto",
    solver: str = DEFAULT_SOLVER,
) -> Plan:
    """The fastest plan whose predicted peak fits ``memory_budget`` less the planner's ``headroom``.

    What ``Trainer(strategy=OSDPStrategy(memory_budget=...))`` and ``osdp plan --memory ...`` both run.

    Args:
        profile: the model's profile.
        memory_budget: per-device bytes, or a string such as ``"6GiB"``.
        world_size: ranks (default: the profile's), or a :class:`~lightning_osdp.topology.Topology`.
        headroom: the fraction of ``memory_budget`` kept free (see [Note: headroom]).
        modes: as for :func:`~lightning_osdp.solver.solve`.
        max_split: likewise.
        time_limit: likewise.
        gap: likewise.
        units: likewise.
        config: likewise.
        recompute: likewise.
        solver: likewise (``"highs"``; ``"cbc"`` is deprecated).

    Returns:
        the plan; its ``report`` also records ``memory_budget_bytes`` (the budget given) and ``memory_headroom``.

    Raises:
        InfeasibleBudgetError: no plan fits; ``minimum`` is the smallest ``memory_budget`` that passes with this
            headroom, and the message says so.
    """
    budget = parse_memory_budget(memory_budget)
    headroom = _check_headroom(headroom)
    try:
        plan = solve(
            profile,
            planned_budget(budget, headroom),
            world_size,
            modes=modes,
            max_split=max_split,
            time_limit=time_limit,
            gap=gap,
            units=units,
            config=config,
            recompute=recompute,
            solver=solver,
        )
    except InfeasibleBudgetError as err:
        needed = with_headroom(err.minimum, headroom)
        message = str(err)
        if headroom > 0:
            message += (
                f" (The planner plans against {format_bytes(err.budget)}: the memory_budget of {format_bytes(budget)} "
                f"less its {headroom:.0%} headroom; the smallest memory_budget to pass is {format_bytes(needed)}, "
                f"{needed} bytes.)"
            )
        raise InfeasibleBudgetError(message, budget=budget, minimum=needed, consumers=err.consumers) from None
    assert plan.report is not None  # solve() always reports
    report = dataclasses.replace(plan.report, memory_budget_bytes=budget, memory_headroom=headroom)
    return Plan(plan.decisions, info=plan.info, report=report)


def smallest_memory_budget(
    profile: ModelProfile,
    world_size: int | Topology | None = None,
    *,
    headroom: float = DEFAULT_MEMORY_HEADROOM,
    modes: Sequence[str] = MODES,
    max_split: int = 8,
    time_limit: float = 10.0,
    units: Iterable[str] | None = None,
    config: CostModelConfig | None = None,
    recompute: Recompute = "auto",
    solver: str = DEFAULT_SOLVER,
    settle_at: int | str | None = None,
) -> int:
    """The smallest ``memory_budget`` (bytes) :func:`plan_model` accepts: the smallest peak any plan reaches,
    grown by the headroom.

    With ``settle_at`` (a budget) only "does some plan fit it?" is asked, and answered sooner: the value returned is
    at most ``settle_at`` exactly when the smallest budget is (:func:`~lightning_osdp.solver.minimum_budget`'s
    ``settle_at``; ``osdp plan``'s batch search asks this)."""
    return smallest_memory_plan(
        profile,
        world_size,
        headroom=headroom,
        modes=modes,
        max_split=max_split,
        time_limit=time_limit,
        units=units,
        config=config,
        recompute=recompute,
        solver=solver,
        settle_at=settle_at,
    )[1]


def smallest_memory_plan(
    profile: ModelProfile,
    world_size: int | Topology | None = None,
    *,
    headroom: float = DEFAULT_MEMORY_HEADROOM,
    modes: Sequence[str] = MODES,
    max_split: int = 8,
    time_limit: float = 10.0,
    units: Iterable[str] | None = None,
    config: CostModelConfig | None = None,
    recompute: Recompute = "auto",
    solver: str = DEFAULT_SOLVER,
    settle_at: int | str | None = None,
) -> tuple[Plan, int]:
    """:func:`smallest_memory_budget` and the plan whose peak it is (with ``settle_at``, the plan that settled the
    question: :func:`~lightning_osdp.solver.ilp.minimum_plan`)."""
    headroom = _check_headroom(headroom)
    plan, minimum = minimum_plan(
        profile,
        world_size,
        modes=modes,
        max_split=max_split,
        time_limit=time_limit,
        units=units,
        config=config,
        recompute=recompute,
        solver=solver,
        settle_at=None if settle_at is None else planned_budget(settle_at, headroom),
    )
    return plan, with_headroom(minimum, headroom)


def with_headroom(planned: int, headroom: float) -> int:
    """The smallest budget whose planned share (:func:`planned_budget`) is at least ``planned``."""
    needed = math.ceil(planned / (1 - headroom))
    while int(needed * (1 - headroom)) < planned:
        needed += 1
    return needed


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """The planner's options, spelled once: as ``OSDPStrategy``'s arguments, which ``osdp plan``'s flags fill in too.

    [Note: the planner's options, written once]
    The strategy and ``osdp plan`` plan with the same call (:meth:`plan`, :meth:`smallest_budget`), and both hold
    their options in one of these; the names are the strategy's, and :meth:`plan` is the one place they meet the
    solver's own keywords (``activation_checkpointing`` is ``recompute``, ``solver_time_limit`` ``time_limit``,
    ``solver_gap`` ``gap``, ``memory_headroom`` ``headroom``). ``time_limit``, ``headroom`` and ``gap`` remain
    readable under their former names.
    """

    modes: tuple[str, ...] = MODES
    max_split: int = 8
    activation_checkpointing: Recompute = "auto"
    solver_time_limit: float = 10.0
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    solver: str = DEFAULT_SOLVER
    solver_gap: float = DEFAULT_GAP

    @classmethod
    def checked(
        cls,
        *,
        modes: Sequence[str] = MODES,
        max_split: Any = 8,
        activation_checkpointing: Any = "auto",
        solver_time_limit: Any = 10.0,
        memory_headroom: Any = DEFAULT_MEMORY_HEADROOM,
        solver: Any = DEFAULT_SOLVER,
        solver_gap: Any = DEFAULT_GAP,
    ) -> PlannerOptions:
        """The options, each checked (``TypeError``/``ValueError`` naming the ``OSDPStrategy`` argument)."""
        from lightning_osdp import options

        return cls(
            modes=options.check_modes(modes),
            max_split=options.check_max_split(max_split),
            activation_checkpointing=options.check_activation_checkpointing(activation_checkpointing),
            solver_time_limit=options.check_solver_time_limit(solver_time_limit),
            memory_headroom=options.check_memory_headroom(memory_headroom),
            solver=options.check_solver(solver),
            solver_gap=options.check_solver_gap(solver_gap),
        )

    @property
    def time_limit(self) -> float:
        """Former name of :attr:`solver_time_limit`."""
        return self.solver_time_limit

    @property
    def headroom(self) -> float:
        """Former name of :attr:`memory_headroom`."""
        return self.memory_headroom

    @property
    def gap(self) -> float:
        """Former name of :attr:`solver_gap`."""
        return self.solver_gap

    def plan(
        self, profile: ModelProfile, budget: int, topology: int | Topology, *, card_bytes: int | None = None
    ) -> Plan:
        """The fastest plan for ``profile`` that fits ``budget`` less the headroom on ``topology``
        (:func:`plan_model` with these options); with ``card_bytes`` (a GPU's memory), one whose device total fits
        the card as well.

        [Note: the plan within the card]
        The planner holds the allocated peak within the budget; what the card holds beside it (fragmentation of the
        caching allocator, a share of the step's transient bytes, NCCL's buffers, the CUDA context:
        ``lightning_osdp/cost_model/device_memory.py``) is not in its rows. A budget near the card's size (the
        default, the card less ``CUDA_RESERVE_BYTES``) can then give a plan whose device total exceeds the card: a
        run that goes out of memory, or a dry run that calls OSDP's own choice "does not fit". So where the device
        total exceeds the card, the plan is solved again under a budget that holds the allocated peak below the
        plan's by the excess, up to :data:`CARD_ROUNDS` times (the fragmentation is a share of the transient bytes,
        which a lower budget changes too). A plan that still exceeds the card, or a lower budget no plan meets,
        keeps the plan found last (``plan.info["card"]`` says so), and the caller's check of the device total
        reports it.
        """
        plan = plan_model(profile, budget, topology, gap=self.solver_gap, **self._keywords())
        if not card_bytes:
            return plan
        from lightning_osdp.cost_model import predict
        from lightning_osdp.cost_model.device_memory import plan_device_memory

        topo = topology if isinstance(topology, Topology) else Topology.flat(topology)
        for _ in range(CARD_ROUNDS):
            memory = plan_device_memory(predict(profile, plan, topo), plan, topo)
            if memory.fits(card_bytes):
                return plan
            budget = self.budget_within_card(memory, card_bytes)
            try:
                plan = plan_model(profile, budget, topo, gap=self.solver_gap, **self._keywords())
            except InfeasibleBudgetError:
                break
            plan.info["card"] = (
                f"solved again under {format_bytes(budget)}: the device total of the plan under the budget was over "
                f"the {format_bytes(card_bytes)} card"
            )
        return plan

    def budget_within_card(self, memory: DeviceMemory, card_bytes: int) -> int:
        """The budget under which a plan's allocated peak is ``memory``'s less what its device total exceeds the card
        by (the allocated peak must come down by the excess; see [Note: the plan within the card])."""
        return with_headroom(max(memory.allocated - (memory.device_total - card_bytes), 0), self.memory_headroom)

    def smallest_budget(
        self, profile: ModelProfile, topology: int | Topology, *, settle_at: int | str | None = None
    ) -> int:
        """:func:`smallest_memory_budget` with these options (``settle_at`` as there)."""
        return smallest_memory_budget(profile, topology, settle_at=settle_at, **self._keywords())

    def smallest_plan(
        self, profile: ModelProfile, topology: int | Topology, *, settle_at: int | str | None = None
    ) -> tuple[Plan, int]:
        """:func:`smallest_memory_plan` with these options: :meth:`smallest_budget` and the plan whose peak it is."""
        return smallest_memory_plan(profile, topology, settle_at=settle_at, **self._keywords())

    def _keywords(self) -> dict[str, Any]:
        """These options in the solver's spelling: the one place the two meet."""
        return {
            "headroom": self.memory_headroom,
            "modes": self.modes,
            "max_split": self.max_split,
            "recompute": self.activation_checkpointing,
            "time_limit": self.solver_time_limit,
            "solver": self.solver,
        }

    def fits(self, profile: ModelProfile, plan: Plan, budget: int, topology: Topology) -> bool:
        """Whether ``plan``'s predicted peak on ``profile`` is within the budget the planner plans against."""
        from lightning_osdp.cost_model import predict

        return predict(profile, plan, topology).peak_bytes <= planned_budget(budget, self.memory_headroom)
