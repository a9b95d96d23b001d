"""Measuring the memory of a step's loss region, in the profiled step, at the instants the cost model places it.

[Note: the loss region]
A language model's largest tensors are around its loss, outside every module: the logits, their log-softmax (saved
for backward), a float copy under mixed precision, what metrics compute from them, and in backward the gradients of
all of these. No module's figures hold them, and their size depends on the user's ``training_step`` (label
smoothing, metrics on the logits, a returned dict that keeps the logits until the optimizer step), so the profile
measures them rather than deriving them: a :class:`~lightning_osdp.memory.MemoryMeter` (live tensor storages on
CPU and for fake tensors, the allocator's statistics on CUDA) runs through the traced step, and the module tracer
marks four instants on it:

1. *the model's last call returned*: the last time in forward that a top-level module holding parameters returns
   (the LightningModule's ``forward``, or ``self.model``; a torchmetrics ``Metric`` holds none, so a metric called
   after the model is in the region). The region starts here, with the output (the logits) live;
2. *backward starts*: just before ``loss.backward()``;
3. *the first module's backward runs*: the first autograd node a module's forward created starts (the loss's own
   nodes run before it);
4. the end of the step.

Each figure of :class:`~lightning_osdp.profiling.model_profile.LossMemory` is a difference of live bytes between
these instants, or the largest live bytes between two of them less those at the first: all relative, so that the
model's persistent state (parameters, optimizer state), which differs between the profiled replica and a sharded
run, cancels out. The cost model adds them where the same instants fall in its timeline (``timeline.py``, the
``loss`` and ``loss backward`` instants, and what stays for the rest of backward).

What the profiled step leaves out: the real step's ``self.log`` (a no-op while profiling; it stores scalars), and
in estimated mode the torchmetrics updates (they cannot run on fake tensors, see ``step.py``). The step runner
keeps ``training_step``'s output until the step ends, as Lightning's closure does, so that a dict's tensors stay
alive as they will.
"""

from __future__ import annotations

from lightning_osdp.memory import MemoryMeter
from lightning_osdp.profiling.model_profile import LossMemory

__all__ = ["LossRegionRecorder"]


class LossRegionRecorder:
    """The instants of [Note: the loss region] on ``meter``, marked by the module tracer in one step."""

    def __init__(self, meter: MemoryMeter) -> None:
        self.meter = meter
        self._start: tuple[int, int, int] | None = None  # (live bytes, output bytes, outside activation bytes)
        self._forward_peak = 0
        self._backward_start: int | None = None
        self._backward_peak = 0
        self._backward_end: int | None = None

    def model_returned(self, output_bytes: int, outside_activation_bytes: int) -> None:
        """A top-level module holding parameters returned in forward: the region (re)starts here, until the first
        backward (a manual ``training_step`` may run the model again after it)."""
        if self._backward_start is not None:
            return
        _, live = self.meter.mark()
        self._start = (live, output_bytes, outside_activation_bytes)

    def backward_started(self) -> None:
        """``loss.backward()`` is about to run (the first backward only counts)."""
        if self._backward_start is not None:
            return
        self._forward_peak, self._backward_start = self.meter.mark()

    def module_backward_started(self) -> None:
        """An autograd node of a module's forward is about to run (only the first call counts)."""
        if self._backward_start is not None and self._backward_end is None:
            self._backward_peak, self._backward_end = self.meter.mark()

    def backward_ended(self) -> None:
        """``loss.backward()`` returned: if no module's node ran, the region lasted until now."""
        self.module_backward_started()

    def result(self) -> LossMemory | None:
        """The figures, or ``None`` when the step had no such region (no module with parameters ran, or no
        backward)."""
        if self._start is None or self._backward_start is None or self._backward_end is None:
            return None
        live, output, outside = self._start
        begin = self._backward_start
        return LossMemory(
            output_bytes=output,
            forward_peak_bytes=max(self._forward_peak - live, 0),
            backward_start_bytes=begin - live,
            backward_peak_bytes=max(self._backward_peak - begin, 0),
            backward_end_bytes=self._backward_end - begin,
            outside_activation_bytes=outside,
        )
