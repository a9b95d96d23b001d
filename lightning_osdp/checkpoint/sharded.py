"""Sharded checkpoints: every rank writes and reads only its own shards, with torch.distributed.checkpoint (DCP).

The model and optimizer states are taken as the live module holds them (DTensors, split slices under their slice
names) and translated to the unsplit model's keys by :mod:`lightning_osdp.checkpoint.planners` on the way to disk.
DCP reshards on load, so a checkpoint written under one plan and world size loads under any other: the keys are
the same, only the placements differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_osdp.apply.state_dict import SliceMap
from lightning_osdp.checkpoint import _dist, layout
from lightning_osdp.checkpoint.context import CheckpointContext
from lightning_osdp.checkpoint.keys import (
    check_model_keys,
    check_optimizer_state,
    keep_group_types,
    named_param_groups,
    split_state_keys,
)
from lightning_osdp.checkpoint.planners import SliceLoadPlanner, SliceSavePlanner

__all__ = [
    "MODEL_KEY",
    "ShardedState",
    "load_sharded_model_state",
    "load_sharded_optimizer_state",
    "open_sharded_checkpoint",
    "read_sharded_tensors",
    "save_sharded_checkpoint",
    "sharded_model_state",
    "sharded_optimizer_state",
]

#: DCP top-level key of the model state (optimizer ``i`` is under ``optimizer_<i>``).
MODEL_KEY = "state_dict"
#: Lightning's checkpoint entries that hold tensors; everything else goes to ``meta.pt``.
_TENSOR_ENTRIES = ("state_dict", "optimizer_states")


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


@dataclass(frozen=True)
class ShardedState:
    """A state dict that stays in a sharded checkpoint's shards until the strategy loads it in place.

    :func:`open_sharded_checkpoint` puts one in the returned checkpoint as ``checkpoint["state_dict"]`` and one per
    optimizer in ``checkpoint["optimizer_states"]``: reading them all into memory on every rank is what sharded
    checkpoints avoid.

    Attributes:
        path: the checkpoint directory.
        key: the DCP top-level key (``"state_dict"``, ``"optimizer_0"``...).
    """

    path: Path
    key: str


# ---------------------------------------------------------------------------------------------- save
def sharded_model_state(module: nn.Module) -> dict[str, Any]:
    """The model's state as this rank holds it (DTensor shards; split slices under their slice names)."""
    return get_model_state_dict(module)


