"""Sharded checkpoints: every rank writes and reads only its own shards, with torch.distributed.checkpoint (DCP).

The model and optimizer states are taken as the live module holds them (DTensors, split slices under their slice
names) and translated to the unsplit model's keys by :mod:`lightning_osdp.checkpoint.planners` on the way to disk.
DCP reshards on load, so a checkpoint written under one plan and world size loads under any other: the keys are
the same, only the placements differ.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_osdp import distributed
from lightning_osdp._compat import dcp_load_into_empty
from lightning_osdp.apply.state_dict import SliceMap
from lightning_osdp.checkpoint import layout
from lightning_osdp.checkpoint.context import CheckpointContext
from lightning_osdp.checkpoint.errors import CheckpointError, IncompleteCheckpointError
from lightning_osdp.checkpoint.files import CheckpointDirectory, read_retrying
from lightning_osdp.checkpoint.integrity import checksumming_writer, verify_checksums, verify_shared, written_checksums
from lightning_osdp.checkpoint.keys import (
    check_model_keys,
    check_optimizer_state,
    keep_group_types,
    named_param_groups,
    split_state_keys,
)
from lightning_osdp.checkpoint.planners import SliceLoadPlanner, SliceSavePlanner
from lightning_osdp.checkpoint.unpickle import IndexedReader, load_torch_file, read_dcp_index

__all__ = [
    "MODEL_KEY",
    "ShardedState",
    "buffer_keys",
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
#: DCP's index of a checkpoint directory.
_INDEX = ".metadata"
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
        weights_only: read the checkpoint's pickles as plain data only (see :func:`open_sharded_checkpoint`).
        directory: the directory :func:`open_sharded_checkpoint` opened, read again when the tensors are loaded, so
            that they come from the save whose metadata was returned even if ``path`` was saved again since (see
            ``files``' [Note: reading a directory that may be replaced]); ``None``: ``path`` is opened then.
    """

    path: Path
    key: str
    weights_only: bool = True
    directory: CheckpointDirectory | None = field(default=None, compare=False, repr=False)

    def opened(self) -> CheckpointDirectory:
        """The directory to read the tensors from."""
        return self.directory if self.directory is not None else CheckpointDirectory(self.path)


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


