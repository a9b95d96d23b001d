"""What a CUDA device holds beside the bytes the cost model counts: the memory a published figure or ``nvidia-smi``
reports, and whether a plan fits the card.

The cost model predicts the *allocated* peak: the bytes of the live tensors at the worst instant of the step
(``torch.cuda.max_memory_allocated``). A run needs more of the card than that:

* the caching allocator's *reserved* memory (``torch.cuda.max_memory_reserved``, what torchtitan and most training
  logs report as "memory"): the allocated bytes plus cached blocks that are free at the peak but too small or in the
  wrong place for the request that sets it (fragmentation). The persistent tensors (parameters, their gradients,
  optimizer state) are allocated once in blocks of their own and fragment little; the transient ones (activations,
  gathered parameters, communication buffers) are freed and reallocated at other sizes every step, and their blocks
  are what fragments;
* outside PyTorch's allocator: the CUDA context (the driver's state and the loaded kernels) and NCCL's buffers (per
  communicator, one set per channel and protocol; ``NCCL_BUFFSIZE`` is 4 MiB for the Simple protocol).

[Note: where the three figures come from]
* FRAGMENTATION_SHARE, from published reserved peaks of runs whose allocated peak the dry run predicts: torchtitan
  logs ``torch.cuda.max_memory_reserved`` (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama 3.1 8B,
  selective AC, batch 2 x 8,192, eager): 67.0 GiB on 128 H100s and 82.4 on 8. Against the allocated peaks
  ``benchmarks/calibration.py`` predicts for them (docs/benchmarks.md, "Calibration against published runs", gives
  the figures), the 128-GPU run's excess is about 15% of its transient bytes; the 8-GPU run's is larger (about 24%),
  where the optimizer state is 16 times larger and AdamW's step allocates temporaries of its size, which the count of
  transient bytes leaves out. The share is the 128-GPU run's, 0.15, where the excess is nearly all transient.
  Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) cut the fragmentation; these runs did not
  set them.
* CUDA_CONTEXT_BYTES: the context alone is 274 MiB with CUDA's lazy module loading, which PyTorch turns on (pytorch
  PR #86509 measured 287,047,680 bytes lazy against 666,632,192 eager); a training step loads cuBLAS's, cuDNN's and
  the attention kernels' modules beside it and cuBLAS's workspaces: half a GiB in all, an estimate of that order.
* NCCL_COMMUNICATOR_BYTES: NCCL allocates per channel and peer a buffer per protocol outside PyTorch's allocator
  (``NCCL_BUFFSIZE``, the Simple protocol's, is 4 MiB by default; LL128's is of the same order, LL's smaller): at the
  16 channels torch's estimator takes for Hopper (``cli/hardware.py``'s ``NCCL_CHANNELS``) and a ring's two peers,
  16 x 2 x (4 + 4) MiB = 256 MiB, and more with the tree's peers and NVLink SHARP: 0.375 GiB, an estimate of that
  order.
The last two are not published for any run of the calibration: a run on the device (``tests/gpu``) measures them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_osdp.cost_model import Prediction
    from lightning_osdp.plan import Plan
    from lightning_osdp.topology import Topology

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "FRAGMENTATION_SHARE",
    "NCCL_COMMUNICATOR_BYTES",
    "DeviceMemory",
    "device_memory",
    "plan_device_memory",
    "plan_memory_line",
]

GIB = 2**30
#: Reserved beyond allocated, as a share of the transient bytes at the peak (see [Note: where the three figures come
#: from]).
FRAGMENTATION_SHARE = 0.15
#: The CUDA context and the loaded kernels, outside PyTorch's allocator.
CUDA_CONTEXT_BYTES = GIB // 2
#: NCCL's buffers per communicator a rank joins, outside PyTorch's allocator.
NCCL_COMMUNICATOR_BYTES = 3 * GIB // 8


@dataclass(frozen=True)
class DeviceMemory:
    """One rank's memory at the step's peak, by who holds it (bytes).

    Attributes:
        allocated: the live tensors (the cost model's peak).
        fragmentation: cached blocks the allocator holds free at the peak.
        nccl: NCCL's buffers.
        context: the CUDA context.
    """

    allocated: int
    fragmentation: int
    nccl: int
    context: int

    @property
    def reserved(self) -> int:
        """The caching allocator's reserved peak (``torch.cuda.max_memory_reserved``)."""
        return self.allocated + self.fragmentation

    @property
    def device_total(self) -> int:
        """All the process holds on the device (what ``nvidia-smi`` shows)."""
        return self.reserved + self.nccl + self.context

    def fits(self, card_bytes: int) -> bool:
        """Whether the run fits a card of ``card_bytes``."""
        return self.device_total <= card_bytes


def device_memory(allocated: int, transient: int, *, communicators: int = 1) -> DeviceMemory:
    """The device memory of a step whose allocated peak is ``allocated`` bytes, ``transient`` of them activations,
    gathered parameters and communication buffers, on a rank that joins ``communicators`` NCCL communicators (FSDP on
    one group: 1; ``hybrid_shard``: 2, its shard and replicate groups; one rank alone: 0)."""
    if allocated < 0 or not 0 <= transient <= allocated or communicators < 0:
        raise ValueError(
            f"need 0 <= transient <= allocated and communicators >= 0, got allocated={allocated}, "
            f"transient={transient}, communicators={communicators}"
        )
    return DeviceMemory(
        allocated=allocated,
        fragmentation=round(FRAGMENTATION_SHARE * transient),
        nccl=communicators * NCCL_COMMUNICATOR_BYTES,
        context=CUDA_CONTEXT_BYTES,
    )


def plan_device_memory(prediction: Prediction, plan: Plan, topology: Topology) -> DeviceMemory:
    """The device memory of ``plan``'s step as ``prediction`` has it, on ``topology``: its transient bytes are the
    peak's activations, gathered parameters and communication buffers; it joins one NCCL communicator, two where a
    unit is ``hybrid_shard`` on several nodes, none alone."""
    peak = prediction.peak
    transient = min(peak.activations + peak.gathered_parameters + peak.communication_buffers, prediction.peak_bytes)
    hybrid = topology.nodes > 1 and any(d.mode == "hybrid_shard" for d in plan.decisions.values())
    communicators = 0 if topology.world_size == 1 else 2 if hybrid else 1
    return device_memory(prediction.peak_bytes, transient, communicators=communicators)


def plan_memory_line(prediction: Prediction, plan: Plan, topology: Topology, card_bytes: int | None) -> str:
    """One line for ``osdp plan``'s report: the plan's allocated peak, the reserved peak and the device total beside
    the card (see the module docstring)."""
    memory = plan_device_memory(prediction, plan, topology)
    line = (
        f"device memory of this plan: allocated peak {memory.allocated / GIB:.1f} GiB, reserved by the caching "
        f"allocator {memory.reserved / GIB:.1f} GiB (fragmentation {memory.fragmentation / GIB:.1f}), with NCCL's "
        f"buffers and the CUDA context {memory.device_total / GIB:.1f} GiB"
    )
    if card_bytes:
        verdict = "fits" if memory.fits(card_bytes) else "does not fit"
        line += f": {verdict} the {card_bytes / GIB:.0f} GiB card"
    return line + " (lightning_osdp/cost_model/device_memory.py; published 'memory' is mostly the reserved figure)"
