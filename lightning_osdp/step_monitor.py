"""Measured step time and peak memory of each optimizer step, on this rank.

[Note: measured steps and torch.compile]
On CPU the peak is counted by :class:`~lightning_osdp.memory.LiveStorageTracker`, a ``TorchDispatchMode``. Dynamo
does not compile under such a mode, and it does worse than fall back: a frame first met under one is marked to be
skipped for good (torch 2.9-2.13: ``ConvertFrameReturn``'s default is "skip this code object from now on"), so a
block compiled in the user's ``__init__`` and first called in a measured step would never compile in the whole run.
The tracked steps therefore run under ``torch.compiler.set_stance("force_eager")``: compiled modules run their
eager code there, no frame is marked, and they compile at the first untracked step. The measured peak of those
steps is the eager step's (what the profile also measures; a compiled step keeps fewer intermediates), and their
time is eager time. CUDA measures with the allocator's statistics, no mode: every step runs as compiled.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_osdp.budget import format_bytes
from lightning_osdp.memory import LiveStorageTracker

__all__ = ["TIMED_STEPS", "SetupMeter", "StepMeasurement", "StepMonitor"]

#: Untracked steps after the first whose median time the prediction check compares (see [Note: timed steps]).
TIMED_STEPS = 3


@dataclass(frozen=True)
class StepMeasurement:
    """One optimizer step (all its accumulated micro-batches), as measured on this rank."""

    step: int
    seconds: float
    peak_memory_bytes: int | None
    #: Whether the CPU's live-storage tracker ran during the step: its time is not a training step's (see
    #: [Note: timed steps]).
    tracked: bool = False


@dataclass
class StepMonitor:
    """Times optimizer steps and measures their peak memory.

    A step runs from the first ``training_step`` (or ``optimizer_step``, which wraps it in automatic
    optimization) after the previous step ended, to the end of ``optimizer_step``. Peak memory is
    ``torch.cuda.max_memory_allocated`` on CUDA and :class:`~lightning_osdp.memory.LiveStorageTracker` on CPU
    (tracked for the first ``memory_steps`` steps only: the tracker costs Python time per operator).

    [Note: timed steps]
    The tracker is a dispatch mode: every operator of a tracked step runs through Python, which on a small model
    takes longer than the step itself. So a
    step's time counts only when it ran untracked, and never the first step's (lazy initialization, the optimizer
    state's creation): :meth:`step_time` is the median of those, and the prediction check waits for
    :data:`TIMED_STEPS` of them after the tracked ones (:meth:`check_due`), or the end of a shorter run.
    """

    device: torch.device
    memory_steps: int = 3
    measurements: list[StepMeasurement] = field(default_factory=list)
    _started_at: float | None = None
    _tracker: LiveStorageTracker | None = None
    _eager: ExitStack = field(default_factory=ExitStack)

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def start(self, *roots: Any) -> None:
        """Begin a step; ``roots`` (model, optimizers) are what CPU tracking counts as already live."""
        if self.running:
            return
        if self._measure_memory():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            elif self.device.type == "cpu":
                # See [Note: measured steps and torch.compile].
                self._eager.enter_context(torch.compiler.set_stance("force_eager"))
                self._tracker = LiveStorageTracker("cpu").start(*roots)
        self._started_at = time.perf_counter()

    def stop(self) -> StepMeasurement | None:
        """End the step and record it; ``None`` when no step was running."""
        if self._started_at is None:
            return None
        peak: int | None = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if self._measure_memory():
                peak = int(torch.cuda.max_memory_allocated(self.device))
        elapsed = time.perf_counter() - self._started_at
        tracked = self._tracker is not None
        if self._tracker is not None:
            peak = self._tracker.stop()
            self._tracker = None
        self._eager.close()
        self._started_at = None
        measurement = StepMeasurement(len(self.measurements), elapsed, peak, tracked)
        self.measurements.append(measurement)
        return measurement

    def abort(self) -> None:
        """Drop a step interrupted by an exception (restores the patched ``resize_``)."""
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None
        self._eager.close()
        self._started_at = None

    @property
    def peak_memory_bytes(self) -> int | None:
        """Largest measured peak over the steps so far (the first step creates the optimizer state)."""
        peaks = [m.peak_memory_bytes for m in self.measurements if m.peak_memory_bytes is not None]
        return max(peaks) if peaks else None

    def step_time(self, skip: int = 1) -> float | None:
        """Median time of the untracked steps after the first ``skip`` (lazy init, optimizer-state creation);
        ``None`` before one ran (see [Note: timed steps])."""
        times = [m.seconds for m in self.measurements[skip:] if not m.tracked]
        return statistics.median(times) if times else None

    @property
    def check_after(self) -> int:
        """How many steps the prediction check waits for: the memory-tracked ones (on CPU) and :data:`TIMED_STEPS`
        timed ones after the first step."""
        tracked = self.memory_steps if self.device.type == "cpu" else 0
        return max(tracked, 1) + TIMED_STEPS

    def check_due(self, measurement: StepMeasurement) -> bool:
        """Whether ``measurement`` is the step after which the prediction check runs (:attr:`check_after`)."""
        return measurement.step + 1 == self.check_after

    def _measure_memory(self) -> bool:
        return len(self.measurements) < self.memory_steps or self.device.type == "cuda"


class SetupMeter:
    """The peak memory of a strategy's ``setup``, measured as a step's: the CUDA allocator's statistics, or on CPU the
    live-storage tracker (fake tensors of an estimated profile left out, compiled modules eager, see [Note: measured
    steps and torch.compile]); ``measure=False`` measures nothing (``peak`` stays ``None``)."""

    def __init__(self, device: torch.device, measure: bool) -> None:
        self.device = device
        self.measure = measure and device.type in ("cpu", "cuda")
        self.peak: int | None = None

    @contextmanager
    def measuring(self, *roots: Any) -> Iterator[None]:
        """Measure while the context is open; ``roots`` are what is alive at its start (the model)."""
        if not self.measure:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            try:
                yield
            finally:
                self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return
        with torch.compiler.set_stance("force_eager"):
            tracker = LiveStorageTracker("cpu", count_fake=False).start(*roots)
            try:
                yield
            finally:
                self.peak = tracker.stop()

    def warn_over(self, budget: int | None) -> None:
        """A warning when the measured peak of setup went over ``budget`` (rank 0 says it)."""
        if self.peak is not None and budget is not None and self.peak > budget:
            rank_zero_warn(
                f"OSDP: setup's peak memory on rank 0, {format_bytes(self.peak)}, is over the memory budget of "
                f"{format_bytes(budget)}: build the model on the meta device (trainer.init_module(empty_init=True)) so "
                "that only its shards are ever allocated"
            )