def buffer_keys(module: nn.Module, state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` (the model state of :func:`sharded_model_state`) that hold ``module``'s buffers whole.

    Told apart by storage, not by name: ``get_model_state_dict`` names entries without the prefixes that wrappers
    (``torch.compile``'s ``_orig_mod``) add to ``named_buffers()``, and its buffer entries are detached views of the
    live buffers. A sharded tensor (a DTensor) is never one: each rank writes its own part of it."""
    storages = {b.untyped_storage().data_ptr() for b in module.buffers() if b.numel() > 0}
    return [
        key
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.numel() > 0
        and value.untyped_storage().data_ptr() in storages
    ]


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
    path = Path(distributed.broadcast(str(path)))
    tmp = layout.temporary_path(path, distributed.broadcast(layout.new_token()))
    distributed.from_rank_zero(lambda: layout.check_replaceable(path), what=f"saving checkpoint {str(path)!r}")
    slices = SliceMap.of(module)
    optimizer_states = list(checkpoint.get("optimizer_states", []))
    tensors: dict[str, Any] = {MODEL_KEY: checkpoint.get("state_dict", {})}
    for i, osd in enumerate(optimizer_states):
        tensors[_optimizer_key(i)] = {**osd, "param_groups": slices.canonical_param_groups(osd["param_groups"])}
    # DCP's collectives end with the coordinator's `finish` (it writes `.metadata` after gathering every rank's
    # write results), so once `save` returns on rank 0 every rank's shard file is complete and synced. A failure is
    # raised by DCP on every rank after that gather (a `CheckpointException` holding each rank's error), once no rank
    # writes any more: rank 0 then judges it and removes the partial save while the others wait, so that every rank
    # raises the same error with nothing left on disk.
    writer = checksumming_writer(tmp)
    # Buffers are written from rank 0: the values training goes on with (see planners' [Note: buffers are saved from
    # rank 0]).
    from_rank_zero = [f"{MODEL_KEY}.{key}" for key in buffer_keys(module, tensors[MODEL_KEY])]
    try:
        dcp.save(tensors, storage_writer=writer, planner=SliceSavePlanner(slices, from_rank_zero=from_rank_zero))
    except CheckpointException as err:
        failure = err

        def discard() -> bool:
            full = layout.no_room(failure, path.parent)
            layout.discard(tmp)
            return full

        full = distributed.from_rank_zero(discard, what=f"removing the failed save of {str(path)!r}")
        raise layout.save_error(path, err, full=full) from err
    # Each rank's checksums of the files it wrote, for the manifest (see `integrity`'s [Note: checksums]).
    checksums = {
        name: crc for share in distributed.all_gather(written_checksums(writer)) for name, crc in share.items()
    }

    def finish() -> None:
        try:
            meta = {k: v for k, v in checkpoint.items() if k not in _TENSOR_ENTRIES}
            torch.save(meta, tmp / layout.META)
            manifest = context.manifest("sharded", optimizers=len(optimizer_states), checkpoint=checkpoint)
            if context.plan is not None:
                context.plan.save(tmp / layout.PLAN)
                manifest.plan = layout.PLAN
            if context.profile is not None:
                (tmp / layout.PROFILE).write_text(json.dumps(context.profile.to_dict(), indent=1) + "\n")
                manifest.profile = layout.PROFILE
            layout.write_manifest(tmp, manifest, checksums)
            layout.commit(tmp, path)
        except Exception as err:
            full = layout.no_room(err, path.parent)
            layout.discard(tmp)
            raise layout.save_error(path, err, full=full) from err

    # Every rank waits for the rename: a rank that loads or lists checkpoints right after must find it in place.
    distributed.from_rank_zero(finish, what=f"saving checkpoint {str(path)!r}")
    return path


# ---------------------------------------------------------------------------------------------- load
def open_sharded_checkpoint(path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
    """Lightning's checkpoint dict of a sharded checkpoint directory, with the tensors left on disk.

    Opens the directory once and reads every file relative to it, never through a symbolic link (see ``files``).
    Checks that the save completed (the manifest, every file's size), that no file changed since (their checksums:
    ``meta.pt`` and DCP's index on the bytes read, the shards each rank a share: a collective when a process group
    is initialised, in which the ranks also check that they opened the same save) and that DCP's index refers only to
    those files, within their sizes; then returns ``meta.pt``'s content, with :class:`ShardedState` references as
    ``"state_dict"`` and ``"optimizer_states"`` (holding the open directory), and the manifest as ``"osdp"``. Reads
    no tensor.

    Args:
        weights_only: create only plain data and tensors from the checkpoint's pickles (``meta.pt``, DCP's index and
            items); ``False`` trusts the checkpoint (see ``unpickle``'s [Note: pickles in a checkpoint]).

    Raises:
        IncompleteCheckpointError: the save did not complete, or files were lost or truncated since.
        CorruptCheckpointError: a file's content changed since the save.
        CheckpointReplacedError: the checkpoint was replaced by a newer save while it was being read.
        UntrustedContentError: ``meta.pt`` needs more than plain data and ``weights_only`` is set.
        CheckpointError: a file is a symbolic link, or the index declares more data than the files hold.
    """
    directory = CheckpointDirectory(path)
    manifest = layout.read_manifest(directory)
    _require(directory.path, manifest, (layout.META, _INDEX))
    read_whole = (layout.META, _INDEX)
    verify_shared(directory, manifest, [name for name in manifest.checksums if name not in read_whole])
    read_index(directory, manifest, weights_only=weights_only)
    checkpoint = load_torch_file(
        _read_listed(directory, manifest, layout.META), weights_only=weights_only, what=layout.META, source=path
    )
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{layout.META} of checkpoint {str(path)!r} does not hold Lightning's checkpoint dict")
    checkpoint["state_dict"] = ShardedState(directory.path, MODEL_KEY, weights_only, directory)
    if manifest.optimizers:
        checkpoint["optimizer_states"] = [
            ShardedState(directory.path, _optimizer_key(i), weights_only, directory) for i in range(manifest.optimizers)
        ]
    checkpoint["osdp"] = manifest.to_dict()
    return checkpoint


def _read_listed(directory: CheckpointDirectory, manifest: layout.Manifest, name: str) -> bytes:
    """File ``name`` of the checkpoint, checked against the size and checksum the manifest records for it."""
    return directory.read(name, size=manifest.files.get(name), checksum=manifest.checksums.get(name))


def _require(path: Path, manifest: layout.Manifest, names: Sequence[str]) -> None:
    missing = [name for name in names if name not in manifest.files]
    if missing:
        raise IncompleteCheckpointError(
            f"refusing to load checkpoint {str(path)!r}: its manifest lists no {', '.join(missing)}, which every "
            "sharded checkpoint has"
        )


def read_index(directory: CheckpointDirectory, manifest: layout.Manifest, *, weights_only: bool = True) -> Metadata:
    """DCP's index of the checkpoint ``directory`` holds (every key's global shape and chunks), read without running
    code from it and checked against its checksum, after checking that it places data only in files the manifest
    lists, within their sizes, that every tensor it declares is held by those bytes (so that nothing allocates more
    than the files hold), and that it holds the optimizer states the manifest counts.

    Raises:
        IncompleteCheckpointError: the index places data in a file that is not there, or past its end.
        UntrustedContentError: the index names other objects than an index holds.
        CheckpointError: the index declares a tensor larger than the bytes it locates for it.
    """
    path = directory.path
    _require(path, manifest, (_INDEX,))
    index = read_dcp_index(_read_listed(directory, manifest, _INDEX), source=path, weights_only=weights_only)
    outside: dict[str, str] = {}
    truncated: dict[str, str] = {}
    if not isinstance(index.storage_data, dict) or not isinstance(index.state_dict_metadata, dict):
        raise CheckpointError(f"DCP's index of checkpoint {str(path)!r} is damaged: it locates no data")
    for item, where in index.storage_data.items():
        name, offset, length = (getattr(where, a, None) for a in ("relative_path", "offset", "length"))
        fqn = getattr(item, "fqn", "?")
        if not isinstance(name, str) or name not in manifest.files:
            outside.setdefault(repr(name), fqn)
        elif not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise CheckpointError(
                f"DCP's index of checkpoint {str(path)!r} is damaged: it places {fqn!r} in {name} at offset "
                f"{offset!r}, length {length!r}"
            )
        elif offset + length > manifest.files[name]:
            truncated.setdefault(
                name, f"{fqn!r} at bytes {offset}-{offset + length}, the file has {manifest.files[name]}"
            )
    if outside:
        shown = ", ".join(f"{name} (for {fqn!r})" for name, fqn in sorted(outside.items()))
        raise IncompleteCheckpointError(
            f"refusing to load checkpoint {str(path)!r}: its index places data in {shown}, not a file of the "
            "checkpoint: a shard was lost, or deleted with its entry in the manifest"
        )
    if truncated:
        shown = ", ".join(f"{name} (its index places {where})" for name, where in sorted(truncated.items()))
        raise IncompleteCheckpointError(
            f"refusing to load checkpoint {str(path)!r}: {shown}: the file is truncated. Load another checkpoint"
        )
    for key, md in index.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            _check_tensor_extent(path, index, key, md)
    found = {key.split(".", 1)[0] for key in index.state_dict_metadata if key.startswith("optimizer_")}
    counted = {_optimizer_key(i) for i in range(manifest.optimizers)}
    if not counted <= found:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its manifest says it holds {manifest.optimizers} optimizer states, its index "
            f"holds {len(found)} ({', '.join(sorted(found)) or 'none'})"
        )
    return index


def _check_tensor_extent(path: Path, index: Metadata, key: str, md: TensorStorageMetadata) -> None:
    """Raise unless tensor ``key`` of the index is covered by chunks inside its shape whose stored bytes hold its
    elements: a reader allocates the declared shape (``consolidate`` the whole of it), so the shape is bounded by the
    files' sizes, which the manifest vouches for."""
    from lightning_osdp.budget import format_bytes

    size = tuple(md.size) if isinstance(md.size, Sequence) else None
    dtype = getattr(md.properties, "dtype", None)
    if size is None or not all(isinstance(d, int) and d >= 0 for d in size) or not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"DCP's index of checkpoint {str(path)!r} is damaged: {key!r} has shape {md.size!r}")
    itemsize = dtype.itemsize
    covered = stored = 0
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        inside = len(offsets) == len(sizes) == len(size) and all(
            isinstance(o, int) and isinstance(n, int) and o >= 0 and n >= 0 and o + n <= d
            for o, n, d in zip(offsets, sizes, size, strict=True)
        )
        where = index.storage_data.get(MetadataIndex(key, chunk.offsets)) if inside else None
        if where is None:
            raise CheckpointError(
                f"DCP's index of checkpoint {str(path)!r} is damaged: {key!r} of shape {size} has a chunk at "
                f"{offsets} of size {sizes}, which lies outside it or has no data"
            )
        elements = math.prod(sizes)
        covered += elements
        stored += where.length
        if not getattr(where, "transform_descriptors", None) and elements * itemsize > where.length:
            stored = -1  # this chunk's bytes cannot hold its elements
    if covered < math.prod(size) or stored < 0:
        declared = math.prod(size) * itemsize
        raise CheckpointError(
            f"refusing to load checkpoint {str(path)!r}: DCP's index declares {key!r} of shape {size} "
            f"{str(dtype).removeprefix('torch.')} ({format_bytes(declared)}), but its chunks locate "
            f"{max(stored, 0)} bytes of it in the checkpoint's files: the index is damaged, or was made to exhaust "
            "memory. Load another checkpoint"
        )


def _load(
    state: dict[str, Any],
    state_ref: ShardedState,
    directory: CheckpointDirectory,
    index: Metadata,
    planner: SliceLoadPlanner,
) -> None:
    """``dcp.load`` of ``state_ref``'s checkpoint, its failures raised as :class:`CheckpointError` naming the checkpoint
    (our own errors, raised by the planner, as they are)."""
    reader = IndexedReader(directory, index, weights_only=state_ref.weights_only)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointException as err:
        raise _unwrapped(err, state_ref.path) from None


def _unwrapped(err: CheckpointException, path: Path) -> CheckpointError:
    """The error DCP gathered from the ranks: ours if it is one, else a :class:`CheckpointError` naming the checkpoint
    and the first rank's error."""
    failures = [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
    for failure in failures:
        if isinstance(failure, CheckpointError):
            return failure
    first = failures[0] if failures else err
    return CheckpointError(f"reading checkpoint {str(path)!r} failed: {type(first).__name__}: {first}")


def saved_model_shapes(directory: CheckpointDirectory, manifest: layout.Manifest) -> dict[str, tuple[int, ...]]:
    """The model's keys -> global shapes in a checkpoint directory, from its index (no tensor is read)."""
    return _saved_shapes(read_index(directory, manifest), MODEL_KEY)


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
    directory = state.opened()
    metadata = read_index(directory, layout.read_manifest(directory), weights_only=state.weights_only)
    target: dict[str, Any] = get_model_state_dict(module)
    expected = slices.canonical_shapes({k: v.shape for k, v in target.items()})
    saved = _saved_shapes(metadata, state.key)
    check_model_keys(expected, saved, strict=strict, source=repr(str(state.path)))
    if not strict:
        target = {k: v for k, v in target.items() if slices.canonical(k) in saved}
    _load({state.key: target}, state, directory, metadata, SliceLoadPlanner(slices, allow_partial_load=not strict))
    set_model_state_dict(module, target, options=StateDictOptions(strict=strict))


def load_sharded_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: ShardedState, *, index: int = 0
) -> None:
    """Load the optimizer state referenced by ``state`` into ``optimizer`` (a collective), resharding as needed.

    Parameter-group hyper-parameters (learning rate, betas...) come from the checkpoint, as
    ``Optimizer.load_state_dict`` restores them under DDP.
    """
    slices = SliceMap.of(module)
    directory = state.opened()
    metadata = read_index(directory, layout.read_manifest(directory), weights_only=state.weights_only)
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
    _load(box, state, directory, metadata, SliceLoadPlanner(slices))
    loaded = box[state.key]
    loaded["param_groups"] = slices.sliced_param_groups(loaded["param_groups"])
    with keep_group_types(optimizer):
        set_optimizer_state_dict(module, optimizer, loaded)


def read_sharded_tensors(
    path: str | Path | CheckpointDirectory,
    keys: Sequence[str] | None = None,
    *,
    weights_only: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Every tensor of a sharded checkpoint, unsharded, in this process's memory, with no process group.

    Returns the nested DCP state: ``{"state_dict": {...}, "optimizer_0": {"state": ..., "param_groups": ...}}``,
    restricted to the top-level ``keys`` when given. For consolidation and inspection: it holds the whole model
    (and optimizer state) in memory at once. The files are checked as :func:`open_sharded_checkpoint` checks them,
    all in this process (``verify=False``: the shards' checksums are not, the caller checked them). ``path`` may be a
    :class:`~lightning_osdp.checkpoint.CheckpointDirectory` already open. A checkpoint replaced by a newer save while
    it is read (``last.ckpt`` of a running training) is read again, up to 5 times (see ``files``' [Note: reading a
    directory that may be replaced]).
    """
    if isinstance(path, CheckpointDirectory):
        directory = path
        return _read_tensors(directory, layout.read_manifest(directory), keys, weights_only=weights_only, verify=verify)

    def read() -> dict[str, Any]:
        with CheckpointDirectory(path) as directory:
            manifest = layout.read_manifest(directory)
            return _read_tensors(directory, manifest, keys, weights_only=weights_only, verify=verify)

    return read_retrying(read)


def _read_tensors(
    directory: CheckpointDirectory,
    manifest: layout.Manifest,
    keys: Sequence[str] | None,
    *,
    weights_only: bool,
    verify: bool,
) -> dict[str, Any]:
    if verify:
        verify_checksums(directory, manifest, [name for name in manifest.checksums if name != _INDEX])
    index = read_index(directory, manifest, weights_only=weights_only)
    state: dict[str, Any] = {}
    # The public `dcp.load` only fills keys the given state dict already has, and this one starts empty.
    try:
        dcp_load_into_empty(state, IndexedReader(directory, index, weights_only=weights_only), keys)
    except CheckpointException as err:
        raise _unwrapped(err, directory.path) from None
    return state
