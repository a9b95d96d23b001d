"""How profiling reads time: a clock that waits for the device, and no garbage collection while timing."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["device_clock", "no_gc"]


def device_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter``, after ``torch.cuda.synchronize`` on CUDA so that an interval holds its kernels."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


@contextmanager
def no_gc() -> Iterator[None]:
    """No garbage collection inside (as ``timeit``): a collection of a large heap takes as long as a small step."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
