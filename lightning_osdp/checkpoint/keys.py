"""Checkpoint keys that do not depend on the plan: the model's own names, whatever the splits.

A module split by the plan holds its weight as slices (``fc.slices.0.weight`` ... ``fc.slices.{k-1}.weight``,
each cut along dim 0, see :mod:`lightning_osdp.apply.split`); a checkpoint names it ``fc.weight``, as the unsplit
LightningModule does. :class:`SliceMap` is the dictionary between the two spellings for one live (split) module.
It is used by the DCP planners (sharded checkpoints), by the full-state gather (consolidated files) and by the
compatibility check that runs before any tensor is read.

Full files store optimizer states in PyTorch's own format (``optimizer.state_dict()``: parameters numbered in
the order of the optimizer's parameter groups), exactly as Lightning's DDP strategy writes them, so that a
consolidated file resumes under DDP and a DDP file resumes under OSDP. :func:`optimizer_state_to_native` and
:func:`optimizer_state_from_native` convert between that and the name-keyed form of
``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_osdp.apply.split import SplitLinear
from lightning_osdp.checkpoint.errors import CheckpointMismatchError

__all__ = [
    "SliceAlias",
    "SliceMap",
    "check_model_keys",
    "check_optimizer_state",
    "keep_group_types",
    "named_param_groups",
    "optimizer_param_names",
    "optimizer_state_from_native",
    "optimizer_state_to_native",
    "split_state_keys",
]

_LEAVES = ("weight", "bias")
#: How many offending keys an error message lists before it summarises.
_SHOWN = 12


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
        self.slices_of: dict[str, list[str]] = {}
        for name, alias in sorted(self.aliases.items(), key=lambda kv: (kv[1].canonical, kv[1].index)):
            self.slices_of.setdefault(alias.canonical, []).append(name)

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


# ---------------------------------------------------------------------------------------------- optimizer formats
def optimizer_param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The unsplit model's name of every parameter of ``optimizer``, group by group, in the optimizer's order.

    A split parameter's slices are named once, at the first slice's position. A tied parameter takes its first
    name in ``named_parameters()`` (``wte.weight``, not ``lm_head.weight``), as ``torch.distributed.checkpoint``
    does.
    """
    slices = SliceMap.of(module)
    names = {id(p): n for n, p in module.named_parameters()}
    groups: list[list[str]] = []
    for group in optimizer.param_groups:
        listed: list[str] = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointMismatchError(
                    "the optimizer holds a parameter that is not a parameter of the model; OSDP checkpoints name "
                    "optimizer states by parameter name"
                )
            name = slices.canonical(names[id(p)])
            if name not in listed:
                listed.append(name)
        groups.append(listed)
    return groups


def optimizer_state_to_native(osd: Mapping[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict (``get_optimizer_state_dict``, unsplit names) -> ``optimizer.state_dict()``
    format: parameters numbered 0, 1, ... in the order of the parameter groups, state keyed by number."""
    ids: dict[str, int] = {}
    groups = []
    for group in osd.get("param_groups", []):
        numbered = []
        for name in group["params"]:
            ids.setdefault(name, len(ids))
            numbered.append(ids[name])
        groups.append({**group, "params": numbered})
    named = osd.get("state", {})
    state = {ids[name]: named[name] for name in sorted(named, key=lambda n: ids.get(n, -1)) if name in ids}
    unknown = sorted(set(osd.get("state", {})) - set(ids))
    if unknown:
        raise CheckpointMismatchError(f"optimizer state for parameters in no parameter group: {_listing(unknown)}")
    return {"state": state, "param_groups": groups}


def optimizer_state_from_native(native: Mapping[str, Any], names: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Inverse of :func:`optimizer_state_to_native`, numbering the current optimizer's parameters as ``names``
    (from :func:`optimizer_param_names`). Counts must agree group by group, as ``Optimizer.load_state_dict``
    requires."""
    saved_groups = list(native.get("param_groups", []))
    if len(saved_groups) != len(names):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), the model's optimizer {len(names)}"
        )
    by_id: dict[Any, str] = {}
    groups = []
    for g, (group, group_names) in enumerate(zip(saved_groups, names, strict=True)):
        if len(group["params"]) != len(group_names):
            raise CheckpointMismatchError(
                f"parameter group {g}: the checkpoint's optimizer has {len(group['params'])} parameters, the "
                f"model's optimizer {len(group_names)}"
            )
        by_id.update(zip(group["params"], group_names, strict=True))
        groups.append({**group, "params": list(group_names)})
    state = {by_id[i]: value for i, value in native.get("state", {}).items() if i in by_id}
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------------------- compatibility
def check_model_keys(
    expected: Mapping[str, tuple[int, ...]],
    saved: Mapping[str, tuple[int, ...]],
    *,
    strict: bool,
    source: str,
) -> None:
    """Raise :class:`CheckpointMismatchError` naming the keys when a checkpoint does not fit the model.

    Args:
        expected: the model's keys (unsplit names) -> shapes.
        saved: the checkpoint's keys -> shapes.
        strict: missing and unexpected keys are errors (``LightningModule.strict_loading``); a shape mismatch
            always is.
        source: the checkpoint, for the message.
    """
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = sorted(k for k in set(expected) & set(saved) if tuple(expected[k]) != tuple(saved[k]))
    problems = []
    if mismatched:
        shown = [f"{k}: checkpoint {_shape(saved[k])}, model {_shape(expected[k])}" for k in mismatched]
        problems.append(f"shape mismatch for {_listing(shown)}")
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"not in the model: {_listing(unexpected)}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {source} does not fit this model ({'; '.join(problems)}). Keys are the unsharded "
            "LightningModule's state_dict names; was the checkpoint written by another model or configuration?"
        )


