"""Measured peak memory of a training step, per rank.

CUDA: the caching allocator's own figure, ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` at the start of the step.

CPU has no allocator statistics, so :class:`LiveStorageTracker` counts it: the bytes of every live tensor
storage on the device, where *live* means

* present when tracking starts and reachable from the objects handed to :meth:`LiveStorageTracker.start`
  (the model's parameters, their gradients and buffers, the optimizer's state), or
* created by any ATen operator while tracking is on (seen through a ``TorchDispatchMode``; DTensors are counted
  by their local shard); a *view* operator creates no storage, and a view of a storage not counted so far is of
  memory that was there before tracking started (a batch's sample sliced from a dataset held as one tensor, which on
  CUDA would not even be on the device): it is not counted,

until the storage is garbage collected (a weak reference callback) or resized (FSDP2 frees and re-allocates
gathered parameters with ``UntypedStorage.resize_``, which the dispatcher does not see, so it is patched while
tracking: ``lightning_osdp._compat.storage_resize_hook``). Not counted: memory held by a communication
backend outside tensors (gloo's staging buffers), by the Python interpreter, or by tensors created outside
ATen (``numpy`` arrays). The figure is what a CUDA allocator would report as allocated, without its rounding.

:meth:`LiveStorageTracker.mark` cuts the tracked time into windows: the live bytes at an instant, and the largest
live bytes since the previous mark. :class:`AllocatorMeter` gives the same on CUDA from the allocator's statistics;
:func:`memory_meter` picks one for a device (profiling measures the loss's memory with it, see
``lightning_osdp/profiling/loss_region.py``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from typing import Any, Protocol

import torch

from lightning_osdp._compat import TorchDispatchMode, is_fake, storage_resize_hook, tree_leaves

__all__ = [
    "FREED_BLOCK_THRESHOLD",
    "AllocatorMeter",
    "LiveStorageTracker",
    "MemoryMeter",
    "memory_meter",
    "return_freed_blocks",
    "return_freed_blocks_on",
    "tensors_of",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensors_of(objects: Iterable[Any]) -> list[torch.Tensor]:
    """Tensors reachable from modules (parameters, gradients, buffers), optimizers (state) and tensors."""
    found: list[torch.Tensor] = []
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                found.append(p)
                if p.grad is not None:
                    found.append(p.grad)
            found.extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                found.extend(v for v in tree_leaves(state) if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            found.append(obj)
        else:
            found.extend(v for v in tree_leaves(obj) if isinstance(v, torch.Tensor))
    return found


class LiveStorageTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages on one device type (see the module docstring)."""

    def __init__(self, device_type: str = "cpu", *, count_fake: bool = True) -> None:
        super().__init__()
        self.device_type = device_type
        #: Whether fake tensors count (the estimated profile's meter: their sizes are what it measures); a tracker of
        #: real memory around a profile leaves them out.
        self.count_fake = count_fake
        self.live = 0
        self.peak = 0
        self._window_peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._resize_hook = ExitStack()

    # ---------------------------------------------------------------- public
    def start(self, *roots: Any) -> LiveStorageTracker:
        """Count what ``roots`` hold now, then track every allocation until :meth:`stop`."""
        self.live = self.peak = self._window_peak = 0
        self._sizes.clear()
        self._refs.clear()
        for t in tensors_of(roots):
            self._track(_local(t))
        self.peak = self._window_peak = self.live
        self._resize_hook.enter_context(storage_resize_hook(self._on_resize))
        self.__enter__()
        return self

    def stop(self) -> int:
        """Stop tracking; return the peak in bytes."""
        self.__exit__(None, None, None)
        self._resize_hook.close()
        return self.peak

    def mark(self) -> tuple[int, int]:
        """``(largest live bytes since the previous mark or the start, live bytes now)``; a new window starts."""
        window, self._window_peak = self._window_peak, self.live
        return window, self.live

    # ---------------------------------------------------------------- internals
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        view = bool(getattr(func, "is_view", False))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(_local(t), view=view)
        return out

    def _track(self, t: torch.Tensor, *, view: bool = False) -> None:
        if t.device.type != self.device_type or t.is_meta or (not self.count_fake and is_fake(t)):
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if view and not self._tracked(storage):
            return  # a view of memory from before tracking (see the module docstring)
        self._track_storage(storage)

    def _tracked(self, storage: torch.UntypedStorage) -> bool:
        ref = self._refs.get(id(storage))
        return ref is not None and ref() is storage

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
        """Start counting ``storage``, or account for a change of its size since it was last seen."""
        key = id(storage)
        ref = self._refs.get(key)
        size = storage.nbytes()
        if ref is not None and ref() is storage:
            self._add(size - self._sizes[key])
            self._sizes[key] = size
            return
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, functools.partial(self._on_collected, key))
        self._add(size)

    def _on_collected(self, key: int, _ref: weakref.ref[torch.UntypedStorage]) -> None:
        self._free(key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _add(self, delta: int) -> None:
        self.live += delta
        if self.live > self._window_peak:
            self._window_peak = self.live
            if self.live > self.peak:
                self.peak = self.live

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type == self.device_type:
            self._track_storage(storage)


class MemoryMeter(Protocol):
    """Live bytes on a device at marked instants, and the largest between marks (see the module docstring)."""

    def start(self, *roots: Any) -> MemoryMeter: ...

    def mark(self) -> tuple[int, int]: ...

    def stop(self) -> int: ...


class AllocatorMeter:
    """:class:`MemoryMeter` of a CUDA device from its caching allocator's statistics (``memory_allocated``, and
    ``max_memory_allocated`` since the last ``reset_peak_memory_stats``): what the run's own measurement reads.
    ``roots`` are not needed: the allocator counts every tensor of the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    def start(self, *roots: Any) -> AllocatorMeter:
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = int(torch.cuda.memory_allocated(self.device))
        return self

    def mark(self) -> tuple[int, int]:
        window = int(torch.cuda.max_memory_allocated(self.device))
        live = int(torch.cuda.memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = max(self.peak, window)
        return window, live

    def stop(self) -> int:
        return max(self.peak, self.mark()[0])


def memory_meter(device: torch.device, *, fake: bool = False) -> MemoryMeter:
    """The meter for ``device``: the allocator's statistics on CUDA, else (CPU, or fake tensors, whose storages
    have sizes but no memory) a :class:`LiveStorageTracker`."""
    if device.type == "cuda" and not fake:
        return AllocatorMeter(device)
    return LiveStorageTracker(device.type)


#: Blocks freed at or above this size go back to the system at once (see :func:`return_freed_blocks`).
FREED_BLOCK_THRESHOLD = 128 << 10
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def return_freed_blocks(threshold: int = FREED_BLOCK_THRESHOLD) -> bool:
    """Make glibc's allocator give freed blocks of ``threshold`` bytes and more back to the system; ``True`` when
    it was done (Linux with glibc, and neither ``MALLOC_MMAP_THRESHOLD_`` nor ``MALLOC_TRIM_THRESHOLD_`` set).

    [Note: resident memory on CPU]
    On CPU the memory budget is the process's: tensors live in glibc's heap. By default glibc raises its mmap
    threshold each time a large block is freed (up to 32 MiB on 64-bit), so later blocks of that size come from the
    heap, and a freed block in the middle of the heap stays resident until everything above it is freed too. A
    sharded step frees and allocates the same large blocks over and over (gathered parameters, gradients, their
    communication buffers), and the process's peak resident memory (``VmHWM``) grows far past its live tensors: a
    49M-parameter GPT under a 563 MiB budget on 2 CPU ranks held 556 MiB of tensors at its peak and 955-1,034 MiB
    resident beyond a tiny model's. With a fixed threshold of 128 KiB (``mallopt``'s ``M_MMAP_THRESHOLD``, which also
    stops the raising, and ``M_TRIM_THRESHOLD``) every block that size or larger is its own mapping, unmapped when
    freed, and resident memory follows the live tensors (566-572 MiB there; ``docs/benchmarks.md``, which also
    compares the step times: the cost is a page fault per page of each new large block). A user who set either
    variable decided otherwise, and is left alone.

    The strategies set it when they learn their devices (the Trainer's or Fabric's construction), not at setup: a
    block freed before then (an import, building the data or the model) has already raised the threshold, and blocks
    then taken from the heap and freed leave holes in it that stay resident (``docs/benchmarks.md`` measures it).
    """
    import ctypes
    import os
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))


def return_freed_blocks_on(devices: Sequence[torch.device] | None) -> bool:
    """:func:`return_freed_blocks` when a strategy's ``devices`` are CPUs (its memory budget is then the process's);
    ``True`` when it was done."""
    return devices is not None and len(devices) > 0 and devices[0].type == "cpu" and return_freed_blocks()
