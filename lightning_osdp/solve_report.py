"""What the solver says about a plan it made: a typed record that travels with the plan (``Plan.report``).

[Note: the report and plan.info]
Before the report existed the solver wrote these figures into the free-form ``Plan.info`` dict, and readers took
them back by key (``plan.info["predicted_peak_bytes"]``). That spelling is public and stays: a plan that carries a
report also carries its figures in ``info`` under those names (:meth:`SolveReport.as_info`), in memory and in the
file, where older readers look for them. The report is the source of truth: on loading, its figures replace any
``info`` entries of the same names. A version-1 plan file written before the report existed has the figures in
``info`` only; :meth:`SolveReport.from_info` reads them back, so an old file gets its typed report too.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["REPORT_VERSION", "PredictionSummary", "SolveReport"]

#: ``version`` field of the ``report`` object of a plan file; this release writes and reads this version.
REPORT_VERSION = 1

_NUMBER = (int, float)


def _read(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``data[name]``, checked to be of ``kind`` (never a bool for a number); ``ValueError`` names the field."""
    if name not in data:
        raise ValueError(f"field {name!r} is missing")
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"field {name!r} must be {expected}, got {value!r}")
    return value


def _optional(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``data[name]`` when present and not ``None`` (checked as by :func:`_read`), else ``None``."""
    return None if data.get(name) is None else _read(data, name, kind)


def _read_list(data: Mapping[str, Any], name: str, kind: type) -> tuple[Any, ...]:
    values = _read(data, name, (list, tuple))
    for value in values:
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"field {name!r} must hold {kind.__name__} values, got {value!r}")
    return tuple(values)


@dataclass(frozen=True)
class PredictionSummary:
    """The figures of the cost model's :class:`~lightning_osdp.cost_model.Prediction` that a plan keeps.

    Attributes:
        peak_bytes: predicted per-device peak memory.
        peak_parts: that peak by category (parameters, gradients, activations...) and ``"total"``.
        peak_at: the instant of the step the peak is at (``"forward h.3"``, ``"optimizer step"``...).
        step_seconds: predicted step time.
        compute_seconds: the modules' compute plus the step's constant overhead.
        communication_seconds: all collectives.
        exposed_seconds: the part of the communication not hidden behind compute.
        world_size: ranks it was predicted for.
    """

    peak_bytes: int
    peak_parts: dict[str, int]
    peak_at: str
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    exposed_seconds: float
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        """The summary as a JSON object (also what ``Prediction.to_dict`` returns)."""
        return {
            "peak_bytes": self.peak_bytes,
            "peak_parts": dict(self.peak_parts),
            "peak_at": self.peak_at,
            "step_seconds": self.step_seconds,
            "compute_seconds": self.compute_seconds,
            "communication_seconds": self.communication_seconds,
            "exposed_seconds": self.exposed_seconds,
            "world_size": self.world_size,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PredictionSummary:
        """Parse :meth:`to_dict`'s object (or ``Prediction.to_dict``'s); ``ValueError`` names a bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"must be an object, got {type(data).__name__}")
        parts = _read(data, "peak_parts", Mapping)
        for category, value in parts.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"field 'peak_parts': {category!r} must be int bytes, got {value!r}")
        return cls(
            peak_bytes=_read(data, "peak_bytes", int),
            peak_parts=dict(parts),
            peak_at=_read(data, "peak_at", str),
            step_seconds=float(_read(data, "step_seconds", _NUMBER)),
            compute_seconds=float(_read(data, "compute_seconds", _NUMBER)),
            communication_seconds=float(_read(data, "communication_seconds", _NUMBER)),
            exposed_seconds=float(_read(data, "exposed_seconds", _NUMBER)),
            world_size=_read(data, "world_size", int),
        )


