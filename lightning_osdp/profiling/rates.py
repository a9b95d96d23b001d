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

[Note: rates by shape]
A flat FLOP rate charges a narrow projection like a square one. Rates that say so (a dry run's built-in figures,
``cli/hardware.py``) price each compute-bound operator by its shape instead (the tracer keeps them one by one,
``ComputeKernel``):

* a matrix product on the roofline of its arithmetic intensity (Williams, Waterman and Patterson, "Roofline", CACM
  2009): ``max(flops / R, bytes / B)``, where ``R`` is the largest rate the device reaches on large products (a
  measured maximum, not the data sheet's peak) and ``B`` its memory rate: a product that cannot reuse its operands
  enough is bound by its bytes;
* a fused attention kernel at the rate its published benchmark reports for its key length, head size and
  causality (``attention_flops_per_second``: points interpolated in log2 of the key length and clamped at the ends),
  on the same roofline.

The measured rates of this module have none of these (``matmul_roofline`` false, no attention points): their fit on
square products already holds this device's behaviour, and the figures they produce stay as they were.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from lightning_osdp.profiling.fit import fit_latency_throughput
from lightning_osdp.profiling.timing import device_clock, timed_section
from lightning_osdp.profiling.tracer import ComputeKernel, OpTally

__all__ = ["DeviceRates", "measure_copy_bandwidth", "measure_device_rates"]

_MATMUL_SIZES = (32, 128, 384, 768)
_ELEMENTWISE_SIZES = (1 << 10, 1 << 18, 1 << 21, 1 << 23)
_CACHE: dict[tuple[Any, ...], DeviceRates] = {}
_COPY_CACHE: dict[tuple[str, int, int], float] = {}


#: One published point of a fused attention kernel's rate: (causal, head size, key length, FLOP/s), the FLOPs counted
#: as the tracer counts them (causal attention at its real work).
AttentionRate = tuple[bool, int, int, float]


@dataclass(frozen=True)
class DeviceRates:
    """Speeds of one device for one dtype: measured here (see the module docstring), or a target's built-in figures.

    Attributes:
        device, dtype: what they are of.
        matmul_op_seconds: per-operator cost of a compute-bound operator (launch and tail).
        matmul_flops_per_second: the matrix-product rate (with ``matmul_roofline``, the ceiling of large products).
        memory_op_seconds: per-operator cost of a memory-bound operator.
        memory_bytes_per_second: the memory rate of memory-bound operators (and the roofline's slope).
        matmul_roofline: price each compute-bound operator on the roofline of its own shape (see [Note: rates by
            shape]); false: every one at ``matmul_flops_per_second``.
        attention_flops_per_second: published rates of the device's fused attention kernel (see
            :data:`AttentionRate`); empty: attention at the matrix-product rate.
        collective_compute_share: the share of the device's compute that a collective's kernels occupy while they
            run beside compute (their thread blocks hold that many of the multiprocessors; see
            ``cost_model/config.py`` [Note: the target's figures]); 0: none, or not known.
    """

    device: str
    dtype: str
    matmul_op_seconds: float
    matmul_flops_per_second: float
    memory_op_seconds: float
    memory_bytes_per_second: float
    matmul_roofline: bool = False
    attention_flops_per_second: tuple[AttentionRate, ...] = ()
    collective_compute_share: float = 0.0

    def __post_init__(self) -> None:
        # From JSON the points come back as lists.
        points = tuple((bool(c), int(d), int(n), float(r)) for c, d, n, r in self.attention_flops_per_second)
        object.__setattr__(self, "attention_flops_per_second", points)

    def seconds(self, tally: OpTally) -> float:
        """Estimated time of the operators in ``tally``."""
        memory = tally.memory_ops * self.memory_op_seconds + tally.memory_bytes / self.memory_bytes_per_second
        if not tally.kernels or not (self.matmul_roofline or self.attention_flops_per_second):
            matmuls = tally.matmul_ops * self.matmul_op_seconds + tally.matmul_flops / self.matmul_flops_per_second
            return matmuls + memory
        ops, flops, seconds = 0, 0, 0.0
        for kernel, count in tally.kernels.items():
            ops += count
            flops += kernel.flops * count
            seconds += count * (self.matmul_op_seconds + self.kernel_seconds(kernel))
        # A tally's totals beyond its kernels (one made by hand) at the flat rate.
        rest = max(tally.matmul_ops - ops, 0) * self.matmul_op_seconds
        rest += max(tally.matmul_flops - flops, 0) / self.matmul_flops_per_second
        return seconds + rest + memory

    def kernel_seconds(self, kernel: ComputeKernel) -> float:
        """One compute-bound operator's time beyond its per-operator cost (see [Note: rates by shape])."""
        rate = self.matmul_flops_per_second
        if kernel.kind == "attention" and self.attention_flops_per_second:
            rate = self.attention_rate(kernel.seq_len, kernel.head_dim, kernel.causal)
        compute = kernel.flops / rate
        if not self.matmul_roofline:
            return compute
        return max(compute, kernel.bytes / self.memory_bytes_per_second)

    def attention_rate(self, seq_len: int, head_dim: int, causal: bool) -> float:
        """The fused attention kernel's rate at ``seq_len`` keys of ``head_dim``, from the published points of the
        same causality (any, if none is) and the nearest head size, interpolated in log2 of the key length."""
        points = [p for p in self.attention_flops_per_second if p[0] == causal] or list(self.attention_flops_per_second)
        if not points:
            return self.matmul_flops_per_second
        dim = min({p[1] for p in points}, key=lambda d: (abs(d - head_dim), -d))
        curve = sorted((n, r) for _, d, n, r in points if d == dim)
        x = math.log2(max(seq_len, 1))
        if x <= math.log2(curve[0][0]):
            return curve[0][1]
        for (n0, r0), (n1, r1) in itertools.pairwise(curve):
            x0, x1 = math.log2(n0), math.log2(n1)
            if x <= x1:
                return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        return curve[-1][1]

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON takes them; the shape model's only when set, so that a file of measured rates is the
        same as before it existed."""
        data = asdict(self)
        for name in _SHAPE_MODEL_FIELDS:
            if not data[name]:  # false, no points, a share of 0: the defaults
                del data[name]
        return data


_SHAPE_MODEL_FIELDS = ("matmul_roofline", "attention_flops_per_second", "collective_compute_share")


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    clock = device_clock(device)
    fn()
    times = []
    with timed_section():
        for _ in range(repeats):
            start = clock()
            fn()
            times.append(clock() - start)
    return statistics.median(times)


def _within(sizes: tuple[int, ...], nbytes: Callable[[int], int], max_bytes: int | None) -> tuple[int, ...]:
    """The sizes whose buffers take at most ``max_bytes``; when fewer than two do (a fit needs two points), halvings
    of the smallest that do."""
    if max_bytes is None:
        return sizes
    fitting = [n for n in sizes if nbytes(n) <= max_bytes]
    smaller = sizes[0] // 2
    while len(fitting) < 2 and smaller >= 8:
        if nbytes(smaller) <= max_bytes:
            fitting.insert(0, smaller)
        smaller //= 2
    return tuple(fitting) if len(fitting) >= 2 else sizes[:2]


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
