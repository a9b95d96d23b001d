"""State-dict keys that do not depend on the plan: the model's own names, whatever the splits.

A module split by the plan holds its weight as slices (``fc.slices.0.weight`` ... ``fc.slices.{k-1}.weight``,
each cut along dim 0, see :mod:`lightning_osdp.apply.split`); a checkpoint names it ``fc.weight``, as the unsplit
model does, so that it loads under any plan and into the plain, unsharded model. :class:`SliceMap` is the one
dictionary between the two spellings for a live (split) module: which parameters are split, into which slices,
and which rows of the unsplit parameter each slice holds. Everything that translates keys goes through it: its
full-state methods (consolidated files: slices concatenated on the way out, cut into their rows on the way in), the
DCP planners of sharded checkpoints (:mod:`lightning_osdp.checkpoint.planners`) and the compatibility checks that
run before any tensor is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_osdp.apply.split import SplitLinear

__all__ = ["SliceAlias", "SliceMap"]

_LEAVES = ("weight", "bias")


@dataclass(frozen=True)
class SliceAlias:
    """Where one slice parameter lies in the unsplit parameter it was cut from.

    Attributes:
        canonical: the unsplit model's name of the parameter (``h.0.fc.weight``).
        index: the slice number.
        row_offset: first row (dim 0) of the slice in the unsplit parameter.
        rows: rows of the slice.
        full_rows: rows of the unsplit parameter.
    """

    canonical: str
    index: int
    row_offset: int
    rows: int
    full_rows: int


class SliceMap:
    """Slice-parameter names of a split module <-> the unsplit model's names.

    Args:
        aliases: slice parameter name (``h.0.fc.slices.1.weight``) -> :class:`SliceAlias`.
    """

    def __init__(self, aliases: Mapping[str, SliceAlias]) -> None:
        self.aliases: dict[str, SliceAlias] = dict(aliases)
        #: unsplit name -> its slices' names by slice index, in the order of ``aliases`` (the module's order).
        self.slices_of: dict[str, list[str]] = {}
        for name, alias in self.aliases.items():
            self.slices_of.setdefault(alias.canonical, []).append(name)
        for names in self.slices_of.values():
            names.sort(key=lambda n: self.aliases[n].index)

    @classmethod
    def of(cls, module: nn.Module) -> SliceMap:
        """The map of every :class:`~lightning_osdp.apply.split.SplitLinear` under ``module``."""
        aliases: dict[str, SliceAlias] = {}
        for name, sub in module.named_modules():
            if not isinstance(sub, SplitLinear):
                continue
            prefix = f"{name}." if name else ""
            offset = 0
            for i, part in enumerate(sub.slices):
                assert isinstance(part, nn.Linear)
                rows = part.out_features
                for leaf in _LEAVES:
                    if getattr(part, leaf, None) is not None:
                        aliases[f"{prefix}slices.{i}.{leaf}"] = SliceAlias(
                            f"{prefix}{leaf}", i, offset, rows, sub.out_features
                        )
                offset += rows
        return cls(aliases)

    def __bool__(self) -> bool:
        return bool(self.aliases)

    def canonical(self, name: str) -> str:
        """The model's own name for parameter ``name`` (itself unless it is a slice)."""
        alias = self.aliases.get(name)
        return alias.canonical if alias is not None else name

    def canonical_shape(self, name: str, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the unsplit tensor that ``name`` (a slice, or any parameter) is part of."""
        alias = self.aliases.get(name)
        if alias is None or len(shape) == 0:
            return tuple(shape)
        return (alias.full_rows, *shape[1:])

    def canonical_shapes(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """Live parameter name -> shape (a split module's slices among them) -> the unsplit model's name -> shape:
        what a checkpoint of this module holds, whatever the splits."""
        return {self.canonical(name): self.canonical_shape(name, shape) for name, shape in shapes.items()}

    def alias_in_path(self, path: Sequence[Any]) -> tuple[tuple[Any, ...], SliceAlias] | None:
        """For a nested state-dict path (``("optimizer_0", "state", "fc.slices.1.weight", "exp_avg")``), the same
        path spelled with the unsplit name, and the slice's alias; ``None`` when no element names a slice."""
        for i, element in enumerate(path):
            alias = self.aliases.get(element) if isinstance(element, str) else None
            if alias is not None:
                return (*path[:i], alias.canonical, *path[i + 1 :]), alias
        return None

    def canonical_param_groups(self, groups: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Optimizer ``param_groups`` with parameter names: slices replaced by their unsplit name, listed once, at
        the first slice's position (which is where the unsplit parameter stood: splitting keeps the order)."""
        out = []
        for group in groups:
            params: list[Any] = []
            for p in group["params"]:
                name = self.canonical(p) if isinstance(p, str) else p
                if name not in params:
                    params.append(name)
            out.append({**group, "params": params})
        return out

    def sliced_param_groups(self, groups: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Inverse of :meth:`canonical_param_groups` for this module's splits."""
        out = []
        for group in groups:
            params: list[Any] = []
            for p in group["params"]:
                params.extend(self.slices_of.get(p, [p]) if isinstance(p, str) else [p])
            out.append({**group, "params": params})
        return out

    # ------------------------------------------------------------------------------------------ full state dicts
    def merge_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A full (unsharded) model state dict with slice keys -> the unsplit model's keys, in the same order: each
        split parameter, its slices concatenated along dim 0, stands where its first slice stood."""
        merged = self._merged(state, lambda parts: torch.cat(parts, dim=0))
        ordered: dict[str, Any] = {}
        for key in state:
            name = self.canonical(key)
            if name in merged:
                ordered.setdefault(name, merged[name])
        for key, value in merged.items():
            ordered.setdefault(key, value)
        return ordered

    def unmerge_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Inverse of :meth:`merge_state`: each unsplit parameter cut into its slices' rows (copies)."""
        return self._sliced(state, _rows)

    def merge_optimizer_state(self, osd: dict[str, Any]) -> dict[str, Any]:
        """A full name-keyed optimizer state dict (``get_optimizer_state_dict``) with slice names -> the unsplit names.

        Per-parameter tensors with the parameter's leading dimension (``exp_avg``, ``momentum_buffer``) are
        concatenated; scalars (``step``) are equal across slices and kept once.
        """
        if not self:
            return osd
        return {
            "state": self._merged(osd.get("state", {}), _merge_fields),
            "param_groups": self.canonical_param_groups(osd.get("param_groups", [])),
        }

    def unmerge_optimizer_state(self, osd: dict[str, Any]) -> dict[str, Any]:
        """Inverse of :meth:`merge_optimizer_state`."""
        if not self:
            return osd
        return {
            "state": self._sliced(osd.get("state", {}), _cut_fields),
            "param_groups": self.sliced_param_groups(osd.get("param_groups", [])),
        }

    def _merged(self, entries: Mapping[str, Any], combine: Callable[[list[Any]], Any]) -> dict[str, Any]:
        """``entries`` with the slices of each split parameter replaced by ``combine(slices' values)`` under its
        unsplit name, appended; a parameter with a slice missing keeps its slice keys."""
        out = dict(entries)
        for name, slices in self.slices_of.items():
            if all(s in out for s in slices):
                out[name] = combine([out.pop(s) for s in slices])
        return out

    def _sliced(self, entries: Mapping[str, Any], cut: Callable[[Any, SliceAlias], Any]) -> dict[str, Any]:
        """``entries`` with each split parameter's value replaced by ``cut(value, alias)`` under each slice's name,
        appended."""
        out = dict(entries)
        for name, slices in self.slices_of.items():
            if name in out:
                whole = out.pop(name)
                for s in slices:
                    out[s] = cut(whole, self.aliases[s])
        return out


def _rows(tensor: torch.Tensor, alias: SliceAlias) -> torch.Tensor:
    """The rows of the unsplit ``tensor`` that slice ``alias`` holds, as a copy."""
    if tensor.shape[0] != alias.full_rows:
        raise ValueError(
            f"{alias.canonical}: {tensor.shape[0]} rows, the unsplit parameter has {alias.full_rows}; cannot cut "
            f"slice {alias.index}"
        )
    return tensor.narrow(0, alias.row_offset, alias.rows).clone()


def _merge_fields(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One parameter's optimizer state from its slices' states."""
    merged: dict[str, Any] = {}
    for field, first in parts[0].items():
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            merged[field] = torch.cat([p[field] for p in parts], dim=0)
        else:
            merged[field] = first
    return merged


def _cut_fields(entry: dict[str, Any], alias: SliceAlias) -> dict[str, Any]:
    """One slice's optimizer state from its unsplit parameter's state."""
    return {
        field: (
            _rows(v, alias)
            if isinstance(v, torch.Tensor) and v.dim() > 0
            # Scalars (Adam's `step`) are cloned too: optimizers update them in place, and k slices sharing one
            # tensor would count k steps per step.
            else (v.clone() if isinstance(v, torch.Tensor) else v)
        )
        for field, v in entry.items()
    }