def sharded_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state as this rank holds it, keyed by parameter name (DTensor shards)."""
    if not optimizer.state:
        # NOTE: `get_optimizer_state_dict` initialises an optimizer without state by running a step with zero
        # gradients and lr 0. Adam counts it (`step` = 1): a checkpoint taken before the first step would change
        # the rest of training. An optimizer without state is saved as such, as `Optimizer.state_dict()` does.
        return {"state": {}, "param_groups": named_param_groups(module, optimizer)}
    return dict(get_optimizer_state_dict(module, optimizer))


def save_sharded_checkpoint(
    checkpoint: Mapping[str, Any],
    path: str | Path,
    *,
    module: nn.Module,
    context: CheckpointContext,
) -> Path:
    """Write ``checkpoint`` (Lightning's dict: ``state_dict`` and ``optimizer_states`` as returned by
    :func:`sharded_model_state` / :func:`sharded_optimizer_state`) as a sharded checkpoint directory, atomically.

    A collective: every rank calls it with its own shards. Each rank writes one DCP file in parallel; rank 0 then
    writes ``meta.pt``, the plan, the profile and the manifest, and renames the directory into place (see
    ``layout``'s [Note: atomic saves]). Returns the final path.
    """
    path = Path(_dist.broadcast(str(path)))
    tmp = layout.temporary_path(path, _dist.broadcast(layout.new_token()))
    _dist.on_rank_zero(lambda: layout.check_replaceable(path), f"saving checkpoint {str(path)!r}")
    slices = SliceMap.of(module)
    optimizer_states = list(checkpoint.get("optimizer_states", []))
    tensors: dict[str, Any] = {MODEL_KEY: checkpoint.get("state_dict", {})}
    for i, osd in enumerate(optimizer_states):
        tensors[_optimizer_key(i)] = {**osd, "param_groups": slices.canonical_param_groups(osd["param_groups"])}
    # DCP's collectives end with the coordinator's `finish` (it writes `.metadata` after gathering every rank's
    # write results), so once `save` returns on rank 0 every rank's shard file is complete and synced.
    dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True), planner=SliceSavePlanner(slices))

    def finish() -> None:
        meta = {k: v for k, v in checkpoint.items() if k not in _TENSOR_ENTRIES}
        torch.save(meta, tmp / layout.META)
        manifest = context.manifest("sharded", optimizers=len(optimizer_states), checkpoint=checkpoint)
        if context.plan is not None:
            context.plan.save(tmp / layout.PLAN)
            manifest.plan = layout.PLAN
        if context.profile is not None:
            (tmp / layout.PROFILE).write_text(json.dumps(context.profile.to_dict(), indent=1) + "\n")
            manifest.profile = layout.PROFILE
        layout.write_manifest(tmp, manifest)
        layout.commit(tmp, path)

    # Every rank waits for the rename: a rank that loads or lists checkpoints right after must find it in place.
    _dist.on_rank_zero(finish, f"saving checkpoint {str(path)!r}")
    return path


# ---------------------------------------------------------------------------------------------- load
def open_sharded_checkpoint(path: str | Path) -> dict[str, Any]:
    """Lightning's checkpoint dict of a sharded checkpoint directory, with the tensors left on disk.

    Checks that the save completed (the manifest, every file's size) and returns ``meta.pt``'s content, with
    :class:`ShardedState` references as ``"state_dict"`` and ``"optimizer_states"``, and the manifest as
    ``"osdp"``. Reads no tensor; no collective.

    Raises:
        IncompleteCheckpointError: the save did not complete, or files were lost since.
    """
    path = Path(path)
    if not path.exists():
        raise layout.missing_checkpoint_error(path)
    manifest = layout.read_manifest(path)
    checkpoint: dict[str, Any] = torch.load(path / layout.META, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = ShardedState(path, MODEL_KEY)
    if manifest.optimizers:
        checkpoint["optimizer_states"] = [ShardedState(path, _optimizer_key(i)) for i in range(manifest.optimizers)]
    checkpoint["osdp"] = manifest.to_dict()
    return checkpoint


def _read_dcp_metadata(path: Path) -> Metadata:
    """DCP's index of a checkpoint directory (every key's global shape and chunks)."""
    return FileSystemReader(path).read_metadata()


def _saved_shapes(metadata: Metadata, prefix: str) -> dict[str, tuple[int, ...]]:
    """Tensor keys under ``prefix.`` in a DCP index -> global shapes."""
    head = prefix + "."
    return {
        key[len(head) :]: tuple(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(head) and isinstance(md, TensorStorageMetadata)
    }


def load_sharded_model_state(module: nn.Module, state: ShardedState, *, strict: bool = True) -> None:
    """Load the model state referenced by ``state`` into ``module`` in place, resharding as needed.

    A collective. Keys and shapes are checked first against the checkpoint's index, so that a checkpoint of another
    model fails with a :class:`~lightning_osdp.checkpoint.CheckpointMismatchError` that names the keys.
    """
    slices = SliceMap.of(module)
    metadata = _read_dcp_metadata(state.path)
    target: dict[str, Any] = get_model_state_dict(module)
    expected = slices.canonical_shapes({k: v.shape for k, v in target.items()})
    saved = _saved_shapes(metadata, state.key)
    check_model_keys(expected, saved, strict=strict, source=repr(str(state.path)))
    if not strict:
        target = {k: v for k, v in target.items() if slices.canonical(k) in saved}
    dcp.load(
        {state.key: target},
        storage_reader=FileSystemReader(state.path),
        planner=SliceLoadPlanner(slices, allow_partial_load=not strict),
    )
    set_model_state_dict(module, target, options=StateDictOptions(strict=strict))


def load_sharded_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: ShardedState, *, index: int = 0
) -> None:
    """Load the optimizer state referenced by ``state`` into ``optimizer`` (a collective), resharding as needed.

    Parameter-group hyper-parameters (learning rate, betas...) come from the checkpoint, as
    ``Optimizer.load_state_dict`` restores them under DDP.
    """
    slices = SliceMap.of(module)
    metadata = _read_dcp_metadata(state.path)
    # The template of what to read; on an optimizer without state this runs a zero-gradient step to create it
    # (see `sharded_optimizer_state`), which the load below overwrites.
    if not optimizer.state:
        # That zero-gradient step only runs on parameters without gradients: gradients left by an earlier `fit` of
        # the same model would leave the template empty. Loading replaces the state anyway; drop them.
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
    target: dict[str, Any] = dict(get_optimizer_state_dict(module, optimizer))
    expected: dict[str, set[str]] = {}
    for name, entry in target["state"].items():
        expected.setdefault(slices.canonical(name), set()).update(entry)
    head = f"{state.key}.state."
    saved, unknown = split_state_keys(
        (key[len(head) :] for key in metadata.state_dict_metadata if key.startswith(head)), expected
    )
    check_optimizer_state(expected, saved, unknown, index=index, source=repr(str(state.path)))
    # Parameters that had no state when the checkpoint was saved get none now (`load_state_dict` drops it).
    target["state"] = {n: v for n, v in target["state"].items() if slices.canonical(n) in saved}
    box = {state.key: target}
    dcp.load(box, storage_reader=FileSystemReader(state.path), planner=SliceLoadPlanner(slices))
    loaded = box[state.key]
    loaded["param_groups"] = slices.sliced_param_groups(loaded["param_groups"])
    with keep_group_types(optimizer):
        set_optimizer_state_dict(module, optimizer, loaded)


def read_sharded_tensors(path: str | Path, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """Every tensor of a sharded checkpoint, unsharded, in this process's memory, with no process group.

    Returns the nested DCP state: ``{"state_dict": {...}, "optimizer_0": {"state": ..., "param_groups": ...}}``,
    restricted to the top-level ``keys`` when given. For consolidation and inspection: it holds the whole model
    (and optimizer state) in memory at once.
    """
    # NOTE: private DCP helpers, as in `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`: the public
    # `dcp.load` only fills keys the given state dict already has, and this one starts empty.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    if not path.exists():
        raise layout.missing_checkpoint_error(path)
    layout.read_manifest(path)
    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(path),
        planner=_EmptyStateDictLoadPlanner(keys=set(keys) if keys is not None else None),
        no_dist=True,
    )
    return state
