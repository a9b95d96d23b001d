"""Hardware figures for a dry run: how fast a GPU computes and how fast its interconnect runs each collective.

``osdp plan`` profiles the model on fake tensors (no GPU, no memory) and converts each operator's FLOPs and bytes
into seconds with a :class:`~lightning_osdp.profiling.DeviceRates`; the plan's collectives cost
``alpha + bytes / beta`` per call (:class:`~lightning_osdp.profiling.CollectiveFit`). On a real cluster both are
measured. Here they come from a built-in :class:`Hardware` entry, or from a saved profile
(:func:`hardware_from_file`).

[Note: these are approximations]
The built-in figures are published measurements where there are some (the largest matmul rate a GPU reaches,
FlashAttention-2's benchmarks, NCCL's own latency model, a published sweep of ring bandwidth over node counts; see
[Note: achieved rates] and [Note: the collective model]), else vendors' data-sheet peaks times round efficiency
factors, and collective bandwidths of the order that public ``nccl-tests`` runs report. They are inputs, stated
here so that anyone can check or change them; they are not measurements of any particular machine, and a real
cluster can differ by tens of percent (clocks, power limits, PCIe topology, NCCL version and settings). A
prediction made from them answers "does it fit, and roughly how fast, and which strategy wins", not "how many
milliseconds". Memory predictions do not depend on them at all: bytes come from the traced step. To plan for a
real machine, run once on it (the strategy saves ``osdp_plan.profile.json``) and pass that file with
``--hardware-profile``.

[Note: the collective model]
NCCL runs large all-gathers, reduce-scatters and all-reduces as rings. With ``S`` the full buffer (the gathered
output, the reduce-scatter input, the all-reduce buffer, as in ``CollectiveFit``) and ``N`` ranks, a ring moves
``(N - 1) / N * S`` bytes per rank for all-gather and reduce-scatter and twice that for all-reduce
(``nccl-tests``' PERFORMANCE.md calls ``S / t`` times that factor the *bus bandwidth*, the figure that is about
constant in ``N``). So with ``busbw`` the link's bus bandwidth::

    all_gather, reduce_scatter:  t = base + (N - 1) * hop     + (N - 1) / N * S / busbw
    all_reduce:                  t = base + 2 * (N - 1) * hop + 2 * (N - 1) / N * S / busbw

The latencies are NCCL's own model of its ring with the Simple protocol, the one of the large messages a step
sends (``src/graph/tuning.cc``, ``ncclTunerConstantsDefaults`` and ``ncclTopoTuneModel``; torch's
``torch/_inductor/comm_analysis.py`` carries the same constants): ``base`` 8.4 us, a step over NVLink 3.4 us, over
PCIe 5.7 us, over the network 14 us; on several nodes a ring of ``N`` ranks over ``k`` nodes takes ``k - 1`` network
steps and ``N - k`` steps within nodes (``lightning_osdp/cost_model/network.py``). NCCL's tree and NVLS algorithms
beat the ring for all-reduce at some sizes and scales: this model is conservative there. All-gather and
reduce-scatter have no tree (``tuning.cc`` allows them ring, PAT for one GPU per node, NVLS and CollNet).

[Note: the ring at scale]
The bus bandwidth of a ring across nodes is not constant in the number of nodes in practice: on an H100 cluster,
reduce-scatter's bus bandwidth was measured at 360, 345, 320, 300, 280 and 260 GB/s on 4, 8, 16, 32, 64 and 128
nodes (NVIDIA/nccl issue #1229, "question of Reduce-scatter", 2024-03). The node's network figure below is that of
a few nodes (the built-in NDR InfiniBand, 360 GB/s, is the 4-node point); across more nodes it is scaled by the
measured ratio (:func:`ring_scaling`: linear in log2 of the nodes between the points, 1 up to 4 nodes, the last
slope beyond 128), for every network and every ring collective (the sweep is of reduce-scatter; all-gather runs the
same ring the other way).

[Note: the network between nodes]
On several nodes the figures come in two levels, as a profile measures them (``lightning_osdp/cost_model/network.py``):
ring fits within a node over ``intra``, and ring fits across nodes for one rank per node, at that rank's share of the
node's network (the network's bus bandwidth over the ranks sharing its NICs: one NIC per GPU in a DGX, one for the
whole node in a cloud PCIe server). The cost model prices every other group from the two: the world's ring at the
node's whole network (or its NVLink/PCIe if slower), ``hybrid_shard``'s all-reduce across nodes at one rank's share.
The built-in networks (:data:`NETWORKS`) are line rates of the network cards a server ships with, times the share of
it NCCL's large collectives reach (~90% over InfiniBand's RDMA, ~70% over TCP sockets); ``--network`` picks one for
any ``--hardware``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_osdp.cli.errors import CLIError

if TYPE_CHECKING:
    from lightning_osdp.cli.output import Output
    from lightning_osdp.profiling import CollectiveFit, DeviceRates
    from lightning_osdp.topology import Topology

# NOTE: the `osdp` parser lists HARDWARE's names, and it imports no torch (cli/parsers.py): this module imports
# lightning_osdp.profiling (torch) inside the functions that build figures, not here.

__all__ = [
    "ATTENTION_KERNEL_SPEED",
    "HARDWARE",
    "NETWORKS",
    "Hardware",
    "HardwareFigures",
    "Link",
    "get_hardware",
    "get_network",
    "hardware_from_file",
    "ring_collectives",
    "ring_scaling",
    "run",
]

GB = 1e9
TFLOPS = 1e12

# --------------------------------------------------------------------------------------- efficiency assumptions
# [Note: achieved rates]
# A dry run prices each matmul and attention kernel by its shape (``profiling/rates.py`` [Note: rates by shape]):
# * the matmul ceiling is the GPU's *Maximum Achievable Matmul FLOPS* where it is published (stas00/ml-engineering,
#   compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table", BF16, mean of 100 iterations
#   of the best of a sweep of large shapes: H100 SXM 794.5 TFLOPS "H200 is the same", A100 SXM 271.2), below it on
#   the roofline of each product's bytes at the memory rate. A GPU without a published figure keeps the data sheet's
#   peak times MATMUL_EFFICIENCY_HALF, an assumption (labelled so in ``osdp hardware``);
# * fused attention runs at the rate FlashAttention-2's benchmark publishes for the GPU, forward and backward
#   together, by causality, head size and sequence length (Dao-AILab/flash-attention README, "Performance":
#   assets/flash2_h100_fwd_bwd_benchmark.png, H100 80GB SXM5, and flash2_a100_fwd_bwd_benchmark.png, A100 80GB SXM4;
#   hidden 2048, batch 16k / seqlen, FLOPs counted as ``4 * batch * seqlen**2 * heads * headdim``, halved when causal,
#   backward 2.5 times forward: the tracer's count). torch's SDPA flash kernel is FlashAttention-2's. A GPU without a
#   published chart takes the nearest one's share of its peak (Ada and GA102 parts A100's, H200 H100's);
# * FP32 (PyTorch's default without TF32) keeps MATMUL_EFFICIENCY_FP32 of the data sheet: nothing is published for
#   it, and the fused attention kernels take no FP32 (SDPA runs the memory-efficient kernel), at the matmul rate.
# [Note: a training step is not a microbenchmark]
# Both ceilings above are microbenchmarks: one kernel at a time, on a cool GPU, the best of a sweep of shapes. A
# training step runs thousands of kernels back to back at sustained power, beside NCCL's kernels and the allocator,
# on the shapes the model has, and the published eager-mode runs of docs/benchmarks.md ("Calibration against published
# runs") sit below a prediction made at the ceilings. So a dry run charges matmuls and attention at
# TRAINING_MATMUL_EFFICIENCY of their published ceilings: one constant per GPU generation (a generation's share
# depends on its ceiling, its clocks under sustained power and the kernels the stacks have for it, which no
# first-principles figure gives), for all shapes, not a fit per run. Calibrated on the published eager-mode runs of
# ``benchmarks/published_runs.json`` (``benchmarks/calibration.py`` picks, per generation, the value whose mean
# absolute log error of throughput is least, each source one vote: its [Note: one vote per source]) and checked
# leave-one-source-out (each source predicted with the values calibrated without it). The sources' own values differ
# with their stacks (on Hopper a 2023 one reaches a smaller share than the 2024 and 2026 ones); the constant is the
# one nearest to all of them. It applies where the ceiling is a published measurement; the round 70% of a
# data-sheet peak below already stands for a training rate.
TRAINING_MATMUL_EFFICIENCY: dict[str, float] = {"hopper": 0.825, "ampere": 0.850}
# [Note: attention kernels other than FlashAttention-2]
# The attention points above are FlashAttention-2's (torch's SDPA flash kernel). A run on another kernel is charged at
# that kernel's published speed relative to it, forward and backward together, weighted by the tracer's FLOPs
# (backward 2.5 times forward). The FlashAttention-2 paper (Dao, arXiv 2307.08691, section 4.1, A100 80GB) measures
# FlashAttention-2 "around 1.3-1.5x faster than FlashAttention in Triton in the forward pass and around 2x faster in
# the backward pass": the Triton kernel (flash-attn's ``flash_attn_triton.py``, which llm-foundry's
# ``attn_impl: triton`` copies) takes (1.4 + 2.5 x 2) / 3.5 = 1.83 times as long, so runs at 0.547 of the rate. The
# paper measures Ampere only; the same ratio is assumed on Hopper (neither kernel uses Hopper's wgmma instructions).
# cuDNN's fused attention is the kernel torch's SDPA runs first on Hopper once its bundled cuDNN is recent enough
# (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` ``check_prefer_cudnn_attention``: sm90 and sm100). The
# FlashAttention-3 paper (Shah et al., arXiv 2407.08608, figures 5 and 6, H100 80GB SXM5, BF16, head dimension 128,
# sequence 4k) measures it beside FlashAttention-2: forward with the causal mask 518 against 319 TFLOPS, backward
# 499 against 310, so (1 + 2.5) / (319 / 518 + 2.5 x 310 / 499) = 1.61 times FlashAttention-2's rate. Measured on
# Hopper (whose asynchronous tensor-core instructions the kernel uses) and to be used there only.
ATTENTION_KERNEL_SPEED: dict[str, float] = {
    "flash-attention-2": 1.0,
    "flash-attention-triton": 3.5 / (1.4 + 2.5 * 2.0),
    "cudnn": 3.5 / (319 / 518 + 2.5 * 310 / 499),
}
# NOTE: round factors applied to data-sheet peaks that have no measurement. Large transformer GEMMs reach 70-85% of
# the dense tensor-core peak in cuBLAS; the smaller matmuls of a step (attention, narrow projections) less, so 0.7.
MATMUL_EFFICIENCY_HALF = 0.7
# FP32 (non-tensor-core, PyTorch's default: TF32 is off unless torch.set_float32_matmul_precision("high")):
# SGEMM runs nearer its peak on data-centre parts, further on GeForce parts whose peak counts dual-issue FP32.
MATMUL_EFFICIENCY_FP32 = 0.7
# Elementwise and normalisation kernels stream at 80-90% of the DRAM bandwidth when large.
MEMORY_EFFICIENCY = 0.8
# Per-kernel cost of a GPU operator in an eager training step (launch and tail), seconds. A matmul's is a little
# larger (cuBLAS heuristics, workspace); both are small next to the kernels of a billion-parameter model.
MATMUL_OP_SECONDS = 6e-6
MEMORY_OP_SECONDS = 4e-6
# Fixed cost of one NCCL collective call: NCCL's base latency of its ring with the Simple protocol
# (src/graph/tuning.cc, ncclTunerConstantsDefaults.baseLatencies[Ring][Simple] = 8.4 us).
COLLECTIVE_LAUNCH_SECONDS = 8.4e-6
# Latency of one ring step, Simple protocol (ncclTunerConstantsDefaults.hwLatencies[hw][Ring][Simple]).
NCCL_NVLINK_STEP_SECONDS = 3.4e-6
NCCL_PCIE_STEP_SECONDS = 5.7e-6
NCCL_NET_STEP_SECONDS = 14e-6
# The ring's bus bandwidth across nodes, relative to a few nodes (see [Note: the ring at scale]): reduce-scatter on an
# H100 cluster, GB/s by nodes (NVIDIA/nccl issue #1229).
RING_BUS_BANDWIDTH_BY_NODES: tuple[tuple[int, float], ...] = (
    (4, 360.0),
    (8, 345.0),
    (16, 320.0),
    (32, 300.0),
    (64, 280.0),
    (128, 260.0),
)
# The thread blocks a collective holds while it runs beside compute: NCCL runs one per channel, and torch's estimator
# takes 16 channels for Hopper, 8 for Ampere and any other GPU (torch/_inductor/comm_analysis.py, _GPU_NCHANNELS:
# "These approximate standard DGX/HGX topologies"). See cost_model/config.py [Note: the target's figures].
NCCL_CHANNELS = {"hopper": 16, "ampere": 8}


@dataclass(frozen=True)
class Link:
    """An interconnect as the collective model (see [Note: the collective model]) sees it.

    Attributes:
        name: what it is, for the report.
        bus_bytes_per_second: NCCL bus bandwidth of large collectives over it (bytes/s, ``nccl-tests`` busbw); for a
            network between nodes, the whole node's (all its NICs).
        hop_seconds: latency of one ring step over it.
        nics: network cards per node it counts (between nodes: a rank sends through its own card when there are as
            many as ranks, else the ranks share them; see [Note: the network between nodes]).
        source: where the figure comes from.
    """

    name: str
    bus_bytes_per_second: float
    hop_seconds: float
    nics: int = 1
    source: str = ""

    def rank_share(self, ranks_per_node: int) -> Link:
        """The link as one of ``ranks_per_node`` ranks that all send across nodes at once sees it."""
        used = min(self.nics, ranks_per_node)
        bus = self.bus_bytes_per_second * used / self.nics / ranks_per_node
        return Link(f"{self.name}, one rank's share of {ranks_per_node}", bus, self.hop_seconds, 1, self.source)

    def across(self, nodes: int) -> Link:
        """The link as a ring over ``nodes`` nodes sees it: its bus bandwidth scaled by :func:`ring_scaling`."""
        factor = ring_scaling(nodes)
        if factor == 1.0:
            return self
        name = f"{self.name}, x{factor:.2f} over {nodes} nodes"
        return Link(name, self.bus_bytes_per_second * factor, self.hop_seconds, self.nics, self.source)


def ring_scaling(nodes: int) -> float:
    """The bus bandwidth of a ring over ``nodes`` nodes relative to one over 4 or fewer (see [Note: the ring at
    scale]): interpolated linearly in log2 of the nodes between the measured points, the last slope beyond them."""
    points = RING_BUS_BANDWIDTH_BY_NODES
    first = points[0][1]
    if nodes <= points[0][0]:
        return 1.0
    x = math.log2(nodes)
    for (n0, b0), (n1, b1) in itertools.pairwise(points):
        if nodes <= n1:
            return (b0 + (b1 - b0) * (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0))) / first
    (n0, b0), (n1, b1) = points[-2], points[-1]
    slope = (b1 - b0) / (math.log2(n1) - math.log2(n0))
    return max(b1 + slope * (x - math.log2(n1)), 0.1 * first) / first


# Bus bandwidths are of the order public nccl-tests results report for 8 GPUs (all_reduce busbw, large messages),
# rounded down; ring-step latencies are NCCL's (see [Note: the collective model]).
NVLINK3_NVSWITCH = Link("NVLink 3 + NVSwitch (600 GB/s bidirectional per GPU)", 200 * GB, NCCL_NVLINK_STEP_SECONDS)
NVLINK4_NVSWITCH = Link("NVLink 4 + NVSwitch (900 GB/s bidirectional per GPU)", 360 * GB, NCCL_NVLINK_STEP_SECONDS)
# GeForce RTX 4090: no peer-to-peer; NCCL stages every transfer through host memory over PCIe 4.0 x16.
PCIE4_NO_P2P = Link("PCIe 4.0 x16 without peer-to-peer, through host memory", 8 * GB, NCCL_PCIE_STEP_SECONDS)
# Data-centre PCIe cards (L4, A10G) in 8-GPU cloud servers: PCIe 4.0 x16 through switches, across two sockets.
PCIE4 = Link("PCIe 4.0 x16", 10 * GB, NCCL_PCIE_STEP_SECONDS)
# Multi-node rings cross the network once per node; the node's bus bandwidth is then about its aggregate network
# bandwidth: 8 x 200 Gb/s HDR InfiniBand (DGX A100) = 200 GB/s, 8 x 400 Gb/s NDR (DGX H100) = 400 GB/s, ~90% used.
INFINIBAND_8X_HDR = Link(
    "8 x 200 Gb/s HDR InfiniBand per node",
    180 * GB,
    NCCL_NET_STEP_SECONDS,
    nics=8,
    source="NVIDIA DGX A100 user guide: 8 single-port ConnectX-6 HDR 200 Gb/s for the compute fabric (25 GB/s "
    "each); 90% of the line rate",
)
INFINIBAND_8X_NDR = Link(
    "8 x 400 Gb/s NDR InfiniBand per node",
    360 * GB,
    NCCL_NET_STEP_SECONDS,
    nics=8,
    source="NVIDIA DGX BasePOD reference architecture (DGX H100/H200): 8 single-port ConnectX-7 at 400 Gb/s "
    "(50 GB/s each); 90% of the line rate",
)
# One 200 Gb/s HCA per node: smaller clusters, and many cloud instances.
INFINIBAND_1X_HDR = Link(
    "1 x 200 Gb/s HDR InfiniBand per node",
    22.5 * GB,
    NCCL_NET_STEP_SECONDS,
    nics=1,
    source="one ConnectX-6 HDR card at 200 Gb/s (25 GB/s) shared by the node's GPUs; 90% of the line rate",
)
# Meta's Grand Teton hosts (torchtitan's H100 figures): a 400 Gb/s RDMA (RoCE) network per GPU, the same bandwidth.
ROCE_8X_400G = Link(
    "8 x 400 Gb/s RDMA (RoCE) per node",
    360 * GB,
    NCCL_NET_STEP_SECONDS,
    nics=8,
    source="torchtitan's H100 runs on Meta's Grand Teton hosts: 8 x 400 Gb/s RoCE NICs per node (50 GB/s each); 90% "
    "of the line rate",
)
# Cloud PCIe servers (AWS g5/g6.48xlarge) have one 100 Gb/s network; NCCL over TCP sockets uses part of it.
ETHERNET_100G = Link(
    "100 Gb/s Ethernet (NCCL over sockets)",
    9 * GB,
    30e-6,
    nics=1,
    source="AWS EC2 G5 and G6 instance pages: 100 Gbps networking on the 48xlarge sizes (12.5 GB/s); ~70% of it "
    "over NCCL's TCP sockets; a ring step of 30 us, about twice NCCL's 14 us network step for TCP (an assumption)",
)

#: The built-in networks between nodes, by ``osdp plan --network`` name.
NETWORKS: dict[str, Link] = {
    "ib-ndr-8x": INFINIBAND_8X_NDR,
    "ib-hdr-8x": INFINIBAND_8X_HDR,
    "ib-hdr-1x": INFINIBAND_1X_HDR,
    "eth-100g": ETHERNET_100G,
}


@dataclass(frozen=True)
class Hardware:
    """One kind of GPU server: data-sheet figures of its GPU and its interconnects.

    Attributes:
        name: the ``--hardware`` name.
        gpu: the GPU's full name.
        memory_bytes: device memory.
        half_flops: dense BF16/FP16 tensor-core peak with FP32 accumulation (what PyTorch uses), FLOP/s.
        fp32_flops: FP32 (non-tensor-core) peak, FLOP/s.
        memory_bytes_per_second: DRAM bandwidth.
        gpus_per_node: GPUs one node holds and joins by ``intra``.
        intra: the link between GPUs of one node.
        inter: the link between nodes (``None``: a single machine).
        source: where the GPU figures come from.
        achieved_half_flops: the largest BF16 matmul rate measured on the GPU (``None``: none is published; the data
            sheet's peak times ``MATMUL_EFFICIENCY_HALF`` is used; see [Note: achieved rates]).
        attention: FlashAttention-2's published forward-and-backward rates on the GPU in half precision, as
            :data:`~lightning_osdp.profiling.rates.AttentionRate` points (empty: attention at the matmul rate).
        achieved_source: where ``achieved_half_flops`` and ``attention`` come from.
        multiprocessors: the GPU's streaming multiprocessors (0: unknown).
        generation: ``"hopper"``, ``"ampere"`` (Ampere and Ada), for the collectives' channel count
            (:data:`NCCL_CHANNELS`).
    """

    name: str
    gpu: str
    memory_bytes: int
    half_flops: float
    fp32_flops: float
    memory_bytes_per_second: float
    gpus_per_node: int
    intra: Link
    inter: Link | None
    source: str
    achieved_half_flops: float | None = None
    attention: tuple[tuple[bool, int, int, float], ...] = ()
    achieved_source: str = ""
    multiprocessors: int = 0
    generation: str = "ampere"

    @property
    def collective_compute_share(self) -> float:
        """The share of the GPU's multiprocessors a collective's thread blocks hold (NCCL: one per channel)."""
        if not self.multiprocessors:
            return 0.0
        return min(NCCL_CHANNELS.get(self.generation, NCCL_CHANNELS["ampere"]) / self.multiprocessors, 1.0)

    def figures(
        self,
        world_size: int,
        precision: str,
        *,
        nodes: int | None = None,
        network: Link | None = None,
        training_efficiency: float | None = None,
        memory_efficiency: float = MEMORY_EFFICIENCY,
        attention_kernel: str = "flash-attention-2",
    ) -> HardwareFigures:
        """Rates and collective fits of ``world_size`` of these GPUs training at ``precision``, on ``nodes`` nodes
        (default: as few as hold them) joined by ``network`` (default: the entry's own, ``inter``); matmuls and
        attention at ``training_efficiency`` of their published ceilings (default: the generation's
        :data:`TRAINING_MATMUL_EFFICIENCY`; see [Note: a training step is not a microbenchmark]), attention on
        ``attention_kernel`` (:data:`ATTENTION_KERNEL_SPEED`), and memory-bound operators at ``memory_efficiency`` of
        the DRAM bandwidth."""
        if training_efficiency is None:
            training_efficiency = TRAINING_MATMUL_EFFICIENCY[self.generation]
        if attention_kernel not in ATTENTION_KERNEL_SPEED:
            raise CLIError(f"unknown attention kernel {attention_kernel!r}; known: {', '.join(ATTENTION_KERNEL_SPEED)}")
        kernel_speed = ATTENTION_KERNEL_SPEED[attention_kernel]
        for name, value in (("training_efficiency", training_efficiency), ("memory_efficiency", memory_efficiency)):
            if not 0.0 < value <= 1.0:
                raise CLIError(f"{name} must be in (0, 1], got {value}")
        from lightning_osdp.profiling import DeviceRates

        if world_size < 1:
            raise CLIError(f"world size must be at least 1, got {world_size}")
        nodes = nodes or math.ceil(world_size / self.gpus_per_node)
        per_node = world_size // nodes
        if world_size % nodes or per_node > self.gpus_per_node:
            raise CLIError(
                f"hardware {self.name!r} has {self.gpus_per_node} GPUs per node: {world_size} GPUs on {nodes} nodes "
                "is not a whole number of them per node; give --nodes N --gpus-per-node G"
            )
        inter = network or self.inter
        if nodes > 1 and inter is None:
            raise CLIError(
                f"hardware {self.name!r} is one machine of {self.gpus_per_node} GPUs; world size {world_size} needs "
                f"{nodes} machines and no network is described for it: give --network NAME (known: "
                f"{', '.join(NETWORKS)}), or --hardware-profile with measured figures"
            )
        half = precision.startswith(("bf16", "16"))
        if half and self.achieved_half_flops:
            flops = self.achieved_half_flops * training_efficiency
            attention = tuple((c, d, n, r * training_efficiency * kernel_speed) for c, d, n, r in self.attention)
        elif half:
            flops = self.half_flops * MATMUL_EFFICIENCY_HALF
            attention = tuple((c, d, n, r * kernel_speed) for c, d, n, r in self.attention)
        else:
            flops, attention = self.fp32_flops * MATMUL_EFFICIENCY_FP32, ()
        bandwidth = self.memory_bytes_per_second * memory_efficiency
        rates = DeviceRates(
            device=f"cuda ({self.gpu})",
            dtype="bfloat16" if half else "float32",
            matmul_op_seconds=MATMUL_OP_SECONDS,
            matmul_flops_per_second=flops,
            memory_op_seconds=MEMORY_OP_SECONDS,
            memory_bytes_per_second=bandwidth,
            matmul_roofline=True,
            attention_flops_per_second=attention,
            collective_compute_share=self.collective_compute_share,
        )
        where = self.intra.name
        across = None
        if nodes > 1 and inter is not None:
            where = f"{nodes} nodes of {per_node}: {self.intra.name}; between nodes {inter.name}"
            across = inter.across(nodes)
        if half:
            measured = (
                f"{training_efficiency:.1%} of the measured maximum"
                if self.achieved_half_flops
                else f"{MATMUL_EFFICIENCY_HALF:.0%} of the peak"
            )
            matmul_note = f"matmuls up to {flops / TFLOPS:,.1f} TFLOPS ({measured})"
        else:
            matmul_note = f"matmuls up to {flops / TFLOPS:,.1f} TFLOPS ({MATMUL_EFFICIENCY_FP32:.0%} of the FP32 peak)"
        notes = [
            f"{matmul_note} on the roofline of their bytes at {bandwidth / GB:,.0f} GB/s; attention "
            + (f"on {attention_kernel} ({kernel_speed:.3f} of FlashAttention-2's rate) " if kernel_speed != 1 else "")
            + (
                f"at FlashAttention-2's published rates{' times the same share' if self.achieved_half_flops else ''} "
                f"({_attention_summary(attention)})"
                if attention
                else "at the matmul rate"
            )
            + (f"; {self.achieved_source}" if half and self.achieved_source else ""),
            f"within a node: {self.intra.name}, bus bandwidth {self.intra.bus_bytes_per_second / GB:,.0f} GB/s, ring "
            f"step {self.intra.hop_seconds * 1e6:.1f} us, {COLLECTIVE_LAUNCH_SECONDS * 1e6:.1f} us per call (NCCL's "
            "ring latency model, Simple protocol)",
        ]
        if across is not None and inter is not None:
            notes.append(
                f"between nodes: {inter.name}, bus bandwidth {inter.bus_bytes_per_second / GB:,.0f} GB/s per node on a "
                f"few nodes, x{ring_scaling(nodes):.3f} over {nodes} nodes = {across.bus_bytes_per_second / GB:,.0f} "
                f"GB/s (NVIDIA/nccl#1229's reduce-scatter sweep), network ring step {inter.hop_seconds * 1e6:.1f} us"
            )
        if self.collective_compute_share:
            channels = NCCL_CHANNELS.get(self.generation, NCCL_CHANNELS["ampere"])
            notes.append(
                f"while a collective runs beside compute its {channels} NCCL channels hold {channels} of the "
                f"{self.multiprocessors} multiprocessors ({self.collective_compute_share:.1%} of the compute)"
            )
        return HardwareFigures(
            name=self.name,
            device=f"cuda ({self.gpu}, estimated from built-in figures)",
            memory_bytes=self.memory_bytes,
            rates=rates,
            # A device-to-device copy reads and writes every byte: half the DRAM bandwidth.
            copy_bytes_per_second=bandwidth / 2,
            collectives=ring_collectives(per_node, self.intra),
            description=f"{world_size} x {self.gpu} ({where})",
            inter_node_collectives=(
                ring_collectives(nodes, inter.rank_share(per_node).across(nodes))
                if nodes > 1 and inter is not None
                else {}
            ),
            nodes=nodes,
            peak_flops=self.half_flops if half else self.fp32_flops,
            notes=tuple(notes),
        )


def _attention_summary(points: tuple[tuple[bool, int, int, float], ...]) -> str:
    causal = sorted((n, r) for c, d, n, r in points if c and d == 128) or sorted((n, r) for _, _, n, r in points)
    return ", ".join(f"{r / TFLOPS:.0f} at {n:,}" for n, r in (causal[0], causal[-1])) + " TFLOPS, causal, head 128"


@dataclass(frozen=True)
class HardwareFigures:
    """What a dry run needs of the hardware, for one world size and precision.

    Attributes:
        name: the built-in name or the file the figures came from.
        device: device label written into the profile (``"cuda ..."``: the cost model then lets communication
            overlap compute, as CUDA streams do).
        memory_bytes: device memory, when known (the default budget is this less a reserve).
        rates: compute and memory rates of the estimated mode.
        copy_bytes_per_second: bandwidth of FSDP2's own copies.
        collectives: ``all_gather``, ``reduce_scatter``, ``all_reduce`` fits within a node (on one node: the world).
        description: one line for the report.
        inter_node_collectives: the same fits across nodes, for one rank per node at its share of the network
            (empty on one node; see [Note: the network between nodes]).
        nodes: nodes of the world.
        peak_flops: the data sheet's dense peak at the precision (what MFU is a share of; 0: unknown).
        notes: the figures used and where they come from, one line each, for the report.
    """

    name: str
    device: str
    memory_bytes: int | None
    rates: DeviceRates
    copy_bytes_per_second: float
    collectives: dict[str, CollectiveFit]
    description: str
    inter_node_collectives: dict[str, CollectiveFit] = field(default_factory=dict)
    nodes: int = 1
    peak_flops: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def topology(self) -> Topology:
        """The nodes and ranks per node the figures are for."""
        from lightning_osdp.topology import Topology

        per_node = next(iter(self.collectives.values())).world_size if self.collectives else 1
        return Topology(self.nodes, per_node)


def ring_collectives(world_size: int, link: Link) -> dict[str, CollectiveFit]:
    """``alpha + bytes / beta`` fits of ring collectives over ``link`` (see [Note: the collective model])."""
    from lightning_osdp.profiling import COLLECTIVE_OPS, CollectiveFit

    if world_size == 1:
        return {op: CollectiveFit(op, 1, 0.0, math.inf, []) for op in COLLECTIVE_OPS}
    n = world_size
    share = (n - 1) / n  # of the full buffer that each rank sends (and receives) in a ring pass
    fits = {}
    for op in COLLECTIVE_OPS:
        passes = 2 if op == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather
        alpha = COLLECTIVE_LAUNCH_SECONDS + passes * (n - 1) * link.hop_seconds
        beta = link.bus_bytes_per_second / (passes * share)
        fits[op] = CollectiveFit(op, n, alpha, beta, [])
    return fits


def _gpu(
    name: str,
    gpu: str,
    *,
    memory_gib: float,
    half_tflops: float,
    fp32_tflops: float,
    dram_gb_per_s: float,
    intra: Link,
    inter: Link | None,
    source: str,
    multiprocessors: int,
    generation: str,
    achieved_tflops: float | None = None,
    attention: tuple[tuple[bool, int, int, float], ...] = (),
    achieved_source: str = "",
) -> Hardware:
    return Hardware(
        name=name,
        gpu=gpu,
        memory_bytes=int(memory_gib * 2**30),
        half_flops=half_tflops * TFLOPS,
        fp32_flops=fp32_tflops * TFLOPS,
        memory_bytes_per_second=dram_gb_per_s * GB,
        gpus_per_node=8,
        intra=intra,
        inter=inter,
        source=source,
        achieved_half_flops=achieved_tflops * TFLOPS if achieved_tflops else None,
        attention=attention,
        achieved_source=achieved_source,
        multiprocessors=multiprocessors,
        generation=generation,
    )


def _fa2(
    table: dict[tuple[bool, int], tuple[tuple[int, float], ...]], scale: float = 1.0
) -> tuple[tuple[bool, int, int, float], ...]:
    """Points of a FlashAttention-2 chart (TFLOPS by sequence length), times ``scale``."""
    return tuple((causal, dim, n, r * TFLOPS * scale) for (causal, dim), curve in table.items() for n, r in curve)


_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
#: FlashAttention-2, forward + backward, H100 80GB SXM5, BF16 (README chart flash2_h100_fwd_bwd_benchmark.png).
FA2_H100: dict[tuple[bool, int], tuple[tuple[int, float], ...]] = {
    (True, 64): tuple(zip(_SEQ, (141, 192, 232, 257, 273, 284), strict=True)),
    (True, 128): tuple(zip(_SEQ, (163, 221, 265, 294, 308, 328), strict=True)),
    (False, 64): tuple(zip(_SEQ, (215, 254, 274, 288, 294, 296), strict=True)),
    (False, 128): tuple(zip(_SEQ, (248, 294, 320, 326, 335, 338), strict=True)),
}
#: The same on A100 80GB SXM4 (flash2_a100_fwd_bwd_benchmark.png); the non-causal points the chart's legend hides
#: (hd 64 at 1k, hd 128 at 512 and 1k) are left out.
FA2_A100: dict[tuple[bool, int], tuple[tuple[int, float], ...]] = {
    (True, 64): tuple(zip(_SEQ, (88, 119, 140, 156, 165, 171), strict=True)),
    (True, 128): tuple(zip(_SEQ, (99, 133, 155, 173, 182, 189), strict=True)),
    (False, 64): ((512, 132), (2048, 162), (4096, 171), (8192, 175), (16384, 176)),
    (False, 128): ((2048, 187), (4096, 196), (8192, 201), (16384, 203)),
}
_MAMF = (
    "stas00/ml-engineering's Maximum Achievable Matmul FLOPS table (BF16: H100 SXM 794.5 TFLOPS, 'H200 is the same'; "
    "A100 SXM 271.2)"
)
_FA2 = "FlashAttention-2's forward+backward benchmark charts (Dao-AILab/flash-attention README)"
# torchtitan's Grand Teton H100 runs at 500 W: "the actual peak TFLOPs number is between SXM and NVL, and we don't
# know its exact value" (benchmarks/llama3_h100_202412_torchtitan.md, footnote 2). NVL's dense BF16 peak is 835
# TFLOPS (H100 NVL data sheet: 1,671 with sparsity); the middle of the range, over SXM's 989, scales SXM's rates.
_H100_500W = (989 + 835) / 2 / 989


#: The built-in hardware, by ``--hardware`` name. GPU figures: dense (no sparsity) peaks from the vendor's data
#: sheet or whitepaper named in ``source``; memory as the card reports it (a "24 GB" card has 24 GiB).
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        _gpu(
            "a100-80g-nvlink", "NVIDIA A100-SXM4-80GB",
            memory_gib=80, half_tflops=312, fp32_tflops=19.5, dram_gb_per_s=2039,
            intra=NVLINK3_NVSWITCH, inter=INFINIBAND_8X_HDR,
            source="NVIDIA A100 data sheet (SXM4 80GB: BF16 312 TFLOPS dense, FP32 19.5, HBM2e 2,039 GB/s)",
            multiprocessors=108, generation="ampere", achieved_tflops=271.2, attention=_fa2(FA2_A100),
            achieved_source=f"{_MAMF}; {_FA2}, A100 80GB SXM4",
        ),
        _gpu(
            "a100-40g-nvlink", "NVIDIA A100-SXM4-40GB",
            memory_gib=40, half_tflops=312, fp32_tflops=19.5, dram_gb_per_s=1555,
            intra=NVLINK3_NVSWITCH, inter=INFINIBAND_8X_HDR,
            source="NVIDIA A100 data sheet (SXM4 40GB: BF16 312 TFLOPS dense, FP32 19.5, HBM2 1,555 GB/s)",
            multiprocessors=108, generation="ampere", achieved_tflops=271.2, attention=_fa2(FA2_A100),
            achieved_source=f"{_MAMF}, measured on the 80GB card (the same GA100 die); {_FA2}, A100 80GB SXM4",
        ),
        _gpu(
            "h100-sxm", "NVIDIA H100 80GB HBM3 (SXM5)",
            memory_gib=80, half_tflops=989, fp32_tflops=67, dram_gb_per_s=3350,
            intra=NVLINK4_NVSWITCH, inter=INFINIBAND_8X_NDR,
            source="NVIDIA H100 data sheet (SXM5: BF16 989 TFLOPS dense, FP32 67, HBM3 3.35 TB/s)",
            multiprocessors=132, generation="hopper", achieved_tflops=794.5, attention=_fa2(FA2_H100),
            achieved_source=f"{_MAMF}; {_FA2}, H100 80GB SXM5",
        ),
        _gpu(
            "h100-sxm5-96g", "NVIDIA H100 96GB HBM2e (SXM5, 500 W)",
            memory_gib=94, half_tflops=989, fp32_tflops=67, dram_gb_per_s=2400,
            intra=NVLINK4_NVSWITCH, inter=ROCE_8X_400G,
            source="the H100 of torchtitan's Llama 3.1 figures (docs/performance.md: Grand Teton hosts, 8 H100s "
            "fully connected with NVLink, 96 GB HBM2e at 2.4 TB/s, 500 W power limit, 400 Gb/s RDMA per GPU); the "
            "GH100 SXM5 die's dense peaks (H100 data sheet: BF16 989 TFLOPS, FP32 67) at full clocks, not derated "
            "for the 500 W limit; 94 GiB usable, as torchtitan's 405B report gives these cards' memory",
            multiprocessors=132, generation="hopper", achieved_tflops=794.5 * _H100_500W,
            attention=_fa2(FA2_H100, _H100_500W),
            achieved_source=f"{_MAMF} and {_FA2} (H100 80GB SXM5), times {_H100_500W:.3f} for the 500 W limit: "
            "torchtitan puts these cards' peak between SXM's 989 and NVL's 835 TFLOPS, here the middle",
        ),
        _gpu(
            "h200-sxm", "NVIDIA H200 (SXM)",
            memory_gib=140, half_tflops=989, fp32_tflops=67, dram_gb_per_s=4800,
            intra=NVLINK4_NVSWITCH, inter=INFINIBAND_8X_NDR,
            source="NVIDIA H200 data sheet (SXM: BF16 1,979 TFLOPS with sparsity, so 989 dense; FP32 67; 141 GB "
            "HBM3e at 4.8 TB/s; the card reports 143,771 MiB, 140 GiB)",
            multiprocessors=132, generation="hopper", achieved_tflops=794.5, attention=_fa2(FA2_H100),
            achieved_source=f"{_MAMF}; {_FA2} of the H100 (the same GH100 SMs and clocks)",
        ),
        _gpu(
            "rtx4090-pcie", "NVIDIA GeForce RTX 4090",
            memory_gib=24, half_tflops=165.2, fp32_tflops=82.6, dram_gb_per_s=1008,
            intra=PCIE4_NO_P2P, inter=None,
            source="NVIDIA Ada Lovelace whitepaper (RTX 4090: BF16 with FP32 accumulate 165.2 TFLOPS dense, "
            "FP32 82.6, GDDR6X 1,008 GB/s; 128 SMs)",
            multiprocessors=128, generation="ampere", attention=_fa2(FA2_A100, 165.2 / 312),
            achieved_source=f"no measured matmul maximum is published; attention at A100's share of its peak ({_FA2})",
        ),
        _gpu(
            "l4-pcie", "NVIDIA L4",
            memory_gib=24, half_tflops=121, fp32_tflops=30.3, dram_gb_per_s=300,
            intra=PCIE4, inter=ETHERNET_100G,
            source="NVIDIA L4 data sheet (BF16 121 TFLOPS dense, FP32 30.3, GDDR6 300 GB/s); 58 SMs (AD104)",
            multiprocessors=58, generation="ampere", attention=_fa2(FA2_A100, 121 / 312),
            achieved_source=f"no measured matmul maximum is published; attention at A100's share of its peak ({_FA2})",
        ),
        _gpu(
            "a10g", "NVIDIA A10G (AWS g5)",
            memory_gib=24, half_tflops=70, fp32_tflops=31.2, dram_gb_per_s=600,
            intra=PCIE4, inter=ETHERNET_100G,
            source="AWS does not publish A10G tensor figures: ~70 TFLOPS BF16 dense as third parties report (the "
            "A10's data sheet says 125), FP32 31.2, GDDR6 600 GB/s; 80 SMs (GA102)",
            multiprocessors=80, generation="ampere", attention=_fa2(FA2_A100, 70 / 312),
            achieved_source=f"no measured matmul maximum is published; attention at A100's share of its peak ({_FA2})",
        ),
    )
}  # fmt: skip


def get_network(name: str) -> Link:
    """The built-in network between nodes ``name``; the error lists the known names."""
    try:
        return NETWORKS[name.lower()]
    except KeyError:
        raise CLIError(f"unknown network {name!r}; known: {', '.join(NETWORKS)}") from None


def get_hardware(name: str) -> Hardware:
    """The built-in entry ``name``; the error lists the known names."""
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise CLIError(
            f"unknown hardware {name!r}; known: {', '.join(HARDWARE)} (or --hardware-profile FILE)"
        ) from None


def hardware_from_file(
    path: str | Path, world_size: int, *, nodes: int | None = None, network: Link | None = None
) -> HardwareFigures:
    """Figures measured on a real machine, from a saved profile (``osdp_plan.profile.json``, which the strategy
    writes beside the plan) or a hardware file of the same fields, for ``world_size`` ranks on ``nodes`` nodes
    (default: one, or as many as hold the world at the profile's ranks per node when it was measured on several).

    The profile's collective fits are used as measured when its world size equals ``world_size``; otherwise their
    bus bandwidth (see [Note: the collective model]) is carried over to ``world_size``, and their latency kept. On
    several nodes its within-node fits are carried over to the ranks of one node, and its across-node fits (a
    profile from several nodes) to the nodes; a profile of one node has none, and ``network`` (a built-in
    :data:`NETWORKS` entry) stands in for them (when given, it replaces measured ones too).
    Rates: the ``"rates"`` an estimated profile records; a measured profile has none, so the matmul rate is fitted
    to its modules' FLOPs and times (a module's forward and backward do about three times its forward FLOPs), and
    the memory rate taken from its measured copy bandwidth (a copy reads and writes: twice the bytes). The rates
    are those of the precision that run used.
    """
    from lightning_osdp.profiling import COLLECTIVE_OPS, CollectiveFit, DeviceRates

    path = Path(path)
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise CLIError(f"hardware profile {str(path)!r} does not exist") from None
    except (OSError, json.JSONDecodeError) as err:
        raise CLIError(f"cannot read hardware profile {str(path)!r}: {err}") from None
    info = data.get("info") or {}
    fits = data.get("collectives") or {}
    if not isinstance(fits, dict) or not all(op in fits for op in COLLECTIVE_OPS):
        raise CLIError(f"{path}: no collective fits ({', '.join(COLLECTIVE_OPS)}); is it a lightning_osdp profile?")
    measured = {op: CollectiveFit(**{**fits[op], "samples": []}) for op in COLLECTIVE_OPS}
    if world_size > 1 and any(f.world_size < 2 for f in measured.values()):
        raise CLIError(
            f"{path}: its collectives were measured on one rank, where nothing is communicated; use a profile "
            "from a run on several ranks"
        )
    measured_nodes = int(data.get("nodes") or 1)
    measured_per_node = max(int(data.get("world_size") or 1) // measured_nodes, 1)
    if nodes is None:
        fits_nodes = measured_nodes > 1 and world_size % measured_per_node == 0
        nodes = world_size // measured_per_node if fits_nodes else 1
    if nodes < 1 or world_size % nodes:
        raise CLIError(f"{world_size} ranks on {nodes} nodes is not a whole number of ranks per node")
    per_node = world_size // nodes
    collectives = {op: _rescaled(fit, per_node) for op, fit in measured.items()}
    across: dict[str, CollectiveFit] = {}
    raw_across = data.get("inter_node_collectives") or {}
    if nodes > 1 and all(op in raw_across for op in COLLECTIVE_OPS) and network is None:
        across = {op: _rescaled(CollectiveFit(**{**raw_across[op], "samples": []}), nodes) for op in COLLECTIVE_OPS}
    elif nodes > 1 and network is not None:
        across = ring_collectives(nodes, network.rank_share(per_node).across(nodes))
    elif nodes > 1:
        raise CLIError(
            f"{path}: measured on one node, it has no figures for the network between nodes; give --network NAME "
            f"(known: {', '.join(NETWORKS)}) for {nodes} nodes"
        )
    # A version-2 profile has these as fields; version 1 and hand-written files kept them under "info".
    copy_rate = float(data.get("copy_bytes_per_second") or info.get("copy_bytes_per_second") or 0.0)
    given_rates = data.get("rates") or info.get("rates")
    rates = DeviceRates(**given_rates) if given_rates else _rates_from_measured_modules(data, copy_rate, path)
    return HardwareFigures(
        name=str(path),
        device=str(data.get("device") or rates.device),
        memory_bytes=data.get("memory_bytes"),
        rates=rates,
        copy_bytes_per_second=copy_rate or rates.memory_bytes_per_second / 2,
        collectives=collectives,
        description=f"{world_size} x {data.get('device', '?')} (figures from {path}"
        + (f"; {nodes} nodes, between them {network.name})" if network is not None and nodes > 1 else ")"),
        inter_node_collectives=across,
        nodes=nodes,
    )


def _rescaled(fit: CollectiveFit, world_size: int) -> CollectiveFit:
    from lightning_osdp.profiling import CollectiveFit

    if world_size == 1:
        return CollectiveFit(fit.op, 1, 0.0, math.inf, [])
    if fit.world_size == world_size or fit.world_size < 2 or math.isinf(fit.beta_bytes_per_second):
        return CollectiveFit(fit.op, world_size, fit.alpha_seconds, fit.beta_bytes_per_second, [])
    passes = 2 if fit.op == "all_reduce" else 1
    bus = fit.beta_bytes_per_second * passes * (fit.world_size - 1) / fit.world_size
    return CollectiveFit(fit.op, world_size, fit.alpha_seconds, bus / (passes * (world_size - 1) / world_size), [])


def _rates_from_measured_modules(data: dict[str, Any], copy_rate: float, path: Path) -> DeviceRates:
    from lightning_osdp.profiling import DeviceRates, fit_latency_throughput

    samples = [
        (3.0 * float(m.get("fwd_flops", 0)), float(m.get("fwd_seconds", 0)) + float(m.get("bwd_seconds", 0)))
        for m in data.get("modules", [])
        if m.get("fwd_flops", 0) > 0 and m.get("fwd_seconds", 0) > 0
    ]
    alpha, rate = fit_latency_throughput(samples)
    if not samples or math.isinf(rate) or copy_rate <= 0:
        raise CLIError(f"{path}: neither device rates nor enough measured module times to derive them")
    return DeviceRates(str(data.get("device", "?")), "float32", alpha, rate, 0.0, 2 * copy_rate)


# ------------------------------------------------------------------------------------------ osdp hardware
def run(args: argparse.Namespace, out: Output) -> int:
    """Run ``osdp hardware``; returns the exit status."""
    from lightning_osdp.cost_model.network import Network

    size = 64 * 2**20
    rows = []
    for hw in HARDWARE.values():
        try:
            figures = hw.figures(args.world_size, "bf16-mixed")
        except CLIError:  # one machine, or not a whole number of GPUs per node
            figures = None
        if figures is None:
            times = ["-", "-"]
        else:
            world = figures.topology.world
            network = Network(figures, figures.topology)
            times = [f"{network.seconds(op, size, world) * 1e3:.2f}" for op in ("all_gather", "all_reduce")]
        rows.append(
            [
                hw.name,
                hw.gpu,
                f"{hw.memory_bytes / 2**30:.0f} GiB",
                f"{hw.half_flops / TFLOPS:.0f}",
                f"{hw.achieved_half_flops / TFLOPS:.0f}" if hw.achieved_half_flops else "-",
                f"{hw.fp32_flops / TFLOPS:.1f}",
                f"{hw.memory_bytes_per_second / GB:,.0f}",
                f"{hw.intra.bus_bytes_per_second / GB:.0f}",
                f"{hw.inter.bus_bytes_per_second / GB:.0f}" if hw.inter else "-",
                *times,
            ]
        )
    notes = [
        "TFLOPS: dense data-sheet peaks; a dry run's matmuls reach the 'achieved' column in half precision (a "
        "published measured maximum, charged in a training step at "
        + " and ".join(f"{v:.1%} of it on {g.title()}" for g, v in TRAINING_MATMUL_EFFICIENCY.items())
        + f" parts, attention too; '-': none is published, {MATMUL_EFFICIENCY_HALF:.0%} of the peak assumed) or "
        f"{MATMUL_EFFICIENCY_FP32:.0%} of the FP32 peak (32-true), on the roofline of their bytes at "
        f"{MEMORY_EFFICIENCY:.0%} of the DRAM bandwidth; attention at FlashAttention-2's published rates. Bus "
        "bandwidths: NCCL busbw of large collectives, of the order public nccl-tests runs report, across nodes "
        "scaled down with their number (NVIDIA/nccl#1229); nodes hold 8 GPUs. Approximations, not measurements of "
        "any one machine (lightning_osdp/cli/hardware.py).",
        *(f"{hw.name}: {hw.source}; {hw.achieved_source}" for hw in HARDWARE.values()),
    ]
    out.table(
        f"Built-in hardware (collective times of a 64 MiB buffer on {args.world_size} GPUs)",
        [
            "name",
            "GPU",
            "memory",
            "BF16 TFLOPS",
            "achieved",
            "FP32 TFLOPS",
            "DRAM GB/s",
            "node busbw GB/s",
            "net busbw GB/s",
            "all_gather ms",
            "all_reduce ms",
        ],
        rows,
        right=list(range(2, 11)),
        notes=notes,
    )
    out.table(
        "Built-in networks between nodes (osdp plan --network NAME)",
        ["name", "network", "busbw GB/s per node", "NICs", "hop us"],
        [
            [name, link.name, f"{link.bus_bytes_per_second / GB:.1f}", str(link.nics), f"{link.hop_seconds * 1e6:.0f}"]
            for name, link in NETWORKS.items()
        ],
        right=[2, 3, 4],
        notes=[f"{name}: {link.source}" for name, link in NETWORKS.items()],
    )
    return 0