@dataclass(frozen=True)
class SolveReport:
    """How :func:`~lightning_osdp.solve` made a plan, and what the cost model predicts for it.

    Attributes:
        status: ``"optimal"``, ``"within gap X"``, ``"work limit"`` (the solver's node limits ended the search) or
            ``"time limit"`` (its wall-clock safety net did), the last two with the gap the lower bound proves, when a
            plan is in hand.
        bound: what proves the status: ``"LP relaxation"``, ``"count relaxation"``, ``"count master"``, ``"branch and
            bound"`` or ``"exact check"`` (``None``: a plan file from before it was recorded).
        gap: the relative optimality gap the solver was given.
        budget_bytes: the per-device memory budget the plan was solved for.
        world_size: ranks it was solved for.
        prediction: the cost model's figures for the plan (its peak, step time and their parts).
        ilp_peak_bytes, ilp_step_seconds: the same figures as the ILP computes them: equal to the prediction's,
            or above for the peak where the ILP bounds a buffer from above (``lightning_osdp/cost_model/timeline.py``).
        planning_units: units the solver chose a mode and split for.
        options: options it chose among, over all units.
        modes, splits: the modes and split factors it was allowed.
        solve_seconds: wall time of :func:`~lightning_osdp.solve`, building the problem included.
        solver_seconds: the part spent in the ILP solver (HiGHS); ``cbc_seconds`` is its former name, kept as a
            deprecated alias (and read from plan files written under it).
        memory_budget_bytes: the budget as the user gave it, when the planning policy (which plans against it less
            a headroom) made the plan; ``None`` when :func:`~lightning_osdp.solve` was called directly, whose
            ``budget_bytes`` is then the user's.
        memory_headroom: the fraction of ``memory_budget_bytes`` the policy kept free (``None`` likewise).
        recompute: whether the solver could recompute segments: ``"auto"``, ``"selective"``, ``"full"``, ``True`` or
            ``False`` (``None``: a plan
            file from before recomputation was planned).
    """

    status: str
    bound: str | None
    gap: float
    budget_bytes: int
    world_size: int
    prediction: PredictionSummary
    ilp_peak_bytes: int
    ilp_step_seconds: float
    planning_units: int
    options: int
    modes: tuple[str, ...]
    splits: tuple[int, ...]
    solve_seconds: float
    solver_seconds: float
    memory_budget_bytes: int | None = None
    memory_headroom: float | None = None
    recompute: bool | str | None = None

    @property
    def cbc_seconds(self) -> float:
        """Deprecated: :attr:`solver_seconds` (CBC was removed; the solver is HiGHS)."""
        warnings.warn("SolveReport.cbc_seconds is deprecated: use solver_seconds", FutureWarning, stacklevel=2)
        return self.solver_seconds

    @property
    def requested_budget_bytes(self) -> int:
        """The per-device budget in the user's terms: ``memory_budget_bytes`` when the planning policy made the
        plan, else ``budget_bytes``."""
        return self.memory_budget_bytes if self.memory_budget_bytes is not None else self.budget_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """The predicted per-device peak, ``prediction.peak_bytes``."""
        return self.prediction.peak_bytes

    @property
    def predicted_step_seconds(self) -> float:
        """The predicted step time, ``prediction.step_seconds``."""
        return self.prediction.step_seconds

    @property
    def predicted_peak_at(self) -> str:
        """The instant of the predicted peak, ``prediction.peak_at``."""
        return self.prediction.peak_at

    def to_dict(self) -> dict[str, Any]:
        """The ``report`` object of a plan file (see ``docs/plan-format.md``)."""
        return {
            "version": REPORT_VERSION,
            "status": self.status,
            "bound": self.bound,
            "gap": self.gap,
            "budget_bytes": self.budget_bytes,
            "world_size": self.world_size,
            "prediction": self.prediction.to_dict(),
            "ilp_peak_bytes": self.ilp_peak_bytes,
            "ilp_step_seconds": self.ilp_step_seconds,
            "planning_units": self.planning_units,
            "options": self.options,
            "modes": list(self.modes),
            "splits": list(self.splits),
            "solve_seconds": self.solve_seconds,
            "solver_seconds": self.solver_seconds,
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_headroom": self.memory_headroom,
            "recompute": self.recompute,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SolveReport:
        """Parse a plan file's ``report`` object; ``ValueError`` names the bad field or the unsupported version."""
        if not isinstance(data, Mapping):
            raise ValueError(f"must be an object, got {type(data).__name__}")
        if data.get("version") != REPORT_VERSION:
            raise ValueError(
                f"version {data.get('version')!r} is not supported (this lightning_osdp reads version {REPORT_VERSION})"
            )
        return cls._from_fields(data)

    @classmethod
    def _from_fields(cls, data: Mapping[str, Any]) -> SolveReport:
        summary = _read(data, "prediction", Mapping)
        try:
            prediction = PredictionSummary.from_dict(summary)
        except ValueError as err:
            raise ValueError(f"field 'prediction': {err}") from None
        bound = _optional(data, "bound", str)
        headroom = _optional(data, "memory_headroom", _NUMBER)
        recompute = data.get("recompute")
        if not (recompute is None or isinstance(recompute, bool) or recompute in ("auto", "selective", "full")):
            raise ValueError(
                f'field \'recompute\' must be true, false, "auto", "selective" or "full", got {recompute!r}'
            )
        return cls(
            status=_read(data, "status", str),
            bound=bound,
            gap=float(_read(data, "gap", _NUMBER)),
            budget_bytes=_read(data, "budget_bytes", int),
            world_size=_read(data, "world_size", int),
            prediction=prediction,
            ilp_peak_bytes=_read(data, "ilp_peak_bytes", int),
            ilp_step_seconds=float(_read(data, "ilp_step_seconds", _NUMBER)),
            planning_units=_read(data, "planning_units", int),
            options=_read(data, "options", int),
            modes=_read_list(data, "modes", str),
            splits=_read_list(data, "splits", int),
            solve_seconds=float(_read(data, "solve_seconds", _NUMBER)),
            solver_seconds=float(_read(data, "solver_seconds" if "solver_seconds" in data else "cbc_seconds", _NUMBER)),
            memory_budget_bytes=_optional(data, "memory_budget_bytes", int),
            memory_headroom=None if headroom is None else float(headroom),
            recompute=recompute,
        )

    def as_info(self) -> dict[str, Any]:
        """The figures under the names ``plan.info`` has always given them (see [Note: the report and plan.info])."""
        info: dict[str, Any] = {"status": self.status}
        if self.bound is not None:
            info["bound"] = self.bound
        info.update(
            gap=self.gap,
            budget_bytes=self.budget_bytes,
            world_size=self.world_size,
            predicted_peak_bytes=self.predicted_peak_bytes,
            predicted_step_seconds=self.predicted_step_seconds,
            predicted_peak_at=self.predicted_peak_at,
            ilp_peak_bytes=self.ilp_peak_bytes,
            ilp_step_seconds=self.ilp_step_seconds,
            planning_units=self.planning_units,
            options=self.options,
            modes=list(self.modes),
            splits=list(self.splits),
            solve_seconds=self.solve_seconds,
            cbc_seconds=self.solver_seconds,  # plan.info's historical name
            prediction=self.prediction.to_dict(),
        )
        if self.memory_budget_bytes is not None:
            info["memory_budget_bytes"] = self.memory_budget_bytes
        if self.memory_headroom is not None:
            info["memory_headroom"] = self.memory_headroom
        if self.recompute is not None:
            info["recompute"] = self.recompute
        return info

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> SolveReport | None:
        """The report of a plan file written before reports existed, from the figures the solver put in its
        ``info``; ``None`` when ``info`` does not hold a solver's figures (a hand-written plan, a uniform one, or
        an ``info`` edited by hand: ``info`` was never validated, so it is not an error)."""
        if "status" not in info or "prediction" not in info:
            return None
        try:
            return cls._from_fields(info)
        except ValueError:
            return None
