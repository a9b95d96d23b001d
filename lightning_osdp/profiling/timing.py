"""How profiling reads time: a clock that waits for the device, and what a timed section runs without.

[Note: what a timed section runs without]
Garbage collection: a collection of a large heap takes as long as a small step (``timeit`` disables it too). And the
Python dispatch modes its caller runs under: on the CPU a strategy measures its setup's peak memory with
:class:`~lightning_osdp.memory.LiveStorageTracker`, a dispatch mode through which every operator then runs in Python,
and profiling runs inside that setup. Timed under it, a small model's step takes several times as long, and every
time the profile holds (the modules', the blocks', the rates' per-operator cost, the collectives') would carry the
tracker's Python. The timed repetitions allocate what the step traced before them did, under the tracker, so its
peak still holds them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from lightning_osdp._compat import disable_current_modes

__all__ = ["device_clock", "timed_section"]


def device_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter``, after ``torch.cuda.synchronize`` on CUDA so that an interval holds its kernels."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


@contextmanager
def timed_section() -> Iterator[None]:
    """Run a timed section without garbage collection or the caller's Python dispatch modes (see [Note: what a timed
    section runs without])."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with disable_current_modes():
            yield
    finally:
        if enabled:
            gc.enable()
