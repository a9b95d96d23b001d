"""The few machine constants of the cost model that a profile does not carry, and how they are resolved."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_osdp.comm import releases_all_gather_after_forward
from lightning_osdp.profiling.model_profile import ModelProfile

__all__ = ["CostModelConfig", "ResolvedConfig"]

# [Note: calibration]
# Defaults measured on the development machine (2 x86 cores shared by two ranks, torch 2.13 CPU, gloo, fp32), from
# FSDP2 runs of the example GPT (torch.profiler) and micro-benchmarks:
# * FSDP2's copies around collectives (foreach copy-in, split_with_sizes copy-out, chunk_cat) cost ~0.6 ms per
#   step for each 1 MiB unit under fully_shard on one rank (3-4 MiB copied): ~3 GB/s. (A profile's
#   ``copy_bytes_per_second``, measured on small cache-hot buffers, is several times faster: not used.)
# * One FSDP2 unit costs ~0.35 ms of hooks per step on CPU, plus ~85 us per parameter tensor (views and DTensor
#   wrappers made in every forward and backward): units of 1 or 8 Linear(8, 8) layers under fully_shard or
#   replicate on one rank cost +0.5-0.65 ms and +1.6-1.9 ms each.
# * Parameters are DTensors under FSDP2: a single-tensor AdamW step pays ~0.15 ms of DTensor dispatch per
#   parameter tensor over the plain-tensor step the profile measures.
# * A blocking collective in training costs ~1-3 ms more than the same call in the benchmark that fitted it: there
#   the ranks enter together, in training the faster rank waits for the slower one (FSDP2's all-gather and
#   reduce-scatter ranges in torch.profiler traces run 1-3 ms over the fit; end-to-end, 2 ms per call fits the
#   all-no_shard, all-shard_grad_op and all-full_shard step times, which have 5, 10 and 15 calls).
# * Lightning's loop around a step (closure, hooks, `zero_grad`, the optimizer wrapper) costs ~0.5 ms of host time
#   per micro-batch, each value the step logs ~0.4 ms more, and one logged with `sync_dist=True` ~0.6 ms more beside
#   its all-reduce (priced by the profile's fit): a `Linear(4, 4)` under Lightning's DDP on 2 ranks, 200 steps, CPU
#   time of the steps against the same step run bare, with 0 and 3 values logged each way. The profile runs the
#   step outside Lightning and counts those calls instead (`ModelProfile.step_calls`). An earlier constant of 12 ms
#   had been fitted on steps timed under the memory tracker (`lightning_osdp/step_monitor.py` [Note: timed
#   steps]), whose Python per operator it mostly was.
# * Without a measured optimizer step: single-tensor AdamW at ~2.2 s per GB of parameters.
#
# [Note: the target's figures]
# A profile of another device (``osdp plan``, or a strategy's run on GPUs) is predicted with that device's figures,
# never with the constants above, which are this development CPU's. On CUDA (and any device that is not the CPU):
# * Copies run at the profile's ``copy_bytes_per_second``: a dry run's is the target's DRAM bandwidth less its
#   efficiency factor, halved (a copy reads and writes every byte; ``cli/hardware.py``); a run on the device measured
#   it (``profiling/rates.py``). The CPU's 3 GB/s default was measured for FSDP2's copies on 2 shared CPU cores.
# * FSDP2 copies a unit's shards into the all-gather input on its all-gather stream and the unsharded gradients
#   into the reduce-scatter input on its reduce-scatter stream (``_fsdp_param_group.py``: ``all_gather_copy_in_stream``,
#   ``reduce_scatter_stream``); only the all-gather copy-out runs on the compute stream (``wait_for_unshard``). So on
#   CUDA only the copy-out is charged in full; the side-stream copies hide, with the collectives, behind compute
#   (``overlap``). DDP copies each gradient into its bucket in its autograd hook, on the compute stream: charged in
#   full. (It does so every step, bucket views or not: Lightning's ``zero_grad`` sets gradients to ``None``, and the
#   reducer copies whenever a gradient is not already a view of its bucket; ``reducer.cpp``,
#   ``mark_variable_ready_dense``.)
# * The constants per unit, per parameter tensor and per optimizer tensor measure Python on the host (hooks, views,
#   DTensor dispatch). CUDA kernels are asynchronous: the host enqueues work and runs ahead, so host work costs the
#   step only where it takes longer than the device work it overlaps (``host_overlap``: a unit's hooks against its
#   modules' compute, its optimizer dispatch against its optimizer kernels). The same constants are kept (a server
#   CPU is not slower than the development machine's shared core), so a model small enough to be host-bound still
#   pays them.
# * Collectives are enqueued on NCCL's streams: no wait is charged per call (``collective_sync_seconds`` 0).
# * Hiding a collective behind compute is not free: NCCL's kernels run one thread block per channel, each holding a
#   multiprocessor for the collective's whole duration, so the compute they overlap runs on the rest of the device.
#   Over a collective of ``t`` seconds hidden behind compute, that compute loses ``t * share`` seconds of work, with
#   ``share`` the channels over the multiprocessors (``collective_compute_share``: 16 of the H100's 132 for Hopper,
#   8 for Ampere, torch's estimator's channel counts; ``cli/hardware.py``). This is the slowdown's floor: measured on
#   4 A100/H100, compute overlapped with communication ran 18.9% slower on average and up to 40% (
#   "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114),
#   which adds the memory bandwidth the collectives take and the extra wave a GEMM launched on fewer free
#   multiprocessors can need (a GEMM of exactly 132 blocks beside a 24-block all-gather took almost twice as long:
#   NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance Degradation because of Tail
#   Effect"). Not modelled: those depend on the kernels' shapes and launch order. A profile that does not know the
#   share (a measured one, for now) charges none.
# * The training loop around the step: 5 ms (not measured on CUDA; the loop is the same Python as on CPU, and the
#   collectives behind ``sync_dist`` are NCCL's microsecond all-reduces).
_DEFAULT_COPY_BYTES_PER_SECOND = 3e9
_OPTIMIZER_SECONDS_PER_BYTE = {"Adam": 2.2e-9, "AdamW": 2.2e-9, "SGD": 0.8e-9}
_OPTIMIZER_TEMPORARIES = {"Adam": 2.0, "AdamW": 2.0, "SGD": 0.0}
_CPU_COLLECTIVE_SYNC_SECONDS = 2e-3
# A device-to-device copy on a GPU whose profile records no copy bandwidth: half of an A100's 2 TB/s, less 20%.
_DEFAULT_DEVICE_COPY_BYTES_PER_SECOND = 0.8e12
# DDP's `bucket_cap_mb` default (25 MiB); its first bucket is smaller (1 MiB), which the model ignores.
_DDP_BUCKET_BYTES = 25 * 2**20
_CPU_LOOP_SECONDS = 0.5e-3
_CPU_LOG_SECONDS = 0.4e-3
_CPU_SYNC_SECONDS = 0.6e-3
# A CPU profile without counted calls (an earlier version's): the loop with two values logged, one synced.
_CPU_FRAMEWORK_SECONDS = _CPU_LOOP_SECONDS + 2 * _CPU_LOG_SECONDS + _CPU_SYNC_SECONDS
# NOTE: not measured on CUDA; Lightning's loop is the same Python, the collectives behind `sync_dist` are faster.
_CUDA_FRAMEWORK_SECONDS = 5e-3


@dataclass(frozen=True)
class CostModelConfig:
    """Constants of the time and memory model; ``None`` means "from the profile, else a default".

    Args:
        overlap: fraction of a unit's own compute time that can hide its collectives. ``None``: 0 on CPU (gloo
            collectives block the calling thread, and FSDP2's streams are no-ops there, so nothing overlaps) and
            1 on CUDA (all-gathers and reduce-scatters run on their own streams).
        copy_bytes_per_second: memory-copy bandwidth of FSDP2's own copies (all-gather copy-in/out,
            reduce-scatter copy-in) and of DDP's gradient copy into its buckets. ``None``: 3 GB/s on CPU (see
            [Note: calibration]); elsewhere the profile's ``copy_bytes_per_second`` (see [Note: the target's
            figures]).
        optimizer_seconds_per_byte: optimizer-step time per byte of local trainable parameters (default: the
            profile's ``optimizer_step_seconds`` over its trainable bytes).
        optimizer_seconds_per_tensor: extra optimizer-step host time per parameter tensor: FSDP2's parameters are
            DTensors, and every optimizer op on one goes through DTensor dispatch.
        collective_sync_seconds: extra time of each blocking collective in training over the fitted time (the
            ranks do not enter a collective together). ``None``: 2 ms on CPU, 0 on CUDA (where collectives are
            asynchronous and overlap).
        unit_overhead_seconds: fixed host time of one FSDP2 unit per step (its four hooks and their Python work).
        tensor_overhead_seconds: host time per parameter tensor of a unit per step (FSDP2 rebuilds views and DTensor
            wrappers of every parameter and gradient).
        host_overlap: fraction of a unit's device work that hides its host work (hooks against its modules'
            compute, optimizer dispatch against its optimizer kernels). ``None``: 0 on CPU (host and device are
            the same cores) and 1 on CUDA (kernels run asynchronously; see [Note: the target's figures]).
        framework_seconds: per-step time of the training loop around the profiled step (Lightning's closure and
            hooks, logging with ``sync_dist``). ``None``: ``profile.framework_seconds`` when measured, else on CPU
            the loop and the step's counted calls (:func:`loop_seconds`), else 5 ms on CUDA.
        split_overhead_seconds: extra cost per additional slice of a split Linear (a matmul call forward and
            backward, and its slice's hooks beyond ``unit_overhead_seconds``).
        optimizer_temporaries: temporaries of the optimizer step, as multiples of the largest local parameter
            (single-tensor Adam allocates ``sqrt(v)`` and its quotient: 2).
        ddp_bucket_bytes: DDP's bucket size: ``no_shard`` gradients are all-reduced in calls of this many bytes,
            so each call's latency is shared by the units whose gradients fill it.
        release_all_gather_after_forward: whether a sharded unit's forward all-gather buffer is freed when its
            forward ends (the executor does so on CPU, ``lightning_osdp/comm.py``) rather than when the next FSDP2
            unit gathers. ``None``: as the executor does on the profile's device.
        collective_compute_share: the share of the device's compute a collective's kernels hold while compute hides
            it (see [Note: the target's figures]). ``None``: 0 on CPU (nothing overlaps), else the profile's rates'
            (``DeviceRates.collective_compute_share``; 0 when it has none).
    """

    overlap: float | None = None
    copy_bytes_per_second: float | None = None
    optimizer_seconds_per_byte: float | None = None
    optimizer_seconds_per_tensor: float = 1.5e-4
    collective_sync_seconds: float | None = None
    unit_overhead_seconds: float = 3.5e-4
    tensor_overhead_seconds: float = 8.5e-5
    framework_seconds: float | None = None
    split_overhead_seconds: float = 1e-4
    optimizer_temporaries: float | None = None
    ddp_bucket_bytes: int = _DDP_BUCKET_BYTES
    release_all_gather_after_forward: bool | None = None
    host_overlap: float | None = None
    collective_compute_share: float | None = None

    def resolve(self, profile: ModelProfile) -> ResolvedConfig:
        """Fill the ``None`` fields from ``profile`` (device, optimizer type, measured figures)."""
        on_cpu = profile.device.split(":")[0].startswith("cpu")
        overlap = self.overlap
        if overlap is None:
            overlap = 0.0 if on_cpu else 1.0
        sync = self.collective_sync_seconds
        if sync is None:
            sync = _CPU_COLLECTIVE_SYNC_SECONDS if on_cpu else 0.0
        copy_rate = self.copy_bytes_per_second
        if copy_rate is None:
            copy_rate = _DEFAULT_COPY_BYTES_PER_SECOND if on_cpu else _device_copy_rate(profile)
        host_overlap = self.host_overlap
        if host_overlap is None:
            host_overlap = 0.0 if on_cpu else 1.0
        share = self.collective_compute_share
        if share is None:
            share = 0.0 if on_cpu or profile.rates is None else profile.rates.collective_compute_share
        trainable = sum(m.trainable_param_bytes for m in profile.modules.values())
        # The profile's step overhead was measured with the optimizer stepping every parameter on one device; the
        # optimizer's share is modelled per unit (it shrinks with sharding), so it is taken out of the constant.
        measured_optimizer = float(profile.optimizer_step_seconds)
        opt_rate = self.optimizer_seconds_per_byte
        if opt_rate is None and measured_optimizer > 0 and trainable > 0:
            opt_rate = measured_optimizer / trainable
        if opt_rate is None:
            opt_rate = _OPTIMIZER_SECONDS_PER_BYTE.get(profile.optimizer, 0.0)
        temporaries = self.optimizer_temporaries
        if temporaries is None:
            temporaries = _OPTIMIZER_TEMPORARIES.get(profile.optimizer, 0.0)
        # The loss and the rest of the step outside modules run once per micro-batch, the optimizer step once.
        constant = max(profile.step_overhead_seconds - measured_optimizer, 0.0) * max(profile.gradient_accumulation, 1)
        framework = self.framework_seconds
        if framework is None:
            framework = profile.framework_seconds
        if framework is None:
            framework = loop_seconds(profile) if on_cpu else _CUDA_FRAMEWORK_SECONDS
        return ResolvedConfig(
            overlap=float(overlap),
            copy_bytes_per_second=float(copy_rate),
            optimizer_seconds_per_byte=float(opt_rate),
            optimizer_seconds_per_tensor=self.optimizer_seconds_per_tensor,
            collective_sync_seconds=float(sync),
            unit_overhead_seconds=self.unit_overhead_seconds,
            tensor_overhead_seconds=self.tensor_overhead_seconds,
            split_overhead_seconds=self.split_overhead_seconds,
            optimizer_temporaries=float(temporaries),
            step_overhead_seconds=constant + framework,
            host_overlap=float(host_overlap),
            collective_compute_share=float(share),
            param_itemsize=_itemsize(profile, "param_dtype"),
            reduce_itemsize=_itemsize(profile, "reduce_dtype"),
            ddp_bucket_bytes=self.ddp_bucket_bytes,
            release_all_gather_after_forward=(
                releases_all_gather_after_forward("cpu" if on_cpu else "cuda")
                if self.release_all_gather_after_forward is None
                else self.release_all_gather_after_forward
            ),
        )


def loop_seconds(profile: ModelProfile) -> float:
    """Host time per optimizer step of Lightning's loop around a profiled CPU step: the loop itself and the values
    the step logs, per micro-batch, and the collectives ``sync_dist`` and ``self.all_gather`` make (their fits,
    within a node). See [Note: calibration]."""
    calls = profile.step_calls
    if calls is None:
        return _CPU_FRAMEWORK_SECONDS
    seconds = _CPU_LOOP_SECONDS + calls.logged * _CPU_LOG_SECONDS + calls.synced * _CPU_SYNC_SECONDS
    reduce, gather = profile.collectives.get("all_reduce"), profile.collectives.get("all_gather")
    if reduce is not None:
        seconds += calls.synced * reduce.seconds(4)
    if gather is not None:
        seconds += calls.gathered * gather.seconds(4 * profile.world_size)
    return seconds * max(profile.gradient_accumulation, 1)


@dataclass(frozen=True)
class ResolvedConfig:
    """:class:`CostModelConfig` with every figure known (see there); ``step_overhead_seconds`` is the profile's
    per-step time outside modules, less the optimizer step (modelled per unit), plus the framework's."""

    overlap: float
    copy_bytes_per_second: float
    optimizer_seconds_per_byte: float
    optimizer_seconds_per_tensor: float
    collective_sync_seconds: float
    unit_overhead_seconds: float
    tensor_overhead_seconds: float
    split_overhead_seconds: float
    optimizer_temporaries: float
    step_overhead_seconds: float
    ddp_bucket_bytes: int
    release_all_gather_after_forward: bool
    host_overlap: float = 0.0
    collective_compute_share: float = 0.0
    #: bytes per element that sharded units gather and compute in, and reduce in, under the profile's
    #: mixed-precision policy (``None``: the parameters' own; see ``units.py`` [Note: bytes per dtype under FSDP2's
    #: mixed precision])
    param_itemsize: int | None = None
    reduce_itemsize: int | None = None


def _itemsize(profile: ModelProfile, key: str) -> int | None:
    name = (profile.mixed_precision or {}).get(key)
    if not name:
        return None
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the profile's mixed_precision names an unknown dtype {key}={name!r}")
    return dtype.itemsize


def _device_copy_rate(profile: ModelProfile) -> float:
    """The copy bandwidth of a profile of a device other than the CPU (see [Note: the target's figures])."""
    if profile.copy_bytes_per_second:
        return float(profile.copy_bytes_per_second)
    if profile.rates is not None:
        return profile.rates.memory_bytes_per_second / 2
    return _DEFAULT_DEVICE_COPY_BYTES_PER_SECOND
