"""Buffers under every plan: DDP's semantics, rank 0's buffers broadcast before a training forward.

[Note: one buffer semantics for every plan]
A buffer (BatchNorm's running statistics, say) is computed by each rank from its own batch. DDP keeps the ranks
equal by broadcasting every buffer from rank 0 before each forward that follows a synchronising training forward
(``broadcast_buffers=True``, its default, which Lightning's DDP strategy keeps): what rank 0 computed is what every
rank evaluates with. FSDP2 does nothing with buffers, so a plan that shards every unit (no DDP in the model) would
leave each rank with its own statistics, and what the model computes would depend on the plan the solver happened to
pick. A plan with a ``no_shard`` part runs DDP over the whole model (``executor.py``), which broadcasts every
buffer, the sharded units' included. A plan without one gets :class:`BufferBroadcast` on its FSDP2 root, which
follows DDP's rule step for step:

* before a forward, when the previous forward ran with gradients enabled and gradient synchronisation on (and
  before the first forward), rank 0's buffers are broadcast, coalesced per dtype into one collective;
* a forward without gradients (evaluation) or under ``no_sync`` (an accumulating micro-batch) turns the next
  broadcast off, as it sets DDP's ``require_forward_param_sync`` to ``False``.

The cost is one broadcast of the buffers' bytes per step, as under DDP; the cost model leaves it out (buffers are
small next to parameters).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_osdp._compat import preserve_version_counter

__all__ = ["BufferBroadcast"]


class BufferBroadcast:
    """DDP's buffer broadcast for a model that DDP does not wrap (see [Note: one buffer semantics for every plan]).

    Args:
        module: the model whose buffers are kept equal to rank 0's.
        group: the process group (the world's).
    """

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.module = module
        self.group = group
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        #: Whether gradients are being synchronised (``False`` under ``no_sync``): DDP's ``require_backward_grad_sync``.
        self.require_backward_grad_sync = True
        self._sync_next_forward = True  # DDP's ``require_forward_param_sync``

    def attach(self, root: nn.Module) -> None:
        """Broadcast around ``root``'s forward (the step's outermost module)."""
        root.register_forward_pre_hook(self._pre_forward)
        root.register_forward_hook(self._post_forward)

    def _pre_forward(self, *_: Any) -> None:
        if self._sync_next_forward:
            self.broadcast()

    def _post_forward(self, *_: Any) -> None:
        self._sync_next_forward = torch.is_grad_enabled() and self.require_backward_grad_sync

    def broadcast(self) -> None:
        """Copy rank 0's buffers into every rank's, one collective per dtype and device."""
        buffers = [b for b in self.module.buffers() if b.numel() > 0]
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in buffers:
            by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        with torch.no_grad(), preserve_version_counter(tuple(buffers)):
            for group in by_kind.values():
                flat = torch.cat([b.reshape(-1) for b in group])
                dist.broadcast(flat, self.src, group=self.group)
                offset = 0
                for b in group:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
