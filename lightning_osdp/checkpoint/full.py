"""Full (consolidated) checkpoints: one ``torch.save`` file that plain Lightning and PyTorch read.

The model's state is gathered to rank 0 under the unsplit model's keys; optimizer states are written in
PyTorch's own format (``optimizer.state_dict()``), as Lightning's DDP strategy writes them. Such a file is what
``state_dict_type="full"`` saves and what :func:`~lightning_osdp.checkpoint.consolidate` produces: it loads with
``MyModule.load_from_checkpoint`` without OSDP, resumes under DDP, and resumes under OSDP with any plan. Loading one
costs every rank the whole file in memory, which is why sharded checkpoints are the default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_osdp import distributed
from lightning_osdp.apply.state_dict import SliceMap
from lightning_osdp.checkpoint import layout
from lightning_osdp.checkpoint.context import CheckpointContext
from lightning_osdp.checkpoint.errors import CheckpointMismatchError
from lightning_osdp.checkpoint.keys import (
    check_model_keys,
    keep_group_types,
    named_param_groups,
    optimizer_param_names,
    optimizer_state_from_native,
    optimizer_state_to_native,
)

__all__ = [
    "full_model_state",
    "full_optimizer_state",
    "load_full_model_state",
    "load_full_optimizer_state",
    "save_full_checkpoint",
]

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """The unsharded model state in CPU memory on rank 0 (empty elsewhere), with the unsplit model's keys.

    A collective: every rank takes part in gathering the shards.
    """
    state = get_model_state_dict(module, options=_FULL)
    return SliceMap.of(module).merge_state(state)


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded optimizer state on rank 0 (empty elsewhere) in ``optimizer.state_dict()`` format.

    A collective. Parameters are numbered in the order of the optimizer's groups, with a split parameter's slices
    counted once, where the unsplit parameter stood: the numbering of the same optimizer on the unsplit model.
    """
    if not optimizer.state:
        # Not `get_optimizer_state_dict`: it would give Adam a zero-gradient step (see `sharded_optimizer_state`).
        state: dict[str, Any] = {"state": {}, "param_groups": named_param_groups(module, optimizer)}
    else:
        state = dict(get_optimizer_state_dict(module, optimizer, options=_FULL))
    if distributed.rank() != 0:
        return {}
    return optimizer_state_to_native(SliceMap.of(module).merge_optimizer_state(state))


def save_full_checkpoint(
    checkpoint: Mapping[str, Any],
    path: str | Path,
    *,
    context: CheckpointContext,
    write: Callable[[dict[str, Any], Path], None] | None = None,
) -> Path:
    """Write ``checkpoint`` (with full states from :func:`full_model_state` / :func:`full_optimizer_state`) as one
    file, atomically: rank 0 writes ``<path>.tmp-<token>`` then renames it over ``path``. A collective (every rank
    waits for the rename).

    Args:
        write: writes a dict to a file (the strategy passes its ``CheckpointIO``); ``torch.save`` by default.
    """
    path = Path(distributed.broadcast(str(path)))
    tmp = layout.temporary_path(path, distributed.broadcast(layout.new_token()))

    def write_and_commit() -> None:
        layout.check_replaceable(path)
        content = dict(checkpoint)
        content["osdp"] = context.full_entry(
            optimizers=len(checkpoint.get("optimizer_states", [])), checkpoint=checkpoint
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            (write or _torch_save)(content, tmp)
            _fsync_file(tmp)
            layout.commit(tmp, path)
        except Exception as err:
            full = layout.no_room(err, path.parent)
            layout.discard(tmp)
            raise layout.save_error(path, err, full=full) from err

    distributed.from_rank_zero(write_and_commit, what=f"saving checkpoint {str(path)!r}")
    return path


def load_full_model_state(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True, source: str
) -> None:
    """Load a full state dict with the unsplit model's keys (a full file, a DDP checkpoint) into the sharded
    ``module``. Every rank passes the whole dict; keys and shapes are checked first."""
    slices = SliceMap.of(module)
    live: dict[str, Any] = get_model_state_dict(module)
    expected = slices.canonical_shapes({k: v.shape for k, v in live.items()})
    saved = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    check_model_keys(expected, saved, strict=strict, source=source)
    sliced = slices.unmerge_state({k: v for k, v in state_dict.items() if k in expected})
    set_model_state_dict(module, sliced, options=StateDictOptions(full_state_dict=True, strict=strict))


def load_full_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, native: Mapping[str, Any], *, source: str
) -> None:
    """Load an ``optimizer.state_dict()``-format state (a full file, a DDP checkpoint) into ``optimizer``."""
    try:
        named = optimizer_state_from_native(native, optimizer_param_names(module, optimizer))
    except CheckpointMismatchError as err:
        raise CheckpointMismatchError(f"checkpoint {source}: {err}") from None
    slices = SliceMap.of(module)
    shapes = slices.canonical_shapes({n: p.shape for n, p in module.named_parameters()})
    wrong = [
        f"{name}.{field}: checkpoint {tuple(value.shape)}, parameter {shapes[name]}"
        for name, entry in named["state"].items()
        for field, value in entry.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shapes.get(name)
    ]
    if wrong:
        raise CheckpointMismatchError(f"checkpoint {source}: optimizer state of another shape: {', '.join(wrong)}")
    sliced = slices.unmerge_optimizer_state(named)
    with keep_group_types(optimizer):
        set_optimizer_state_dict(module, optimizer, sliced, options=StateDictOptions(full_state_dict=True))


def _torch_save(content: dict[str, Any], path: Path) -> None:
    torch.save(content, path)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
