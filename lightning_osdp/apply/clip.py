"""Gradient clipping over a plan's mix of replicated (plain tensor) and sharded (DTensor) gradients.

``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms of all gradients in one ``foreach`` call, which
refuses a list mixing ``torch.Tensor`` and ``DTensor`` ("got mixed torch.Tensor and DTensor"): exactly what a
mixed plan has (``no_shard`` parameters stay plain for DDP, sharded ones are DTensors). The total norm is the
norm of the two partial norms: the DTensor part's norm is reduced over the mesh (``full_tensor``), the plain
part's is the same on every rank (its gradients are already all-reduced). Each part is then scaled by the same
coefficient with torch's own ``clip_grads_with_norm_``. DTensors on different meshes (``hybrid_shard`` units on the
2-D mesh beside the others on the world's) cannot meet in one ``foreach`` call either: each mesh is its own part.
Clipping by value (a clamp, element by element) meets the same refusal in its ``foreach`` call and is exact per
part. OSDP's precision plugins (``lightning_osdp.precision``) clip
with these functions when Lightning clips.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

__all__ = ["clip_grad_norm_", "clip_grad_value_", "parts_by_mesh"]


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters that may mix plain tensors and DTensors.

    Returns the total norm of all gradients (a plain tensor, the same on every rank). With only plain or only
    DTensor gradients it computes what torch's function computes.
    """
    params = [p for p in parameters if p.grad is not None]
    parts = parts_by_mesh(params)
    norms: list[Tensor] = []
    for part in parts:
        grads = [p.grad for p in part if p.grad is not None]
        norm = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = norms[0] if len(norms) == 1 else get_total_norm(norms, norm_type, error_if_nonfinite, foreach)
    for part in parts:
        clip_grads_with_norm_(part, max_norm, total, foreach)
    return total


def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_`` for parameters that may mix plain tensors and DTensors: each gradient is
    clamped to ``[-clip_value, clip_value]``, the plain and the sharded ones in separate calls."""
    for part in parts_by_mesh([p for p in parameters if p.grad is not None]):
        torch.nn.utils.clip_grad_value_(part, clip_value, foreach=foreach)


def parts_by_mesh(params: list[Tensor]) -> list[list[Tensor]]:
    """``params`` in parts one ``foreach`` call takes: the DTensor gradients per mesh, then the plain ones."""
    parts: dict[object, list[Tensor]] = {}
    for p in params:
        parts.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    # The plain part last, when there is one (a plan that shards every unit has none).
    return [part for mesh, part in parts.items() if mesh is not None] + ([parts[None]] if None in parts else [])
