"""Which plan a run trains under: the one given, the resumed checkpoint's, or a new one solved from a profile.

:func:`resolve_plan` is the decision the strategy makes in ``setup``, without Lightning: everything it needs comes in
as arguments (the given plan, what the checkpoint being resumed holds, this run's topology and budget) and as two
callables (how to profile the model, how to solve a profile), so that every branch is tested on its own
(``tests/test_resolve.py``). In order:

1. a plan given by the user (``OSDPStrategy(plan=...)``) is applied as is;
2. a resumed checkpoint's plan is reused when the checkpoint decided it may be (same world size and budget, the same
   model: ``lightning_osdp.checkpoint.resume_plan``) *and* it was made for this run's topology (nodes and shard
   groups; a plan solved on one node is not the plan of two);
3. such a plan whose profile carries a measured correction (a run of it went over its budget) under which it no longer
   fits, or one made for another number of micro-batches per optimizer step (``accumulate_grad_batches`` changed:
   the gradients held between them and the step's time change), is replaced by a plan solved from the checkpoint's
   profile, with the correction and this run's micro-batches: no profiling;
4. otherwise the model is profiled and solved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning_osdp.budget import format_bytes
from lightning_osdp.plan import Plan
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.topology import Topology

__all__ = ["Resolution", "ResumedPlan", "planned_for", "resolve_plan"]


class ResumedPlan(Protocol):
    """What the checkpoint being resumed says of its plan (``lightning_osdp.checkpoint.PlanChoice``): the plan to
    reuse (``None``: plan again), its profile's JSON document, and why."""

    @property
    def plan(self) -> Plan | None: ...

    @property
    def profile(self) -> dict[str, Any] | None: ...

    @property
    def reason(self) -> str: ...


@dataclass(frozen=True)
class Resolution:
    """The plan a run trains under and how it was chosen.

    Attributes:
        plan: the plan.
        source: ``"given"``, ``"checkpoint"``, ``"corrected"`` (solved again from the checkpoint's profile: with its
            measured correction, or this run's micro-batches) or ``"solved"`` (profiled and solved in this run).
        profile: the profile the plan was solved from (``None`` for a given plan, or a checkpoint without one).
        messages: what the run should log, in order (why a checkpoint's plan was or was not reused).
    """

    plan: Plan
    source: str
    profile: ModelProfile | None
    messages: list[str] = field(default_factory=list)

    @property
    def solved_here(self) -> bool:
        """Whether this run profiled the model and solved (its plan and profile are worth saving)."""
        return self.source == "solved"


def planned_for(plan: Plan, world_size: int) -> Topology | None:
    """The topology a saved plan was solved for, its shard group size spelled out (``None``: unreadable). The solver
    records it unless it was one node of one shard group; a plan reused on resume was made for ``world_size``."""
    saved = plan.info.get("topology")
    try:
        topology = Topology.from_dict(saved) if isinstance(saved, dict) else Topology.flat(world_size)
    except (KeyError, TypeError, ValueError):
        return None
    return Topology(topology.nodes, topology.ranks_per_node, topology.shard_size)


def resolve_plan(
    *,
    given: Plan | None,
    resumed: ResumedPlan | None,
    topology: Topology,
    fits: Callable[[ModelProfile, Plan], bool],
    solve: Callable[[ModelProfile], Plan],
    profile: Callable[[], ModelProfile],
    accumulation: int | None = None,
) -> Resolution:
    """The plan to train under (see the module docstring for the order of the branches).

    Args:
        given: the user's plan, or ``None``.
        resumed: what the checkpoint being resumed decided (``None``: not resuming, or no checkpoint file).
        topology: this run's nodes, ranks per node and shard group size.
        fits: whether a plan's predicted peak, from a profile, is within the planned budget.
        solve: the planning policy on a profile (``solver.plan_model`` with the run's options).
        profile: profiles the model (a collective when several ranks run).
        accumulation: this run's micro-batches per optimizer step (``None``: as the checkpoint's profile says).
    """
    if given is not None:
        return Resolution(given, "given", None)
    messages: list[str] = []
    if resumed is not None:
        saved = planned_for(resumed.plan, topology.world_size) if resumed.plan is not None else None
        here = Topology(topology.nodes, topology.ranks_per_node, topology.shard_size)
        if saved is not None and saved != here:
            messages.append(
                f"the checkpoint's plan was made for {saved.describe()} and this run is {topology.describe()}: "
                "planning again (the checkpoint loads under the new plan)"
            )
        else:
            messages.append(resumed.reason)
            if resumed.plan is not None:
                saved_profile = ModelProfile.from_dict(resumed.profile) if resumed.profile else None
                if (
                    saved_profile is not None
                    and accumulation is not None
                    and saved_profile.gradient_accumulation != accumulation
                ):
                    messages.append(
                        f"the checkpoint's plan was made for {saved_profile.gradient_accumulation} micro-batch(es) per "
                        f"optimizer step and this run accumulates {accumulation}: planning again from the saved profile"
                    )
                    replanned = dataclasses.replace(saved_profile, gradient_accumulation=accumulation)
                    return Resolution(solve(replanned), "corrected", replanned, messages)
                if saved_profile is None or saved_profile.measured_peak_correction <= 0:
                    return Resolution(resumed.plan, "checkpoint", saved_profile, messages)
                if fits(saved_profile, resumed.plan):
                    return Resolution(resumed.plan, "checkpoint", saved_profile, messages)
                messages.append(
                    "the saved plan went over its budget when it ran (the profile carries a measured correction of "
                    f"{format_bytes(saved_profile.measured_peak_correction)}): planning again from the saved profile"
                )
                return Resolution(solve(saved_profile), "corrected", saved_profile, messages)
    measured = profile()
    return Resolution(solve(measured), "solved", measured, messages)
