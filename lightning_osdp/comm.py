"""The gradient reduce-scatter OSDP's sharded units issue, per backend.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AllReduceScatter", "reduce_scatter_comm"]


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
