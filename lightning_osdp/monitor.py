"""``OSDPMonitor``: the measured side of a run, as a Lightning callback the strategy attaches by itself.

Per training batch (all its accumulated micro-batches, up to and including the optimizer step) it times the step and
measures its peak memory on this rank (:class:`~lightning_osdp.step_monitor.StepMonitor`), logs ``osdp/step_time_s``
and ``osdp/peak_memory_bytes``, and after the first steps compares them once with the plan's prediction. A measured
peak over the memory budget is a warning with both figures, and the miss is recorded in the profile as a correction
(``ModelProfile.measured_peak_correction``, which the cost model holds all step): in the profile file saved beside
the plan, and in the checkpoints saved from then on, so that a run resuming from one plans with it.

[Note: where the correction is kept]
The correction lives in the profile, not in the callback's ``state_dict``: a resumed run decides its plan in the
strategy's ``setup``, and Lightning restores callback states after ``setup`` (the strategy restores checkpoints after
it applied the plan), too late for the decision. The callback's own state is its measurements and the plan they were
made under, saved and restored as Lightning saves any callback's; a resumed run keeps them apart
(:attr:`OSDPMonitor.history`): its own figures and its prediction check are of its own steps, under its own plan.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_osdp.budget import format_bytes
from lightning_osdp.plan import Plan
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.step_monitor import StepMeasurement, StepMonitor
from lightning_osdp.topology import Topology

if TYPE_CHECKING:
    from lightning_osdp.cost_model import Prediction, PredictionCheck

__all__ = ["OSDPMonitor"]


class OSDPMonitor(Callback):
    """Step time, peak memory and the prediction check of a run under ``OSDPStrategy`` (see the module docstring).

    Args:
        device: this rank's device.
        plan: the plan in force.
        profile: the profile the plan was solved from (``None``: a plan given by hand, nothing to check).
        topology: the run's topology, what the prediction is made for.
        memory_budget: the per-device budget in bytes (``None``: unknown).
        profile_file: where this run saved the profile beside its plan (rank 0), to record a correction in.
        memory_steps: on CPU, how many first steps the live-storage tracker measures.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        plan: Plan,
        profile: ModelProfile | None,
        topology: Topology,
        memory_budget: int | None,
        profile_file: Path | None = None,
        memory_steps: int = 3,
    ) -> None:
        self.steps = StepMonitor(device, memory_steps=memory_steps)
        self.plan = plan
        self.profile = profile
        self.topology = topology
        self.memory_budget = memory_budget
        self.profile_file = profile_file
        self.prediction_check: PredictionCheck | None = None
        #: What the run this one resumed measured: its plan's dict and its steps (empty when not resumed).
        self.history: list[dict[str, Any]] = []
        self._step_started_at: int | None = None  # the trainer's global step when the running step began
        self._prediction: Prediction | None = None
        self._corrected_by = 0  # the correction this run recorded (bytes), see `check_prediction`

    # ------------------------------------------------------------------ figures
    @property
    def peak_memory_bytes(self) -> int | None:
        """This rank's measured peak memory of a training step (largest over the measured steps)."""
        return self.steps.peak_memory_bytes

    @property
    def step_time(self) -> float | None:
        """This rank's median measured step time in seconds (first step excluded)."""
        return self.steps.step_time()

    def prediction(self) -> Prediction | None:
        """The plan's prediction, from the profile it was solved with (``None`` without one): a correction recorded
        later (see :meth:`check_prediction`) is the next plan's, and never rewrites what this one predicted."""
        if self.profile is None:
            return None
        if self._prediction is None:
            from lightning_osdp.cost_model import predict

            self._prediction = predict(self.profile, self.plan, self.topology)
        return self._prediction

    def summary(self, trainer: pl.Trainer | None, rank: int) -> str:
        """One line for the end of a run: the step reached and the last logged metrics, the plan in force, and this
        rank's measured step time and peak memory beside the plan's prediction."""
        parts = []
        if trainer is not None:
            metrics = []
            for name, value in sorted(trainer.callback_metrics.items()):
                if (isinstance(value, Tensor) and value.numel() == 1) or isinstance(value, (int, float)):
                    number = float(value)
                    if math.isfinite(number):
                        metrics.append(f"{name}={number:.4f}")
            parts.append(f"step {trainer.global_step}: " + (" ".join(metrics) or "no metrics logged"))
        budget = f", budget {format_bytes(self.memory_budget)} per device" if self.memory_budget else ""
        parts.append(f"{self.plan.summary()} on {self.topology.world_size} ranks{budget}")
        predicted = self.prediction()
        measured = []
        if self.step_time is not None:
            # One figure, said what it is: the median of the timed steps (step_monitor.py [Note: timed steps]).
            timed = sum(not m.tracked for m in self.steps.measurements[1:])
            over = f"median of {timed} untracked steps after the first" if timed > 1 else "one untracked step"
            guess = f"; predicted {predicted.step_seconds * 1e3:.1f} ms" if predicted else ""
            measured.append(f"step {self.step_time * 1e3:.1f} ms ({over}{guess})")
        if self.peak_memory_bytes is not None:
            notes = [f"predicted {format_bytes(predicted.peak_bytes)}"] if predicted else []
            if self._corrected_by:
                notes.append(f"the next plan adds {format_bytes(self._corrected_by)}")
            guess = f" ({'; '.join(notes)})" if notes else ""
            measured.append(f"peak memory {format_bytes(self.peak_memory_bytes)}{guess}")
        if measured:
            parts.append(f"rank {rank} measured: " + ", ".join(measured))
        return " | ".join(parts)

    # ------------------------------------------------------------------ Lightning's hooks
    def attach(self, trainer: pl.Trainer) -> None:
        """Join the Trainer's callbacks (once), before its checkpoint callbacks: a step's measurement ends before a
        checkpoint is written."""
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set by its callback connector
        if self not in callbacks:
            first_checkpoint = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
            callbacks.insert(first_checkpoint, self)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.steps.running:
            return  # an accumulating micro-batch of the step already running
        self._step_started_at = trainer.global_step
        self.steps.start(trainer.strategy.model, *trainer.optimizers)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.steps.running or trainer.global_step == self._step_started_at:
            return  # no optimizer step yet: the step goes on over the next micro-batch
        measurement = self.steps.stop()
        if measurement is not None and trainer.is_global_zero:
            self._log(trainer, measurement)
            if self.steps.check_due(measurement):
                self._check_prediction(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.steps.abort()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.abort()  # a step cut short by max_steps or a stop signal is not a step
        if self.prediction_check is None and self.steps.measurements and trainer.is_global_zero:
            self._check_prediction(trainer)  # a run shorter than the check's steps: checked on what it measured

    @override
    def state_dict(self) -> dict[str, Any]:
        run = {"plan": self.plan.to_dict(), "measurements": [asdict(m) for m in self.steps.measurements]}
        return {"history": [*self.history, run]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))

    # ------------------------------------------------------------------ internals
    def _log(self, trainer: pl.Trainer, measurement: StepMeasurement) -> None:
        every = max(int(getattr(trainer, "log_every_n_steps", 1)), 1)
        if (trainer.global_step + 1) % every == 0 or measurement.step < 3:
            metrics: dict[str, float] = {"osdp/step_time_s": measurement.seconds}
            if measurement.peak_memory_bytes is not None:
                metrics["osdp/peak_memory_bytes"] = float(measurement.peak_memory_bytes)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _check_prediction(self, trainer: pl.Trainer) -> None:
        check = self.announce_check()
        prediction = self.prediction()
        if check is None or prediction is None:
            return  # a plan given by hand has no prediction to check
        for logger in trainer.loggers:
            logger.log_metrics(
                {
                    "osdp/predicted_peak_memory_bytes": float(prediction.peak_bytes),
                    "osdp/predicted_step_time_s": prediction.step_seconds,
                },
                step=trainer.global_step,
            )

    def announce_check(self) -> PredictionCheck | None:
        """:meth:`check_prediction`, said on rank 0's log (a warning when the cost model missed): what both strategies
        run after the first steps (``StepMonitor.check_after``), or at the end of a shorter run."""
        check = self.check_prediction()
        if check is None:
            return None

        def span(steps: list[int], what: str) -> list[str]:
            if not steps:
                return []
            return [f"steps {steps[0]}-{steps[-1]} ({what})" if len(steps) > 1 else f"step {steps[0]} ({what})"]

        measured = self.steps.measurements
        steps = ", ".join(
            span([m.step + 1 for m in measured if m.peak_memory_bytes is not None], "peak")
            + span([m.step + 1 for m in measured[1:] if not m.tracked], "median time")
        )
        if check.ok:
            rank_zero_info(f"OSDP: prediction held on rank 0 over {steps}: {check.message}")
        else:
            rank_zero_warn(f"OSDP: the cost model missed on rank 0 over {steps}: {check.message}")
        return check

    def check_prediction(self) -> PredictionCheck | None:
        """The predicted peak memory and step time against the measured ones (``None`` without a profile to predict
        from). A measured peak over the budget records the miss as a correction (see the module docstring). Run once,
        on rank 0, after the first steps (``StepMonitor.check_after``), or at the end of a shorter run."""
        prediction = self.prediction()
        if prediction is None:
            return None
        measured = self.peak_memory_bytes
        self.prediction_check = check = prediction.check(measured, self.steps.step_time(skip=1))
        if measured is not None and self.memory_budget is not None and measured > self.memory_budget:
            self._record_correction(measured, prediction)
        return check

    def _record_correction(self, measured: int, prediction: Prediction) -> None:
        assert self.profile is not None and self.memory_budget is not None
        predicted = prediction.peak_bytes
        self.profile = self.profile.with_correction(prediction.missed_bytes(measured))
        self._corrected_by = prediction.missed_bytes(measured)
        where = ["the checkpoints this run saves from now on"]
        if self.profile_file is not None:
            self.profile.save(self.profile_file)
            where.insert(0, str(self.profile_file))
        rank_zero_warn(
            f"OSDP: the measured peak memory {format_bytes(measured)} ({measured} bytes) on rank 0 is over the memory "
            f"budget of {format_bytes(self.memory_budget)} ({self.memory_budget} bytes); the plan was predicted at "
            f"{format_bytes(predicted)} ({predicted} bytes). The profile now carries a correction of "
            f"{format_bytes(self.profile.measured_peak_correction)}, recorded in {' and in '.join(where)}: a run that "
            "resumes from one of them plans with it. To stay under the budget now, restart with a larger "
            "memory_headroom or a smaller memory_budget."
        )
