"""DCP planners that save and load split operators under the unsplit model's keys.

[Note: split operators in sharded checkpoints]
A module split into ``k`` slices holds ``k`` DTensors, each ``Shard(0)`` (or ``Replicate``) over the mesh on its
own: rank ``r`` owns a few rows of *each* slice, so its part of the unsplit weight ``fc.weight`` is ``k`` disjoint
row blocks. No DTensor placement describes that, and DCP saves one object per key. Three ways were considered:

* gather each split module to full on save (and cut it on load): simple, but the largest operators, the ones the
  planner splits precisely to bound gathered memory, would be materialised whole on every rank, and their bytes
  written by one rank: save time and peak memory then scale with the model, not the shard;
* a ``ShardedTensor`` holding the ``k`` blocks as local shards: DCP saves it, but ``ShardedTensor`` is deprecated
  and replicated slices would need overlapping shards, which it forbids;
* translate at the planner, DCP's documented extension point (chosen). The state dict keeps the live slice
  DTensors; :class:`SliceSavePlanner` renames each slice's write item to the unsplit key, shifts its chunk offset
  by the slice's first row and declares the unsplit global shape. DCP's metadata then describes ``fc.weight``
  exactly as if one DTensor had been sharded in row blocks: every rank writes only its own rows (replicated slices
  are de-duplicated by DCP as usual), and any reader, split or not, at any world size, finds ``fc.weight``.
  :class:`SliceLoadPlanner` does the inverse: each slice's local chunk is shifted into the unsplit tensor's
  coordinates, DCP's resharding computes the overlapping saved chunks, and the reads are pointed back at the
  slice. Per-slice scalars (Adam's ``step``) are equal across slices: saved once, read into every slice.

The on-disk format is therefore plain DCP: ``dcp_to_torch_save``, ``_EmptyStateDictLoadPlanner`` and any other
DCP reader see the model's own keys and never the slices.

[Note: buffers are saved from rank 0]
A tensor every rank holds whole (a buffer, a DDP-replicated parameter) is written once: DCP's de-duplication gives
it to whichever rank has the least planned so far, rank 1 as often as rank 0. For a replicated parameter that is
right (the ranks' copies are equal), not for a buffer: each training forward updates every rank's buffers from its
own batch (BatchNorm's running statistics), and the ranks hold the same values only after the broadcast from rank 0
that precedes the next training forward (``apply/buffers.py``, DDP's semantics). Rank 0's are the buffers training
goes on with, the ones a full checkpoint and Lightning's DDP save, so :class:`SliceSavePlanner` leaves the keys it is
given as ``from_rank_zero`` out of every other rank's plan: the de-duplication then finds rank 0's alone. Forcing
every replicated tensor to rank 0 instead (DCP's ``dedup_save_to_lowest_rank``) would put all of a mixed plan's DDP
parameters on rank 0's writer; buffers are small.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_osdp import distributed
from lightning_osdp._compat import dcp_chunk_list
from lightning_osdp.apply.state_dict import SliceAlias, SliceMap
from lightning_osdp.checkpoint.errors import CheckpointMismatchError

__all__ = ["SliceLoadPlanner", "SliceSavePlanner"]


def _join(path: tuple[Any, ...]) -> str:
    # DCP's flattened key is the nested path joined by dots (`flatten_state_dict`).
    return ".".join(map(str, path))


def _shift(offsets: torch.Size, rows: int) -> torch.Size:
    return torch.Size([offsets[0] + rows, *offsets[1:]])


def _whole(item: WriteItem) -> bool:
    """Whether ``item`` writes a tensor whole (this rank holds all of it), so that rank 0's item writes it all too."""
    data = item.tensor_data
    return data is not None and tuple(data.chunk.sizes) == tuple(data.size) and not any(data.chunk.offsets)


