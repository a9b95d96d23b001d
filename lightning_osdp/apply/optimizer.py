"""Optimizers over a mixed plan's parameters: plain tensors (``no_shard``, under DDP) beside DTensors (sharded).

[Note: foreach over mixed parameters]
torch's optimizers step a parameter group with one ``torch._foreach_*`` kernel per operation when ``foreach`` is on,
its default when every parameter is on CUDA. A group holding plain tensors and DTensors is one list to those
kernels, which DTensor refuses ("got mixed torch.Tensor and DTensor"): a mixed plan's first optimizer step fails.
Splitting the group would change the optimizer's state-dict layout (its group indices), which checkpoints and
Lightning's schedulers rely on, so such a group steps with the per-tensor loop instead (``foreach=False``), as a
user who asked for ``foreach`` explicitly is told.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["step_mixed_groups_per_tensor"]


def step_mixed_groups_per_tensor(optimizer: Optimizer) -> list[int]:
    """Turn ``foreach`` off in every parameter group of ``optimizer`` that mixes plain tensors and DTensors (see
    [Note: foreach over mixed parameters]); returns the indices of the groups that had asked for it explicitly
    (``foreach=True``), the ones a user should hear about."""
    explicit = []
    for index, group in enumerate(optimizer.param_groups):
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if len(kinds) > 1 and "foreach" in group and group["foreach"] is not False:
            if group["foreach"]:
                explicit.append(index)
            group["foreach"] = False
    return explicit
