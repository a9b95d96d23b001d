"""What a recomputation runs in backward: a block's forward up to the last tensor it saves for backward.

[Note: the recomputation stops at the last saved tensor]
Non-reentrant ``torch.utils.checkpoint`` (the executor's, ``lightning_osdp/apply/recompute.py``) does not run the
whole forward again in backward. Its recomputation counts the tensors the forward saved for backward and stops as
soon as it has recomputed the last of them (torch's "early stop", the default since torch 2.1; its pack hook raises
``_StopRecomputationError``). An operator's autograd kernel saves its inputs before the operator runs and its outputs
after, so what the recomputation runs is the forward's operators before the last save. In a transformer block the
last tensors saved are the inputs of its last projection (the MLP's down projection), which is then not run again,
nor the residual add after it: in a Llama block, about a quarter of the block's matmul FLOPs. Under selective
recomputation the same stop cuts the replay's tail (there a kept product's output is served from the cache anyway:
what is cut is the elementwise work after the last save).

The profiler measures the replay as torch runs it: one forward of the block counts the tensors it saves
(:func:`count_saves`, a ``saved_tensors_hooks`` pack hook), and the replay runs the forward again under a pack hook
that stops it at that count (:func:`until_last_save`): timed on the device in measured mode, its operators recorded
for the rates in the estimated modes (the stop raises inside the forward, so the operators after it never reach the
recorder). A user who turns the stop off (``torch.utils.checkpoint.set_checkpoint_early_stop(False)``) runs the
whole forward again, which the profile then undercounts by that tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_osdp.profiling.timing import timed_section
from lightning_osdp.profiling.tracer import ComputeKernel, OpTally, _OpRecorder

__all__ = ["count_saves", "replay_ops", "time_full_replay", "until_last_save"]


class _LastSave(Exception):
    """Raised by the replay's pack hook at the forward's last saved tensor (see [Note: the recomputation stops at
    the last saved tensor])."""


def _pack(t: Tensor) -> None:
    # Nothing of the tensor is kept: a replay's graph never runs backward, and a saved output kept by the hook would
    # hold its own ``grad_fn`` (a reference cycle that lives until the next garbage collection, which the profiler's
    # timed sections disable: one block's activations, above the budget, in the tests' setup peaks).
    return None


def _unpack(_: None) -> Tensor:
    raise RuntimeError("a replay's graph is for counting and timing only: it never runs backward")


class OpsTally:
    """What :class:`~lightning_osdp.profiling.tracer._OpRecorder` reports to: one :class:`OpTally`."""

    def __init__(self) -> None:
        self.ops = OpTally()
        self._unsized = 0

    def _record_op(self, flops: int, traffic: int, kernel: ComputeKernel | None = None, **_: Any) -> None:
        self.ops.count(flops, traffic, kernel)


def count_saves(forward: Callable[..., Any], args: Any, kwargs: Any) -> int:
    """How many tensors ``forward(*args, **kwargs)`` saves for backward, run with gradients enabled."""
    count = 0

    def pack(t: Tensor) -> None:
        nonlocal count
        count += 1
        return _pack(t)

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        forward(*args, **kwargs)
    return count


@contextmanager
def until_last_save(saves: int) -> Iterator[None]:
    """Stop the forward run inside at its ``saves``-th saved tensor, as torch's recomputation does (see [Note: the
    recomputation stops at the last saved tensor]); the block of ``with`` then ends without an error."""
    seen = 0

    def pack(t: Tensor) -> None:
        nonlocal seen
        seen += 1
        if seen >= saves:
            raise _LastSave
        return _pack(t)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
    except _LastSave:
        pass


def time_full_replay(
    forward: Callable[..., Any], arguments: Callable[[], tuple[Any, Any]], clock: Callable[[], float], saves: int
) -> float:
    """One figure of the seconds full recomputation runs ``forward`` again in backward: up to its ``saves``-th saved
    tensor, with gradients enabled, on ``arguments()`` (made before the clock starts)."""
    if saves == 0:
        return 0.0  # nothing was saved, so nothing is unpacked: torch never recomputes it
    args, kwargs = arguments()
    with torch.enable_grad(), timed_section():
        start = clock()
        with until_last_save(saves):
            forward(*args, **kwargs)
        return clock() - start


def replay_ops(forward: Callable[..., Any], args: Any, kwargs: Any, saves: int) -> OpTally:
    """The operators full recomputation runs of ``forward`` (fake tensors): up to its ``saves``-th saved tensor."""
    tally = OpsTally()
    if saves:
        with torch.enable_grad(), _OpRecorder(tally), until_last_save(saves):  # type: ignore[arg-type]
            forward(*args, **kwargs)
    return tally.ops