def split_state_keys(keys: Iterable[str], names: Iterable[str]) -> tuple[dict[str, set[str]], list[str]]:
    """Optimizer state entries ``"<parameter name>.<field>"`` -> ({parameter name: fields}, entries of no known
    parameter). Parameter names contain dots, so each entry is matched against the known names."""
    known = set(names)
    fields: dict[str, set[str]] = {}
    unknown: list[str] = []
    for key in keys:
        cut = key.rfind(".")
        while cut > 0 and key[:cut] not in known:
            cut = key.rfind(".", 0, cut)
        if cut > 0:
            fields.setdefault(key[:cut], set()).add(key[cut + 1 :])
        else:
            unknown.append(key)
    return fields, sorted(unknown)


def check_optimizer_state(
    expected: Mapping[str, set[str]],
    saved: Mapping[str, set[str]],
    unknown: Sequence[str],
    *,
    index: int,
    source: str,
) -> None:
    """Raise :class:`CheckpointMismatchError` when a checkpoint's optimizer state does not fit the optimizer.

    Args:
        expected: parameter name (unsplit) -> state fields the model's optimizer keeps (``exp_avg``, ``step``...).
        saved: the same for the checkpoint. A parameter absent here had no state when it was saved (it never
            received a gradient) and stays without state, as ``Optimizer.load_state_dict`` leaves it.
        unknown: checkpoint entries that belong to no parameter of the optimizer.
        index: the optimizer's position, for the message.
        source: the checkpoint, for the message.
    """
    parts = []
    if unknown:
        parts.append(f"state for parameters the optimizer does not have: {_listing(list(unknown))}")
    differing = [
        f"{name}: checkpoint {sorted(saved[name])}, optimizer {sorted(expected[name])}"
        for name in sorted(set(expected) & set(saved))
        if saved[name] != expected[name]
    ]
    if differing:
        parts.append(f"other state fields for {_listing(differing)}")
    if parts:
        raise CheckpointMismatchError(
            f"checkpoint {source}: the state of optimizer {index} does not fit the model's optimizer "
            f"({'; '.join(parts)}). Was it saved with another optimizer, or other trainable parameters?"
        )


def named_param_groups(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``optimizer.param_groups`` with parameters named as ``module.named_parameters()`` names them (slice names
    for split modules), as ``get_optimizer_state_dict`` writes them."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


@contextmanager
def keep_group_types(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Loading gives hyper-parameters back as lists where the optimizer had tuples (Adam's ``betas``, after a DCP or
    full-state round trip): restore the optimizer's own types after the load inside the block."""
    before = [{k: type(v) for k, v in group.items()} for group in optimizer.param_groups]
    yield
    for group, types in zip(optimizer.param_groups, before, strict=False):
        for key, value in group.items():
            if types.get(key) is tuple and isinstance(value, list):
                group[key] = tuple(value)


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")
