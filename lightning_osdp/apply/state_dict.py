"""State-dict keys that do not depend on the plan.

A split operator holds its weight as slices (``fc.slices.0.weight``, ``fc.slices.1.weight``, ...), but a
checkpoint must carry the model's own names (``fc.weight``) so that it loads under any plan and into the plain,
unsharded model. These functions translate full (unsharded) model and optimizer state dicts between the two
spellings: slices are concatenated along dim 0 on the way out and cut with ``torch.tensor_split`` on the way in,
which is exactly how :class:`~lightning_osdp.apply.split.SplitLinear` cut them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_osdp.apply.split import SplitLinear

__all__ = [
    "merge_split_optimizer_state",
    "merge_split_state",
    "split_modules",
    "unmerge_split_optimizer_state",
    "unmerge_split_state",
]


def split_modules(module: nn.Module) -> dict[str, int]:
    """Qualified name -> split factor of every :class:`SplitLinear` under ``module``."""
    return {name: m.k for name, m in module.named_modules() if isinstance(m, SplitLinear)}


def _slice_key(name: str, i: int, leaf: str) -> str:
    return f"{name}.slices.{i}.{leaf}"


def merge_split_state(state: dict[str, Any], splits: dict[str, int]) -> dict[str, Any]:
    """Model state dict with slice keys -> the same with the unsplit model's keys."""
    out = dict(state)
    for name, k in splits.items():
        for leaf in ("weight", "bias"):
            keys = [_slice_key(name, i, leaf) for i in range(k)]
            if all(key in out for key in keys):
                out[f"{name}.{leaf}"] = torch.cat([out.pop(key) for key in keys], dim=0)
    return _reorder_like(out, state, splits)


def unmerge_split_state(state: dict[str, Any], splits: dict[str, int]) -> dict[str, Any]:
    """Model state dict with the unsplit model's keys -> the same with slice keys."""
    out = dict(state)
    for name, k in splits.items():
        for leaf in ("weight", "bias"):
            key = f"{name}.{leaf}"
            if key in out:
                for i, part in enumerate(torch.tensor_split(out.pop(key), k, dim=0)):
                    out[_slice_key(name, i, leaf)] = part.clone()
    return out


def merge_split_optimizer_state(osd: dict[str, Any], splits: dict[str, int]) -> dict[str, Any]:
    """A full FQN-keyed optimizer state dict (``get_optimizer_state_dict``) with slice keys -> model keys.

    Per-parameter tensors with the parameter's leading dimension (``exp_avg``, ``momentum_buffer``) are
    concatenated; scalars (``step``) are equal across slices and kept once.
    """
    if not splits:
        return osd
    state = dict(osd.get("state", {}))
    for name, k in splits.items():
        for leaf in ("weight", "bias"):
            keys = [_slice_key(name, i, leaf) for i in range(k)]
            if not all(key in state for key in keys):
                continue
            parts = [state.pop(key) for key in keys]
            merged: dict[str, Any] = {}
            for field, first in parts[0].items():
                if isinstance(first, torch.Tensor) and first.dim() > 0:
                    merged[field] = torch.cat([p[field] for p in parts], dim=0)
                else:
                    merged[field] = first
            state[f"{name}.{leaf}"] = merged
    groups = []
    for group in osd.get("param_groups", []):
        params: list[str] = []
        for p in group["params"]:
            mapped = _unslice(p, splits)
            if mapped not in params:
                params.append(mapped)
        groups.append({**group, "params": params})
    return {"state": state, "param_groups": groups}


def unmerge_split_optimizer_state(osd: dict[str, Any], splits: dict[str, int]) -> dict[str, Any]:
    """Inverse of :func:`merge_split_optimizer_state`."""
    if not splits:
        return osd
    state = dict(osd.get("state", {}))
    for name, k in splits.items():
        for leaf in ("weight", "bias"):
            key = f"{name}.{leaf}"
            if key not in state:
                continue
            entry = state.pop(key)
            for i in range(k):
                state[_slice_key(name, i, leaf)] = {
                    field: (
                        torch.tensor_split(v, k, dim=0)[i].clone()
                        if isinstance(v, torch.Tensor) and v.dim() > 0
                        # Scalars (Adam's `step`) are cloned too: optimizers update them in place, and k slices
                        # sharing one tensor would count k steps per step.
                        else (v.clone() if isinstance(v, torch.Tensor) else v)
                    )
                    for field, v in entry.items()
                }
    groups = []
    for group in osd.get("param_groups", []):
        params: list[str] = []
        for p in group["params"]:
            owner, _, leaf = p.rpartition(".")
            if owner in splits:
                params.extend(_slice_key(owner, i, leaf) for i in range(splits[owner]))
            else:
                params.append(p)
        groups.append({**group, "params": params})
    return {"state": state, "param_groups": groups}


def _unslice(key: str, splits: dict[str, int]) -> str:
    for name in splits:
        prefix = f"{name}.slices."
        if key.startswith(prefix):
            return f"{name}.{key[len(prefix) :].split('.', 1)[1]}"
    return key


def _reorder_like(out: dict[str, Any], original: dict[str, Any], splits: dict[str, int]) -> dict[str, Any]:
    """Keep the original key order, with each merged key where its first slice was."""
    ordered: dict[str, Any] = {}
    for key in original:
        mapped = _unslice(key, splits)
        if mapped in out and mapped not in ordered:
            ordered[mapped] = out[mapped]
    for key, value in out.items():
        ordered.setdefault(key, value)
    return ordered
