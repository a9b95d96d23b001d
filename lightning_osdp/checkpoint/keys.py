"""Checkpoint keys that do not depend on the plan: the model's own names, whatever the splits, and the checks that a
checkpoint fits the model. A split operator's slice names are translated to the unsplit names by
:class:`~lightning_osdp.apply.state_dict.SliceMap`, the one map between the two spellings.

Full files store optimizer states in PyTorch's own format (``optimizer.state_dict()``: parameters numbered in
the order of the optimizer's parameter groups), exactly as Lightning's DDP strategy writes them, so that a
consolidated file resumes under DDP and a DDP file resumes under OSDP. :func:`optimizer_state_to_native` and
:func:`optimizer_state_from_native` convert between that and the name-keyed form of
``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_osdp.apply.state_dict import SliceMap
from lightning_osdp.checkpoint.errors import CheckpointMismatchError

__all__ = [
    "check_model_keys",
    "check_optimizer_state",
    "keep_group_types",
    "named_param_groups",
    "optimizer_param_names",
    "optimizer_state_from_native",
    "optimizer_state_to_native",
    "split_state_keys",
]

#: How many offending keys an error message lists before it summarises.
_SHOWN = 12


# ---------------------------------------------------------------------------------------------- optimizer formats
def optimizer_param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The unsplit model's name of every parameter of ``optimizer``, group by group, in the optimizer's order.

    A split parameter's slices are named once, at the first slice's position (the translation is
    :meth:`SliceMap.canonical_param_groups`). A tied parameter takes its first name in ``named_parameters()``
    (``wte.weight``, not ``lm_head.weight``), as ``torch.distributed.checkpoint`` does.
    """
    groups = SliceMap.of(module).canonical_param_groups(named_param_groups(module, optimizer))
    return [list(group["params"]) for group in groups]


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
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        raise CheckpointMismatchError(
            "the optimizer holds a parameter that is not a parameter of the model; OSDP checkpoints name optimizer "
            "states by parameter name"
        )
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
