"""Per-device memory budgets: parsing ``"6GiB"``-style strings and finding a device's capacity."""

from __future__ import annotations

import math
import numbers
import os
import re
from fractions import Fraction

import torch

__all__ = [
    "CUDA_RESERVE_BYTES",
    "MAX_MEMORY_BUDGET",
    "MIN_MEMORY_BUDGET",
    "check_memory_budget",
    "device_memory_capacity",
    "format_bytes",
    "parse_memory_budget",
]

#: Held back from a CUDA device's total memory when no budget is given: the CUDA context, NCCL's buffers and
#: allocator fragmentation live outside what the cost model counts.
CUDA_RESERVE_BYTES = 2 * 1024**3

# [Note: how a budget is spelled]
# One rule, for Python, YAML and the command line alike: a number of bytes (a whole number, in any notation: 4000000000,
# 4e9, "4e9"), or a number and a unit. Units are spelled exactly as below: SI prefixes are powers of 1000, as on a GPU's
# data sheet ("80GB"), IEC prefixes powers of 1024 ("6GiB"). Spellings that read two ways are refused, naming these: a
# single letter ("8g": 8e9 or 2^33?), a lowercase "b" ("8Gb" is gigabits where it is not gigabytes), "KB" (1000 in SI,
# 1024 in JEDEC).
_UNITS = {
    "": 1,
    "B": 1,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "PiB": 2**50,
}
_PATTERN = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([a-zA-Z]*)\s*$")
_ACCEPTED = (
    "bytes (a whole number, such as 4000000000 or 4e9) or a number with a unit: B, kB, MB, GB, TB, PB (powers of "
    "1000) or KiB, MiB, GiB, TiB, PiB (powers of 1024), such as '512MiB', '6GiB' or '80GB'"
)
#: The smallest budget a run accepts, one 4 KiB page: below it a budget is a typo, a unit left out ("1B" for "1GB",
#: "1000" for "1000MB"). Not higher: small models do train in a few dozen KiB (the test suite's GAN under 40 KiB).
#: Whether the budget can hold the model at all is checked in setup against its parameters, before profiling.
MIN_MEMORY_BUDGET = 2**12
#: The largest: 1 EiB, more than any device has (above it, a budget is a typo or a units mix-up).
MAX_MEMORY_BUDGET = 2**60


def parse_memory_budget(value: float | str) -> int:
    """Bytes from a number, or from a string such as ``"512MiB"``, ``"6GiB"``, ``"8GB"``, ``"1.5 GiB"`` or ``"4e9"``
    (see [Note: how a budget is spelled]: ``KiB/MiB/GiB/TiB/PiB`` are powers of 1024, ``kB/MB/GB/TB/PB`` powers of
    1000; ``"8g"``, ``"8Gb"`` and ``"8KB"`` are refused as ambiguous).

    A number, or a string without a unit or in ``B``, counts bytes and must be whole (``4e9`` is accepted, ``0.5`` is
    not); with a larger unit, a fraction of a byte is dropped (``"1.0001 KiB"`` is 1,024 bytes). The result is at
    least one byte: ``"0.1B"``, ``0``, NaN, infinities, negative values and ``True``/``False`` raise
    :class:`ValueError`. Whether the amount is a sensible budget is :func:`check_memory_budget`'s question.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(f"memory budget must be {_ACCEPTED}, got {value!r}")
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None:
            raise ValueError(f"cannot parse memory budget {value!r}: use {_ACCEPTED}")
        unit = match.group(2)
        if unit not in _UNITS:
            raise ValueError(f"cannot parse memory budget {value!r}: {_unit_hint(unit)}; use {_ACCEPTED}")
        # Exact decimal arithmetic: "1.5 TiB" must not round through a float.
        amount, scale = Fraction(match.group(1)), _UNITS[unit]
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


def _unit_hint(unit: str) -> str:
    """Why ``unit`` is not accepted, with the spellings it may have meant."""
    prefix = unit.lower().removesuffix("b").removesuffix("i")
    meant = " or ".join(
        repr(name) for name in _UNITS if name and name.lower().removesuffix("b").removesuffix("i") == prefix
    )
    if len(unit) == 1 and unit.upper() in "KMGTP":
        return f"the unit {unit!r} is ambiguous (a power of 1000 or of 1024?): write {meant}"
    if unit.endswith("b") and unit.lower() != "b":
        return f"the unit {unit!r} reads as bits ('b'); for bytes write {meant}"
    if unit == "KB":
        return "the unit 'KB' is 1000 bytes in SI and 1024 in JEDEC: write 'kB' (1000) or 'KiB' (1024)"
    if meant:
        return f"the unit {unit!r} is not spelled as accepted: write {meant}"
    return f"unknown unit {unit!r}"


def check_memory_budget(value: float | str) -> int:
    """A per-device budget a run can use: :func:`parse_memory_budget`'s bytes, between :data:`MIN_MEMORY_BUDGET`
    (4 KiB) and :data:`MAX_MEMORY_BUDGET` (1 EiB). ``OSDPStrategy(memory_budget=...)`` (from Python or YAML) and
    ``osdp plan --memory`` check theirs with it, when they are given, before anything runs.

    Raises:
        ValueError: the value cannot be read, or is outside those bounds (the message says which, and the spelling
            of what was probably meant).
    """
    size = parse_memory_budget(value)
    if size < MIN_MEMORY_BUDGET:
        raise ValueError(
            f"memory budget {value!r} is {format_bytes(size)}, less than the {format_bytes(MIN_MEMORY_BUDGET)} "
            "a run accepts: was a unit left out or mistyped ('1GB', '6GiB')? The budget is per device, in "
            "bytes or with a unit"
        )
    if size > MAX_MEMORY_BUDGET:
        raise ValueError(
            f"memory budget {value!r} is {size:.3g} bytes, more than {format_bytes(MAX_MEMORY_BUDGET)}, which no "
            "device has: give the memory of one device, in bytes or with a unit ('80GB', '6GiB')"
        )
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


def card_bytes(device: torch.device | None) -> int | None:
    """The memory of ``device`` when it is a GPU: the card a plan's device total must fit beside its budget (see
    ``PlannerOptions.plan``'s [Note: the plan within the card]); ``None`` elsewhere (on CPU the budget is the
    process's memory, which nothing outside the cost model's count shares with a card)."""
    if device is None or device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


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
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} EiB"