class SliceSavePlanner(DefaultSavePlanner):
    """:class:`DefaultSavePlanner` that writes split slices under the unsplit keys (see [Note: split operators in
    sharded checkpoints]) and the keys ``from_rank_zero`` (DCP's flattened keys of the model's buffers) from rank 0
    alone (see [Note: buffers are saved from rank 0])."""

    def __init__(self, slices: SliceMap, *, from_rank_zero: Collection[str] = ()) -> None:
        super().__init__()
        self._slices = slices
        self._from_rank_zero = frozenset(from_rank_zero)
        self._renamed: dict[str, tuple[str, SliceAlias]] = {}
        # (unsplit key, offset in the unsplit tensor) -> the slice item's own index, to find the data again.
        self._origin: dict[tuple[str, torch.Size | None], MetadataIndex] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        mappings: dict[str, Any] = {}
        for key, path in self.mappings.items():
            found = self._slices.alias_in_path(path)
            if found is None:
                mappings[key] = path
                continue
            canonical_path, alias = found
            self._renamed[key] = (_join(canonical_path), alias)
            # DCP stores these mappings as `planner_data`: readers rebuild nested dicts from them.
            mappings[_join(canonical_path)] = canonical_path
        self.mappings = mappings

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        others = distributed.rank() != 0
        for item in plan.items:
            if others and item.index.fqn in self._from_rank_zero and _whole(item):
                continue  # rank 0's copy is the one written
            renamed = self._renamed.get(item.index.fqn)
            if renamed is None:
                items.append(item)
                continue
            key, alias = renamed
            data = item.tensor_data
            if data is None:
                raise CheckpointMismatchError(f"{item.index.fqn}: a split parameter's state must be a tensor")
            if len(data.size) == 0:
                # A per-parameter scalar (Adam's `step`): the same for every slice of one operator, saved once.
                if alias.index == 0:
                    index = MetadataIndex(key, item.index.offset)
                    items.append(dataclasses.replace(item, index=index))
                    self._origin[(key, item.index.offset)] = item.index
                continue
            if data.size[0] != alias.rows:
                raise CheckpointMismatchError(
                    f"{item.index.fqn}: state of shape {tuple(data.size)} is not cut like its parameter "
                    f"({alias.rows} rows); only row-shaped states (momentum, Adam moments) of split operators "
                    "can be saved"
                )
            if data.chunk.sizes.numel() == 0:
                # An empty shard (more ranks than rows) starts where the next slice does: it must not be written.
                continue
            offsets = _shift(data.chunk.offsets, alias.row_offset)
            index = MetadataIndex(key, offsets)
            self._origin[(key, offsets)] = item.index
            items.append(
                dataclasses.replace(
                    item,
                    index=index,
                    tensor_data=dataclasses.replace(
                        data,
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=data.chunk.sizes),
                        size=torch.Size([alias.full_rows, *data.size[1:]]),
                    ),
                )
            )
        plan = dataclasses.replace(plan, items=items)
        self.plan = plan
        return plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        origin = self._origin.get((index.fqn, index.offset))
        return super().lookup_object(origin if origin is not None else index)


class SliceLoadPlanner(DefaultLoadPlanner):
    """:class:`DefaultLoadPlanner` that reads the unsplit keys into split slices (see the module's Note)."""

    def __init__(self, slices: SliceMap, *, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self._slices = slices
        self._renamed: dict[str, tuple[str, SliceAlias]] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key, path in self.mappings.items():
            found = self._slices.alias_in_path(path)
            if found is not None:
                self._renamed[key] = (_join(found[0]), found[1])

    def create_local_plan(self) -> LoadPlan:
        # NOTE: DefaultLoadPlanner.create_local_plan would take the slice keys, absent from the checkpoint, for a
        # pre-2.4 DCP layout; plain keys go to DCP's own function, slice keys are planned here.
        assert self.metadata is not None
        strict = not self.allow_partial_load
        plain = {k: v for k, v in self.state_dict.items() if k not in self._renamed}
        requests: list[ReadItem] = list(create_default_local_load_plan(plain, self.metadata, strict).items)
        for key, (canonical, alias) in self._renamed.items():
            target = self.state_dict[key]
            md = self.metadata.state_dict_metadata.get(canonical)
            if md is None:
                if strict:
                    raise CheckpointMismatchError(f"missing from the checkpoint: {canonical}")
                continue
            if not isinstance(md, TensorStorageMetadata) or not isinstance(target, torch.Tensor):
                raise CheckpointMismatchError(f"{canonical}: the checkpoint holds no tensor for this key")
            if target.dim() == 0:
                chunks = dcp_chunk_list(target)
                reads = create_read_items_for_chunk_list(canonical, md, chunks)
                requests.extend(
                    dataclasses.replace(r, dest_index=MetadataIndex(key, r.dest_index.offset, r.dest_index.index))
                    for r in reads
                )
                continue
            expected = torch.Size([alias.full_rows, *target.shape[1:]])
            if md.size != expected:
                raise CheckpointMismatchError(
                    f"{canonical}: checkpoint shape {tuple(md.size)}, model shape {tuple(expected)}"
                )
            local = [
                ChunkStorageMetadata(offsets=_shift(c.offsets, alias.row_offset), sizes=c.sizes)
                for c in dcp_chunk_list(target)
                if c.sizes.numel() > 0
            ]
            for read in create_read_items_for_chunk_list(canonical, md, local):
                assert read.dest_index.offset is not None
                offset = _shift(read.dest_index.offset, -alias.row_offset)
                requests.append(dataclasses.replace(read, dest_index=MetadataIndex(key, offset, read.dest_index.index)))
        return LoadPlan(requests)
