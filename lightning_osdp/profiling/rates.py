"""How fast this device computes, per kind of operator: the conversion from FLOPs and bytes to seconds.

The estimated mode never runs the model for real; it counts each operator's FLOPs or bytes (see ``tracer``) and
converts them with rates measured here by a short real benchmark on the target device:

* compute-bound operators (those with a FLOP formula: matmuls, convolutions, attention): ``alpha + flops / R``,
  fitted on square ``mm`` of a few sizes in the model's floating dtype;
* memory-bound operators (everything else: elementwise, normalisation, reductions, copies):
  ``alpha + bytes / B``, fitted on ``add`` over a few sizes (bytes = two inputs and one output).

Both are timed the way a training step calls them (inputs that require grad, a fresh output), so ``alpha`` holds
the per-operator cost of eager execution, which dominates small models on a CPU.

The benchmark takes a few tenths of a second and is cached per (device, dtype, thread count) for the process.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from lightning_osdp.profiling.fit import fit_latency_throughput
from lightning_osdp.profiling.timing import device_clock, no_gc
from lightning_osdp.profiling.tracer import OpTally

__all__ = ["DeviceRates", "measure_copy_bandwidth", "measure_device_rates"]

_MATMUL_SIZES = (32, 128, 384, 768)
_ELEMENTWISE_SIZES = (1 << 10, 1 << 18, 1 << 21, 1 << 23)
_CACHE: dict[tuple[Any, ...], DeviceRates] = {}
_COPY_CACHE: dict[tuple[str, int, int], float] = {}


@dataclass(frozen=True)
class DeviceRates:
    """Measured speeds of one device for one dtype (see the module docstring)."""

    device: str
    dtype: str
    matmul_op_seconds: float
    matmul_flops_per_second: float
    memory_op_seconds: float
    memory_bytes_per_second: float

    def seconds(self, tally: OpTally) -> float:
        """Estimated time of the operators in ``tally``."""
        return (
            tally.matmul_ops * self.matmul_op_seconds
            + tally.matmul_flops / self.matmul_flops_per_second
            + tally.memory_ops * self.memory_op_seconds
            + tally.memory_bytes / self.memory_bytes_per_second
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    clock = device_clock(device)
    fn()
    times = []
    with no_gc():
        for _ in range(repeats):
            start = clock()
            fn()
            times.append(clock() - start)
    return statistics.median(times)


def _within(sizes: tuple[int, ...], nbytes: Callable[[int], int], max_bytes: int | None) -> tuple[int, ...]:
    """The sizes whose buffers take at most ``max_bytes`` (the two smallest whatever: a fit needs two points)."""
    if max_bytes is None:
        return sizes
    return tuple(n for i, n in enumerate(sizes) if i < 2 or nbytes(n) <= max_bytes)


def measure_device_rates(
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    repeats: int = 5,
    max_bytes: int | None = None,
) -> DeviceRates:
    """Benchmark ``device`` (default CPU) for ``dtype``; cached for the process (see the module docstring).
    ``max_bytes`` bounds the benchmark's buffers (a strategy's setup stays within its memory budget)."""
    device = torch.device(device or "cpu")
    size = torch.tensor([], dtype=dtype).element_size()
    matmul_sizes = _within(_MATMUL_SIZES, lambda n: 3 * n * n * max(size, 4), max_bytes)
    elementwise_sizes = _within(_ELEMENTWISE_SIZES, lambda n: 3 * n * size, max_bytes)
    key = (str(device), str(dtype), torch.get_num_threads(), matmul_sizes, elementwise_sizes)
    if key in _CACHE:
        return _CACHE[key]
    # Inputs that require grad and fresh outputs: each call pays what an operator of a training step pays
    # (autograd recording, allocation), which is most of the cost of small operators on a CPU.
    matmul: list[tuple[float, float]] = []
    for n in matmul_sizes:
        a = torch.randn(n, n, device=device).to(dtype).requires_grad_()
        b = torch.randn(n, n, device=device).to(dtype)
        matmul.append((2.0 * n**3, _timed(partial(torch.mm, a, b), device, repeats)))
    memory: list[tuple[float, float]] = []
    for n in elementwise_sizes:
        x = torch.ones(n, device=device, dtype=dtype).requires_grad_()
        y = torch.ones(n, device=device, dtype=dtype)
        memory.append((3.0 * n * x.element_size(), _timed(partial(torch.add, x, y), device, repeats)))
    mm_alpha, mm_rate = fit_latency_throughput(matmul)
    mem_alpha, mem_rate = fit_latency_throughput(memory)
    rates = DeviceRates(str(device), str(dtype).removeprefix("torch."), mm_alpha, mm_rate, mem_alpha, mem_rate)
    _CACHE[key] = rates
    return rates


def measure_copy_bandwidth(
    device: torch.device | str | None = None, nbytes: int = 16 << 20, *, repeats: int = 5
) -> float:
    """Bytes per second ``Tensor.copy_`` moves on ``device``, fitted on copies of ``nbytes / 4`` and ``nbytes``.

    The rate of the copies FSDP2 makes around its collectives (all-gather copy-in and copy-out, reduce-scatter
    copy-in), which the cost model charges per unit: ``nbytes`` should be of the order of the model's parameter
    bytes (a copy that fits in a cache runs several times faster than one that does not). Cached per size.
    """
    device = torch.device(device or "cpu")
    key = (str(device), torch.get_num_threads(), nbytes)
    if key not in _COPY_CACHE:
        samples = []
        for size in (max(nbytes // 4, 1), nbytes):
            source = torch.ones(size, dtype=torch.uint8, device=device)
            target = torch.empty_like(source)
            samples.append((float(size), _timed(partial(target.copy_, source), device, repeats)))
        _COPY_CACHE[key] = fit_latency_throughput(samples)[1]
    return _COPY_CACHE[key]
