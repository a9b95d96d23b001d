"""How OSDP's sharded units communicate, per backend: the gradient reduce-scatter, and when the forward
all-gather buffer is freed.

[Note: reduce-scatter on gloo]
Gloo's ``reduce_scatter`` of a flat buffer is slower than its ``all_reduce`` of the same buffer, though an all-reduce
does strictly more work (a ring all-reduce *is* a reduce-scatter followed by an all-gather). Measured on the
development machine (2 ranks, loopback, fp32): 4 MiB reduce-scatter 9.9 ms against all-reduce 3.4 ms, 16 MiB 23.1 ms
against 15.3 ms. FSDP2 lets a module replace its reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, a public
API); on gloo OSDP does, with an all-reduce of FSDP2's reduce-scatter input in place (no extra buffer) followed by
the copy of this rank's chunk into the output. The result is the same reduction (for two ranks bit for bit: a sum of
two terms does not depend on their order). NCCL's reduce-scatter is the fast one: there FSDP2's default stays.

The profiler times ``reduce_scatter`` through :func:`reduce_scatter_comm` too, so that the cost model's figure is the
collective training runs.

[Note: the forward all-gather buffer on CPU]
FSDP2 gathers a unit's shards into one flat buffer, copies it out into the unsharded parameters, and then keeps the
buffer alive until the *next* FSDP2 unit gathers (``AllGatherState``): on CUDA, so that the next all-gather's stream
can wait on an event before the memory is reused. The last unit's buffer lives until the root's post-forward, which
under Lightning is after ``training_step`` has computed the loss, and ``no_shard`` units (DDP's) gather nothing, so
it can outlive many blocks. On CPU there are no streams and nothing to wait for: OSDP gives each sharded unit an
all-gather (FSDP2's public ``set_custom_all_gather``) that allocates the buffer as FSDP2's does, and frees its
storage when the unit's forward ends (a forward hook), after the copy-out FSDP2 did before the forward. The cost
model counts the buffer until then (``release_all_gather_after_forward``). In backward FSDP2 drops the buffer right
after its copy-out itself; the all-gather holds it only weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AllReduceScatter", "ReleasingAllGather", "reduce_scatter_comm", "releases_all_gather_after_forward"]


class AllReduceScatter:
    """A reduce-scatter computed as an in-place all-reduce of the input and a copy of this rank's chunk (see
    [Note: reduce-scatter on gloo]). It has the two methods of FSDP2's ``ReduceScatter`` interface (``allocate``
    and the call); the interface class itself lives in a private module, so it is not subclassed."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        dist.all_reduce(input_tensor, op=op, group=group)
        rank = dist.get_rank(group)
        output_tensor.copy_(input_tensor.view(dist.get_world_size(group), -1)[rank])
        return None


def reduce_scatter_comm(group: Any) -> AllReduceScatter | None:
    """The reduce-scatter to give FSDP2 on ``group`` (``None``: FSDP2's own)."""
    if dist.get_backend(group) == "gloo":
        return AllReduceScatter()
    return None


class ReleasingAllGather:
    """FSDP2's all-gather into a flat buffer (``all_gather_into_tensor``), whose last buffer :meth:`release` frees
    (see [Note: the forward all-gather buffer on CPU]). Duck-typed to FSDP2's ``AllGather`` interface."""

    def __init__(self) -> None:
        self._last: weakref.ref[torch.Tensor] | None = None

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(*size, dtype=dtype, device=device)
        self._last = weakref.ref(buffer)
        return buffer

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # FSDP2's own call
        work: dist.Work | None = all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        return work

    def release(self) -> None:
        """Free the storage of the last buffer, if it is still alive (FSDP2 has copied it out by now)."""
        buffer = self._last() if self._last is not None else None
        self._last = None
        if buffer is not None:
            buffer.untyped_storage().resize_(0)


def releases_all_gather_after_forward(device_type: str) -> bool:
    """Whether the executor frees each sharded unit's forward all-gather buffer when the unit's forward ends (on CPU;
    see [Note: the forward all-gather buffer on CPU])."""
    return device_type == "cpu"
