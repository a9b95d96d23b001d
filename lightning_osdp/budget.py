"""Per-device memory budgets: parsing ``"6GiB"``-style strings and finding a device's capacity."""

from __future__ import annotations

import math
import numbers
import os
import re
from fractions import Fraction

import torch

__all__ = ["CUDA_RESERVE_BYTES", "device_memory_capacity", "format_bytes", "parse_memory_budget"]

#: Held back from a CUDA device's total memory when no budget is given: the CUDA context, NCCL's buffers and
#: allocator fragmentation live outside what the cost model counts.
CUDA_RESERVE_BYTES = 2 * 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_PATTERN = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-zA-Z]*)\s*$")
_ACCEPTED = "bytes (a whole number >= 1) or a string with a unit, such as '512MiB', '6GiB' or '8GB'"


def parse_memory_budget(value: float | str) -> int:
    """Bytes from a number, or from a string such as ``"512MiB"``, ``"6GiB"``, ``"8GB"`` or ``"1.5 GiB"``.

    ``KiB/MiB/GiB/TiB`` are powers of 1024, ``kB/MB/GB/TB`` powers of 1000 (as on a GPU's data sheet). A number, or
    a string without a unit or in ``B``, counts bytes and must be whole (``4e9`` is accepted, ``0.5`` is not); with
    a larger unit, a fraction of a byte is dropped (``"1.0001 KiB"`` is 1,024 bytes). The result is at least one
    byte: ``"0.1B"``, ``0``, NaN, infinities, negative values and ``True``/``False`` raise :class:`ValueError`.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(f"memory budget must be {_ACCEPTED}, got {value!r}")
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse memory budget {value!r}: use {_ACCEPTED}")
        # Exact decimal arithmetic: "1.5 TiB" must not round through a float.
        amount, scale = Fraction(match.group(1)), _UNITS[match.group(2).lower()]
    elif not math.isfinite(value):
        raise ValueError(f"memory budget must be a positive, finite amount, got {value!r}")
    else:
        amount, scale = Fraction(value), 1
    if amount <= 0:
        raise ValueError(f"memory budget must be positive, got {value!r}")
    if scale == 1 and amount.denominator != 1:
        raise ValueError(f"memory budget {value!r} is a fraction of a byte: a count of bytes must be whole")
    size = int(amount * scale)
    if size < 1:
        raise ValueError(f"memory budget {value!r} is less than one byte")
    return size


def device_memory_capacity(device: torch.device, local_world_size: int = 1) -> int:
    """What one process may use when the user sets no budget.

    CUDA: the device's total memory less :data:`CUDA_RESERVE_BYTES`. CPU: the memory available now (Linux
    ``MemAvailable``), shared evenly among the ``local_world_size`` processes of this machine.
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return max(total - CUDA_RESERVE_BYTES, 0)
    return _available_ram() // max(local_world_size, 1)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def format_bytes(n: float) -> str:
    """``1.50 GiB``-style rendering."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
