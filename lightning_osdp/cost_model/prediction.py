"""``predict``: a plan's per-device peak memory and step time, from a profile, without running anything."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_osdp.cost_model.config import CostModelConfig, ResolvedConfig
from lightning_osdp.cost_model.parts import CATEGORIES, ZERO, MemoryParts
from lightning_osdp.cost_model.structure import FreeRun, LocalUnit, ModelInfo, build_structure
from lightning_osdp.cost_model.timeline import (
    FreeCosts,
    GlobalChoice,
    SegmentChoice,
    TimelineInput,
    build_timeline,
    phase_of,
    simulate_free,
    simulate_segment,
)
from lightning_osdp.cost_model.units import SHARDED_MODES, UnitTime
from lightning_osdp.plan import Plan
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.solve_report import PredictionSummary
from lightning_osdp.topology import Topology

__all__ = ["MemoryInstant", "Prediction", "PredictionCheck", "UnitPrediction", "memory_timeline", "predict"]


@dataclass(frozen=True)
class UnitPrediction:
    """One decision's unit (the ``k`` slices of a split Linear together).

    Attributes:
        name: the decided module (``""`` for the root; the first holder for a tied group).
        modules: the modules the FSDP2 group is applied to.
        mode, split: the decision.
        param_count: elements of its parameters.
        kept: bytes it keeps for the whole step on this rank: parameters, sharded gradients, optimizer state.
        gathered: bytes while gathered (unsharded parameters plus the all-gather output; the largest slice).
        time: its seconds (communication, exposed, copies, optimizer, overhead, and its modules' compute).
    """

    name: str
    modules: tuple[str, ...]
    mode: str
    split: int
    param_count: int
    kept: MemoryParts
    gathered: int
    time: UnitTime


@dataclass(frozen=True)
class MemoryInstant:
    """One instant of the step's memory as the cost model walks it (``timeline.py``); the predicted peak is the
    largest.

    Attributes:
        position: its place in the step, counted in instants from the step's start (0).
        label: what happens then (``"forward model.blocks.3"``, ``"loss"``, ``"optimizer step"``...).
        phase: ``"forward"``, ``"loss"``, ``"backward"`` or ``"optimizer"`` (``timeline.PHASES``).
        parts: the bytes live on the device then, by category.
    """

    position: int
    label: str
    phase: str
    parts: MemoryParts


@dataclass(frozen=True)
class PredictionCheck:
    """A prediction against what a run measured (see :meth:`Prediction.check`).

    Attributes:
        ok: both within tolerance (a figure not measured counts as within).
        memory_ratio: predicted / measured peak memory (``None`` when not measured).
        time_ratio: predicted / measured step time (``None`` when not measured).
        message: one paragraph for the log: both figures, and for a miss, what the prediction was made of.
    """

    ok: bool
    memory_ratio: float | None
    time_ratio: float | None
    message: str


@dataclass
class Prediction:
    """Predicted per-device peak memory and step time of a plan (rank 0, the rank with the largest shards).

    Attributes:
        peak: the largest memory instant of the step, by category.
        peak_at: which instant that is (``"forward model.blocks.3"``, ``"loss"``, ``"optimizer step"``...).
        step_seconds: predicted step time: ``compute_seconds + exposed_seconds + copies + optimizer + overhead``.
        compute_seconds: the modules' forward and backward compute plus the step's constant overhead.
        communication_seconds: all collectives.
        exposed_seconds: the part of ``communication_seconds`` not hidden behind compute.
        units: per-unit figures.
        world_size: ranks.
        instants: every modelled instant ``(label, bytes)``, in step order (for debugging; by category:
            :meth:`memory_timeline`).
        copies_seconds: FSDP2's and DDP's memory copies that are not hidden (all units).
        optimizer_seconds: the optimizer step (all units).
        overhead_seconds: the units' hooks and split calls that are not hidden.
        step_overhead_seconds: the part of ``compute_seconds`` outside the modules: the loss, the optimizer step's
            framework, the training loop around the step.
        topology: the nodes and shard groups it was predicted for (``None``: ``world_size`` ranks on one node).
        unoverlapped_seconds: the part of ``exposed_seconds`` no compute could hide (the root's gathers before the
            step's compute, the reductions of FSDP2's final callback after it; ``UnitTime.unoverlapped``).
        contention_seconds: compute time lost to the collectives it hides (``UnitTime.contention``).
    """

    peak: MemoryParts
    peak_at: str
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    exposed_seconds: float
    units: list[UnitPrediction]
    world_size: int
    instants: list[tuple[str, int]] = field(default_factory=list, repr=False)
    copies_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    overhead_seconds: float = 0.0
    step_overhead_seconds: float = 0.0

    topology: Topology | None = None
    unoverlapped_seconds: float = 0.0
    contention_seconds: float = 0.0
    #: ``instants``' bytes by category (:meth:`memory_timeline`)
    instant_parts: list[MemoryParts] = field(default_factory=list, repr=False)

    def memory_timeline(self) -> list[MemoryInstant]:
        """Every instant of the step in order, by category and phase: the instants the peak is the largest of."""
        return [
            MemoryInstant(i, label, phase_of(label), parts)
            for i, ((label, _), parts) in enumerate(zip(self.instants, self.instant_parts, strict=True))
        ]

    @property
    def step_parts(self) -> dict[str, float]:
        """The step time in parts that add up to ``step_seconds``: ``compute`` (the modules' forward and backward),
        ``recompute`` (the forward run again in backward by recomputed modules), ``exposed_communication``,
        ``contention`` (compute slowed by the collectives it hides), ``copies``, ``optimizer`` and ``overhead`` (hooks,
        loss, training loop)."""
        parts = {
            "compute": self.compute_seconds - self.step_overhead_seconds,
            "recompute": 0.0,
            "exposed_communication": self.exposed_seconds,
            "contention": self.contention_seconds,
            "copies": self.copies_seconds,
            "optimizer": self.optimizer_seconds,
            "overhead": self.overhead_seconds + self.step_overhead_seconds,
        }
        # The timeline adds each recomputed module's forward seconds to its segment's (timeline.py
        # `_recompute_seconds`), the one term of the step no unit carries: what the other parts leave.
        rest = self.step_seconds - sum(parts.values())
        parts["recompute"] = rest if rest > 1e-9 * max(self.step_seconds, 1e-30) else 0.0
        return parts

    @property
    def exposed_by_cause(self) -> dict[str, float]:
        """The exposed communication and contention by cause: ``not_hidden`` (more than its unit's compute can hide),
        ``unoverlapped`` (before the step's first compute or after its last) and ``contention``."""
        return {
            "not_hidden": self.exposed_seconds - self.unoverlapped_seconds,
            "unoverlapped": self.unoverlapped_seconds,
            "contention": self.contention_seconds,
        }

    @property
    def peak_bytes(self) -> int:
        """The predicted peak in bytes."""
        return self.peak.total

    def missed_bytes(self, measured_peak_bytes: int) -> int:
        """How far a measured peak is above this prediction (0 when it is not): what the profile's
        ``measured_peak_correction`` grows by when a run goes over its budget."""
        return max(measured_peak_bytes - self.peak_bytes, 0)

    def summary(self) -> PredictionSummary:
        """The figures a plan keeps of this prediction (``plan.info["prediction"]``)."""
        return PredictionSummary(
            peak_bytes=self.peak_bytes,
            peak_parts=self.peak.as_dict(),
            peak_at=self.peak_at,
            step_seconds=self.step_seconds,
            compute_seconds=self.compute_seconds,
            communication_seconds=self.communication_seconds,
            exposed_seconds=self.exposed_seconds,
            world_size=self.world_size,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (saved in ``plan.info``): :meth:`summary` as a JSON object."""
        return self.summary().to_dict()

    def check(
        self,
        measured_peak_bytes: int | None,
        measured_step_seconds: float | None,
        *,
        memory_tolerance: float = 0.10,
        time_tolerance: float = 0.15,
    ) -> PredictionCheck:
        """Compare with a run's measured peak memory and step time; a miss names the parts the prediction is made
        of (the peak's instant and categories, the step's compute and communication), so that the user can tell
        which figure of the profile was off."""
        from lightning_osdp.budget import format_bytes

        memory_ratio = self.peak_bytes / measured_peak_bytes if measured_peak_bytes else None
        time_ratio = self.step_seconds / measured_step_seconds if measured_step_seconds else None
        memory_ok = memory_ratio is None or abs(memory_ratio - 1) <= memory_tolerance
        time_ok = time_ratio is None or abs(time_ratio - 1) <= time_tolerance
        parts = []
        if measured_peak_bytes:
            parts.append(
                f"peak memory predicted {format_bytes(self.peak_bytes)}, measured {format_bytes(measured_peak_bytes)}"
                f" (x{memory_ratio:.2f})"
            )
        if measured_step_seconds:
            parts.append(
                f"step time predicted {self.step_seconds * 1e3:.1f} ms, measured {measured_step_seconds * 1e3:.1f} ms"
                f" (x{time_ratio:.2f})"
            )
        message = "; ".join(parts) or "nothing measured"
        if not memory_ok:
            largest = sorted(
                ((k.replace("_", " "), v) for k, v in self.peak.as_dict().items() if k != "total"), key=lambda t: -t[1]
            )
            made_of = ", ".join(f"{k} {format_bytes(v)}" for k, v in largest if v)
            message += (
                f". The predicted peak is at {self.peak_at!r}: {made_of}; a miss this large usually means the "
                "profile's activation figures (batch shape) or the optimizer's state differ from the run"
            )
        if not time_ok:
            message += (
                f". The predicted step is compute {self.compute_seconds * 1e3:.1f} ms and communication "
                f"{self.exposed_seconds * 1e3:.1f} ms exposed of {self.communication_seconds * 1e3:.1f} ms: "
                "compare the profile's module times and collective fits with the run's (load from other "
                "processes on the machine inflates both)"
            )
        return PredictionCheck(memory_ok and time_ok, memory_ratio, time_ratio, message)

    def __str__(self) -> str:
        from lightning_osdp.budget import format_bytes

        where = (
            f"world size {self.world_size}"
            if self.topology is None or self.topology.is_flat
            else self.topology.describe()
        )
        lines = [f"Predicted peak {format_bytes(self.peak_bytes)} per device at {self.peak_at!r} ({where}):"]
        for name in CATEGORIES:
            lines.append(f"  {name.replace('_', ' '):<22} {format_bytes(getattr(self.peak, name)):>12}")
        parts = ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.1f} ms" for k, v in self.step_parts.items())
        lines.append(
            f"Predicted step {self.step_seconds * 1e3:.1f} ms: {parts} "
            f"(communication {self.communication_seconds * 1e3:.1f} ms, of which the exposed part above)"
        )
        lines.append(f"{'unit':<32} {'mode':<14} {'split':>5} {'kept':>12} {'gathered':>12} {'comm ms':>9}")
        for u in self.units:
            lines.append(
                f"{(u.name or '<root>')[:32]:<32} {u.mode:<14} {u.split:>5} {format_bytes(u.kept.total):>12} "
                f"{format_bytes(u.gathered):>12} {u.time.communication * 1e3:>9.2f}"
            )
        return "\n".join(lines)


class NumericBackend:
    """Evaluates the timeline with exactly one option per choice (see ``timeline.py``)."""

    def __init__(self) -> None:
        self.peak = ZERO
        self.peak_at = ""
        self.instants: list[tuple[str, int]] = []
        self.instant_parts: list[MemoryParts] = []
        self.step_seconds = 0.0

    def const(self, parts: MemoryParts) -> MemoryParts:
        return parts

    def choice(self, key: Hashable, values: Mapping[Hashable, MemoryParts]) -> MemoryParts:
        (value,) = values.values()
        return value

    def add(self, a: MemoryParts, b: MemoryParts) -> MemoryParts:
        return a + b

    def sub(self, a: MemoryParts, b: MemoryParts) -> MemoryParts:
        return a - b

    def checkpoint(self, label: str, value: MemoryParts) -> None:
        self.instants.append((label, value.total))
        self.instant_parts.append(value)
        if value.total > self.peak.total or not self.instants[:-1]:
            self.peak, self.peak_at = value, label

    def checkpoint_options(
        self,
        label: str,
        base: MemoryParts,
        cross: Sequence[MemoryParts],
        key: Hashable,
        values: Mapping[Hashable, MemoryParts | None],
    ) -> None:
        (value,) = values.values()
        if value is None:
            return
        self.checkpoint(label, sum(cross, base) + value)

    def materialize(self, value: MemoryParts, name: str) -> MemoryParts:
        return value

    def maximum(self, values: Sequence[MemoryParts], name: str) -> MemoryParts:
        return max(values, key=lambda v: v.total, default=ZERO)

    def seconds(self, key: Hashable, values: Mapping[Hashable, float]) -> None:
        (value,) = values.values()
        self.step_seconds += value

    def constant_seconds(self, seconds: float) -> None:
        self.step_seconds += seconds


def _unit_predictions(units: Sequence[LocalUnit]) -> list[UnitPrediction]:
    grouped: dict[str, list[LocalUnit]] = {}
    for u in units:
        grouped.setdefault(u.decision_name, []).append(u)
    out = []
    for name, us in grouped.items():
        first = us[0]
        kept = sum(
            (
                MemoryParts(
                    parameters=u.bytes.params, gradients=u.bytes.grad + u.bytes.bucket, optimizer_states=u.bytes.optim
                )
                for u in us
            ),
            ZERO,
        )
        time = sum((u.time for u in us), UnitTime())
        gathered = max(u.bytes.gathered + u.bytes.flat for u in us)
        names = first.names if len(us) == 1 else (name,)
        out.append(
            UnitPrediction(
                name, names, first.mode, first.split, sum(u.bytes.param_count for u in us), kept, gathered, time
            )
        )
    return out


def timeline_input(info: ModelInfo, plan: Plan) -> tuple[TimelineInput[MemoryParts], list[LocalUnit]]:
    """The plan's structure, simulated per segment, ready for :func:`build_timeline` (one option per choice)."""
    structure = build_structure(info, plan)
    temporaries = info.config.optimizer_temporaries
    items: list[SegmentChoice | FreeCosts] = []
    units: list[LocalUnit] = []
    for item in structure.items:
        if isinstance(item, FreeRun):
            items.append(simulate_free(item))
        else:
            costs = simulate_segment(
                item, temporaries, release_after_forward=info.config.release_all_gather_after_forward
            )
            items.append(SegmentChoice(item.entry, {0: costs}, item.bounds[0], item.bounds[1]))
            units.extend(item.units)
    globals_ = [GlobalChoice(g.decision_name, {0: g}, is_root=(g.decision_name == "")) for g in structure.globals]
    spec: TimelineInput[MemoryParts] = TimelineInput(
        globals=globals_,
        items=items,
        compute_seconds=structure.compute_seconds + info.config.step_overhead_seconds,
        extra_activation_bytes=structure.extra_activation_bytes,
        last_output_bytes=structure.last_output_bytes,
        buffer_bytes=structure.buffer_bytes,
        optimizer_temporaries=temporaries,
        any_sharded=any(d.mode in SHARDED_MODES for d in plan.decisions.values()),
        globals_bound_pending=structure.globals_bound_pending,
        release_after_forward=info.config.release_all_gather_after_forward,
    )
    return spec, [*structure.globals, *units]


def predict(
    profile: ModelProfile,
    plan: Plan,
    world_size: int | Topology | None = None,
    *,
    config: CostModelConfig | None = None,
) -> Prediction:
    """Predict ``plan``'s per-device peak memory and step time on ``world_size`` ranks.

    Args:
        profile: the model's profile (exclusive per-module figures and collective fits).
        plan: the decisions; modules without one are covered by their nearest decided ancestor (the root ``""``,
            ``no_shard`` unless the plan says otherwise).
        world_size: ranks to shard over (default: the profile's), or a :class:`~lightning_osdp.topology.Topology`
            (nodes, ranks per node, ``hybrid_shard``'s shard group); an ``int`` is that many ranks on one node
            (with the profile's ranks per node, when it was measured on several nodes).
        config: machine constants not in the profile (see :class:`CostModelConfig`).

    Returns:
        a :class:`Prediction` (printable) of rank 0, which holds the largest shards.
    """
    resolved = (config or CostModelConfig()).resolve(profile)
    return _predict(profile, plan, world_size or profile.world_size, resolved)


def _predict(profile: ModelProfile, plan: Plan, world_size: int | Topology, config: ResolvedConfig) -> Prediction:
    info = ModelInfo(profile, world_size, config)
    spec, units = timeline_input(info, plan)
    be = NumericBackend()
    build_timeline(spec, be)
    times = [u.time for u in units]
    return Prediction(
        peak=be.peak,
        peak_at=be.peak_at,
        step_seconds=be.step_seconds,
        compute_seconds=spec.compute_seconds,
        communication_seconds=sum(t.communication for t in times),
        exposed_seconds=sum(t.exposed for t in times),
        units=_unit_predictions(units),
        world_size=info.world_size,
        instants=be.instants,
        instant_parts=be.instant_parts,
        copies_seconds=sum(t.copies for t in times),
        optimizer_seconds=sum(t.optimizer for t in times),
        overhead_seconds=sum(t.overhead for t in times),
        step_overhead_seconds=config.step_overhead_seconds,
        topology=info.topology,
        unoverlapped_seconds=sum(t.unoverlapped for t in times),
        contention_seconds=sum(t.contention for t in times),
    )


def memory_timeline(
    profile: ModelProfile,
    plan: Plan,
    world_size: int | Topology | None = None,
    *,
    config: CostModelConfig | None = None,
) -> list[MemoryInstant]:
    """``plan``'s memory over one training step on rank 0, instant by instant and by category: the walk
    :func:`predict` takes the peak of (the arguments are :func:`predict`'s), so its largest instant is the predicted
    peak."""
    return predict(profile, plan, world_size, config=config).memory_timeline()
