"""Optimizers over a mixed plan's parameters: plain tensors (``no_shard``, under DDP) beside DTensors (sharded).

[Note: foreach over mixed parameters]
torch's optimizers step a parameter group with one ``torch._foreach_*`` kernel per operation when ``foreach`` is on,
its default when every parameter is on CUDA. A group holding plain tensors and DTensors is one list to those
kernels, which DTensor refuses ("got mixed torch.Tensor and DTensor"): a mixed plan's first optimizer step fails.
Splitting the group would change the optimizer's state-dict layout (its group indices), which checkpoints and
Lightning's schedulers rely on, so such a group steps with the per-tensor loop instead: ``foreach`` is set to
``False`` for the step only (a step pre-hook) and the group's own value is put back after it (a post-hook). The
value a checkpoint records is then the user's, equal to what DDP records, and one loaded from a checkpoint (which
replaces every group's hyperparameters) cannot bring ``foreach`` back. A user who asked for ``foreach=True``
explicitly is told.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["prepare_optimizers", "step_mixed_groups_per_tensor"]


def prepare_optimizers(optimizers: Iterable[Optimizer]) -> None:
    """:func:`step_mixed_groups_per_tensor` on each of a run's optimizers, telling the user when a group that asked
    for ``foreach=True`` steps per tensor."""
    for optimizer in optimizers:
        if step_mixed_groups_per_tensor(optimizer):
            rank_zero_info(
                "OSDP: parameter groups mixing replicated and sharded parameters step tensor by tensor "
                "(foreach=False): torch's foreach kernels refuse plain tensors and DTensors in one list"
            )


def step_mixed_groups_per_tensor(optimizer: Optimizer) -> list[int]:
    """Make every parameter group of ``optimizer`` that mixes plain tensors and DTensors step per tensor (see
    [Note: foreach over mixed parameters]); returns the indices of those groups that ask for ``foreach=True``
    explicitly, the ones a user should hear about."""
    mixed = [
        index
        for index, group in enumerate(optimizer.param_groups)
        if "foreach" in group and len({isinstance(p, DTensor) for p in group["params"]}) > 1
    ]
    if not mixed:
        return []
    saved: dict[int, Any] = {}

    def per_tensor(opt: Optimizer, args: Any, kwargs: Any) -> None:
        for index in mixed:
            # After a step that raised (no post-hook), the value saved before it is still the group's own.
            saved.setdefault(index, opt.param_groups[index]["foreach"])
            opt.param_groups[index]["foreach"] = False

    def restore(opt: Optimizer, args: Any, kwargs: Any) -> None:
        for index, value in saved.items():
            opt.param_groups[index]["foreach"] = value
        saved.clear()

    optimizer.register_step_pre_hook(per_tensor)
    optimizer.register_step_post_hook(restore)
    return [index for index in mixed if optimizer.param_groups[index]["foreach"] is True]
