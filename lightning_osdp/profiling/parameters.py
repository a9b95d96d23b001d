"""Who owns which parameter and buffer, and their bytes: the exclusive, tie-aware part of a profile.

A parameter (or buffer) reachable from several modules (a tied embedding and LM head) is counted once, at the
first module ``named_modules()`` yields holding it; the holders are reported as a tie group. Bytes are
``numel * element_size`` as stored, so they follow the dtype the precision plugin gave the module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_osdp.grouping import tied_holders

__all__ = ["OwnTensors", "account_parameters", "grad_bytes_by_module", "owner_of_parameters"]


@dataclass
class OwnTensors:
    """What one module owns (exclusively) in parameters and buffers."""

    param_count: int = 0
    param_bytes: int = 0
    param_shapes: list[list[int]] = field(default_factory=list)
    trainable_param_bytes: int = 0
    buffer_bytes: int = 0


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def owner_of_parameters(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name of the module that counts it`` (the first holder in ``named_modules()``)."""
    owner: dict[int, str] = {}
    for name, mod in module.named_modules():
        for p in mod._parameters.values():
            if p is not None:
                owner.setdefault(id(p), name)
    return owner


def account_parameters(module: nn.Module) -> tuple[dict[str, OwnTensors], list[list[str]]]:
    """Per module (every module in ``named_modules()``) its own tensors, and the groups of tied holders."""
    own: dict[str, OwnTensors] = {}
    seen: set[int] = set()
    seen_buffers: set[int] = set()
    for name, mod in module.named_modules():
        figures = own[name] = OwnTensors()
        for p in mod._parameters.values():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            figures.param_count += p.numel()
            figures.param_bytes += _nbytes(p)
            figures.param_shapes.append(list(p.shape))
            if p.requires_grad:
                figures.trainable_param_bytes += _nbytes(p)
        for b in mod._buffers.values():
            if b is not None and id(b) not in seen_buffers:
                seen_buffers.add(id(b))
                figures.buffer_bytes += _nbytes(b)
    return own, [list(tie.holders) for tie in tied_holders(module)]


def grad_bytes_by_module(module: nn.Module) -> dict[str, int]:
    """Bytes of the gradients that exist now (after a backward), per owning module.

    A trainable parameter the step did not use has no gradient and counts nothing, as in memory.
    """
    owner = owner_of_parameters(module)
    figures: dict[str, int] = {}
    seen: set[int] = set()
    for p in module.parameters():
        if id(p) in seen or p.grad is None:
            continue
        seen.add(id(p))
        figures[owner[id(p)]] = figures.get(owner[id(p)], 0) + _nbytes(p.grad)
    return figures
