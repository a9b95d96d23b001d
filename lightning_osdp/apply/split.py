"""Operator splitting: an ``nn.Linear`` cut into ``k`` slices along its output features.

[Note: why output features]
The OSDP prototype cut a Linear along ``in_features`` and summed the partial products, adding the bias once per
slice (``k`` times). Cutting along ``out_features`` needs no reduction at all: slice ``i`` owns rows
``W[i]`` and bias entries ``b[i]`` and computes ``x @ W[i].T + b[i]``; concatenating the slices' outputs is the
unsplit output bit for bit in exact arithmetic, with each bias entry added exactly once. Each slice is its own
communication unit, so under a sharded mode only one slice's parameters need to be gathered at a time: the
transient peak of gathered parameters falls from ``P`` to about ``P / k``, for ``k`` collectives' latency.

The slices compute what ``nn.Linear.forward`` computes, when the module is called: a subclass with its own forward,
a Linear whose parent reads its weight without calling it (``MultiheadAttention.out_proj``), or one with other
state or hooks is refused (:meth:`lightning_osdp.Plan.validate` says which and why).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_osdp.plan import PlanError, unsplittable_reason

__all__ = ["SplitLinear", "split_linear"]


class SplitLinear(nn.Module):
    """``k`` ``nn.Linear`` slices that together compute one Linear layer.

    Slice ``i`` holds output features ``torch.tensor_split(range(out_features), k)[i]`` (sizes differ by at most
    one when ``k`` does not divide ``out_features``).
    """

    def __init__(self, linear: nn.Linear, k: int) -> None:
        super().__init__()
        if type(linear).forward is not nn.Linear.forward:
            raise ValueError(
                f"{type(linear).__name__} defines its own forward, which the slices would not run: only modules whose "
                "forward is nn.Linear.forward can be split"
            )
        if k < 1 or k > linear.out_features:
            raise ValueError(f"split factor must be in [1, {linear.out_features}], got {k}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.k = k
        weights = torch.tensor_split(linear.weight.detach(), k, dim=0)
        biases = torch.tensor_split(linear.bias.detach(), k, dim=0) if linear.bias is not None else [None] * k
        self.slices = nn.ModuleList()
        for w, b in zip(weights, biases, strict=True):
            # Uninitialised: nn.Linear's own init would draw from the global RNG, and the dropout masks of the run
            # (and its parity with an unsplit run) would shift.
            part = torch.nn.utils.skip_init(
                nn.Linear, self.in_features, w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype
            )
            with torch.no_grad():
                part.weight.copy_(w)
                if b is not None:
                    part.bias.copy_(b)
            part.weight.requires_grad_(linear.weight.requires_grad)
            if b is not None and linear.bias is not None:
                part.bias.requires_grad_(linear.bias.requires_grad)
            self.slices.append(part)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([part(x) for part in self.slices], dim=-1)

    def merged(self) -> nn.Linear:
        """The equivalent unsplit ``nn.Linear`` (for checkpoints and tests)."""
        first = self.slices[0]
        assert isinstance(first, nn.Linear)
        out = nn.Linear(
            self.in_features,
            self.out_features,
            bias=first.bias is not None,
            device=first.weight.device,
            dtype=first.weight.dtype,
        )
        parts = [p for p in self.slices if isinstance(p, nn.Linear)]
        with torch.no_grad():
            out.weight.copy_(torch.cat([p.weight for p in parts], dim=0))
            if out.bias is not None:
                out.bias.copy_(torch.cat([p.bias for p in parts], dim=0))
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, k={self.k}"


def split_linear(root: nn.Module, name: str, k: int) -> SplitLinear:
    """Replace the ``nn.Linear`` at ``root.get_submodule(name)`` by a :class:`SplitLinear` in place.

    Raises :class:`~lightning_osdp.PlanError` for a module a split would change (see
    :meth:`lightning_osdp.Plan.validate`)."""
    reason = unsplittable_reason(name, k, dict(root.named_modules()))
    if reason is not None:
        raise PlanError(f"module {name!r}: split={k} {reason}")
    linear = root.get_submodule(name)
    assert isinstance(linear, nn.Linear)
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    replacement = SplitLinear(linear, k)
    setattr(parent, attr, replacement)
    return replacement
