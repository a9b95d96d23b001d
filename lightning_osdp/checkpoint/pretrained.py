"""Pretrained weights into a sharded model, each rank reading only what its plan keeps.

[Note: reading only the shards]
A user fine-tuning a pretrained model starts from a full checkpoint: a plain ``state_dict`` file, a Lightning
``.ckpt`` (``osdp consolidate``'s output is one), or a Hugging Face folder of ``*.safetensors``. Loading one the usual
way (``load_state_dict`` of the whole dict on every rank, or rank 0 reading it and broadcasting, as
``set_model_state_dict(..., broadcast_from_rank0=True)`` does) holds the whole model in one process's memory at
once. Here every rank reads, tensor by tensor, only the rows of its own shards (FSDP2 shards dim 0) and replicated
tensors whole: a ``torch.save`` file through ``torch.load(mmap=True, weights_only=True)``, whose tensors are views of
the mapped file (a page is read when its rows are copied), and safetensors through their own lazy slices
(``safe_open(...).get_slice``), which read exactly the rows asked for. No collective is needed: every rank reads the
same file (on a shared or copied file system, as DCP's sharded checkpoints need too).

Torch's DCP reader for Hugging Face files (``HuggingFaceStorageReader``) resolves a DTensor's chunks as well, but
it loads into whole tensors of a state dict; a parameter split by the plan is several slices of one checkpoint
tensor (``lightning_osdp.apply.state_dict.SliceMap``), so the rows are read here, through the slices' map.

Keys: the checkpoint's keys are matched with the model's own (unsplit) keys; when they do not all match, a prefix
of the model's keys under which all of them do is looked for (the weights of ``self.model`` in a LightningModule
saved by ``self.model.save_pretrained`` or ``torch.save(self.model.state_dict())``), or given as ``prefix``. A
model key the checkpoint lacks is an error when ``strict`` (Lightning's ``strict_loading``) unless its tensor is
tied to one that was loaded (an LM head tied to the embedding); otherwise it keeps its initialization.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_osdp.apply.materialize import still_uninitialized
from lightning_osdp.apply.state_dict import SliceMap
from lightning_osdp.checkpoint.errors import CheckpointError, CheckpointMismatchError
from lightning_osdp.checkpoint.unpickle import weights_only_refusal

__all__ = ["PretrainedLoad", "initialize_weights", "load_pretrained"]


@dataclass
class PretrainedLoad:
    """What :func:`load_pretrained` did: the checkpoint, the prefix its keys were read under, the tensors loaded, the
    model's keys it lacks (left as initialized), and the bytes this rank read."""

    source: str
    prefix: str
    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    bytes_read: int = 0

    def describe(self) -> str:
        under = f" under the prefix {self.prefix!r}" if self.prefix else ""
        kept = f"; {len(self.missing)} kept their initialization: {', '.join(self.missing[:5])}" if self.missing else ""
        return f"loaded {self.loaded} tensors from {self.source}{under}{kept}"


class _Reader(Protocol):
    keys: list[str]

    def shape(self, key: str) -> tuple[int, ...]: ...

    def rows(self, key: str, start: int, stop: int) -> Tensor: ...


class _TorchFile:
    """A ``torch.save`` file, memory-mapped: tensors are views of the file."""

    def __init__(self, path: Path) -> None:
        try:
            content = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError as err:
            with open(path, "rb") as file:
                refusal = weights_only_refusal(err, file, path, "")
            raise (refusal or CheckpointError(f"cannot read pretrained weights {str(path)!r}: {err}")) from None
        except RuntimeError as err:
            raise CheckpointError(
                f"cannot read pretrained weights {str(path)!r} ({err}); a file written by torch.save (zip format) "
                "or a folder of .safetensors files is expected"
            ) from err
        state = content.get("state_dict", content) if isinstance(content, dict) else None
        if not isinstance(state, dict) or not any(isinstance(v, Tensor) for v in state.values()):
            raise CheckpointError(
                f"pretrained weights {str(path)!r}: no state dict found (a mapping of names to tensors, or a Lightning "
                "checkpoint's 'state_dict')"
            )
        self.state = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, Tensor)}
        self.keys = list(self.state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        tensor = self.state[key]
        return tensor if tensor.dim() == 0 else tensor[start:stop]


class _SafetensorsFiles:
    """The ``*.safetensors`` files of a folder (or one file), opened lazily: a slice reads only its rows."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                self._where[key] = handle
        self.keys = list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key].get_slice(key).get_shape())

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        part = self._where[key].get_slice(key)
        return part[:] if len(part.get_shape()) == 0 else part[start:stop]


@contextmanager
def _open(source: Path) -> Iterator[_Reader]:
    if not source.exists():
        raise CheckpointError(f"pretrained weights {str(source)!r} do not exist")
    files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
    if source.is_dir() and not files:
        raise CheckpointError(f"pretrained weights {str(source)!r}: a folder without .safetensors files")
    if files[0].suffix == ".safetensors":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise CheckpointError(
                f"pretrained weights {str(source)!r} are safetensors, which need the safetensors package: "
                "pip install safetensors (or lightning-osdp[hf])"
            ) from None
        with ExitStack() as stack:
            yield _SafetensorsFiles(files, stack)
        return
    yield _TorchFile(source)


def _local_rows(target: Tensor, rows: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a ``rows``-row tensor this rank holds of ``target`` (FSDP2's dim-0 shards, cut as
    ``torch.chunk`` cuts; all of them for a plain tensor)."""
    if not isinstance(target, DTensor):
        return 0, rows
    start, stop = 0, rows
    coordinate = target.device_mesh.get_coordinate()
    assert coordinate is not None  # this rank is in the mesh
    for dim, placement in enumerate(target.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise CheckpointError(f"a parameter sharded on dim {placement.dim}: only dim 0 is read by rows")
            chunk = math.ceil((stop - start) / target.device_mesh.size(dim))
            start = min(start + coordinate[dim] * chunk, stop)
            stop = min(start + chunk, stop)
    return start, stop


def _match_prefix(keys: list[str], model_keys: set[str], prefix: str | None, source: str) -> str:
    if prefix is not None:
        return prefix
    if all(k in model_keys for k in keys):
        return ""
    candidates: dict[str, int] = {}
    for key in keys:
        for name in model_keys:
            if name.endswith("." + key):
                candidates[name[: -len(key)]] = candidates.get(name[: -len(key)], 0) + 1
    full = [p for p, n in candidates.items() if all(p + k in model_keys for k in keys)]
    if len(full) == 1:
        return full[0]
    unknown = [k for k in keys if k not in model_keys][:5]
    hint = f" (prefixes that match some: {sorted(candidates)[:5]})" if candidates else ""
    raise CheckpointMismatchError(
        f"pretrained weights {source}: keys such as {unknown} are not the model's{hint}; pass "
        "OSDPStrategy(pretrained_prefix=...) to read them under a prefix of the model's names"
    )


def load_pretrained(
    module: nn.Module, source: str | os.PathLike[str], *, prefix: str | None = None, strict: bool = True
) -> PretrainedLoad:
    """Read the full checkpoint ``source`` into ``module`` (sharded or not), each rank reading only the rows of its
    shards (see [Note: reading only the shards]).

    Args:
        module: the model, after the plan was applied (its split and sharded parameters live).
        source: a ``torch.save`` file (a state dict, or a Lightning checkpoint with ``"state_dict"``), a
            ``.safetensors`` file, or a folder of them (a Hugging Face model folder).
        prefix: the prefix of the model's keys the checkpoint's keys are read under (default: found, see the Note).
        strict: a model key the checkpoint lacks is an error (unless tied to one it has).

    Raises:
        CheckpointError: the source cannot be read (or would run code: ``UntrustedContentError``).
        CheckpointMismatchError: keys or shapes that are not the model's.
    """
    path = Path(source)
    slices = SliceMap.of(module)
    targets: dict[str, list[tuple[str, Tensor]]] = {}  # canonical key -> (live key, tensor)
    for key, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, Tensor):
            targets.setdefault(slices.canonical(key), []).append((key, tensor))
    with _open(path) as reader:
        result = PretrainedLoad(str(path), _match_prefix(reader.keys, set(targets), prefix, repr(str(path))))
        loaded_storages: set[int] = set()
        wrong = []
        for key in reader.keys:
            name = result.prefix + key
            if name not in targets:
                raise CheckpointMismatchError(f"pretrained weights {str(path)!r}: {key!r} is not a key of the model")
            shape = reader.shape(key)
            for live, tensor in targets[name]:
                alias = slices.aliases.get(live)
                full = slices.canonical_shape(live, tensor.shape)
                if shape != tuple(full):
                    wrong.append(f"{key}: checkpoint {shape}, model {tuple(full)}")
                    continue
                offset = alias.row_offset if alias is not None and tensor.dim() > 0 else 0
                own_rows = tensor.shape[0] if tensor.dim() > 0 else 1
                start, stop = _local_rows(tensor, own_rows)
                value = reader.rows(key, offset + start, offset + stop)
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if local.numel() != value.numel():
                    raise CheckpointError(f"{live}: this rank holds {tuple(local.shape)}, rows {start}:{stop} read")
                with torch.no_grad():
                    local.copy_(value.reshape(local.shape))
                result.bytes_read += value.numel() * value.element_size()
                loaded_storages.add(id(tensor))
            result.loaded += 1
        if wrong:
            raise CheckpointMismatchError(f"pretrained weights {str(path)!r}: other shapes: {', '.join(wrong[:5])}")
    result.missing = sorted(
        name for name, live in targets.items() if not any(id(t) in loaded_storages for _, t in live)
    )
    if result.missing and strict:
        raise CheckpointMismatchError(
            f"pretrained weights {str(path)!r} lack {len(result.missing)} of the model's keys: "
            f"{', '.join(result.missing[:5])}; set strict_loading = False on the LightningModule to keep their "
            "initialization"
        )
    return result


def initialize_weights(
    module: nn.Module,
    uninitialized: list[str],
    *,
    pretrained: Path | None,
    prefix: str | None,
    resuming: bool,
) -> None:
    """After the plan is applied: pretrained weights into the shards, unless the run resumes (its checkpoint holds the
    weights), and a warning naming what neither a ``reset_parameters()`` nor the weights initialized.

    Args:
        module: the LightningModule, sharded and materialized (its ``strict_loading`` is honoured).
        uninitialized: the modules materialization left without an initializer (``root.uninitialized``).
        pretrained: the full checkpoint to start from (``OSDPStrategy(pretrained=...)``), or ``None``.
        prefix: the prefix the checkpoint's keys are read under (``None``: found).
        resuming: whether ``fit(ckpt_path=...)`` restores the weights after setup.
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    if resuming:
        return
    missing: set[str] | None = None
    if pretrained is not None:
        loaded = load_pretrained(
            module, pretrained, prefix=prefix, strict=bool(getattr(module, "strict_loading", True))
        )
        rank_zero_info(f"OSDP: {loaded.describe()}")
        missing = set(loaded.missing)
    unfilled = still_uninitialized(module, uninitialized, missing)
    if unfilled:
        rank_zero_warn(
            "OSDP: the model was built on the meta device and these modules have parameters or buffers that no "
            f"reset_parameters() initialized: {', '.join(unfilled)}. Their memory is uninitialized: define "
            "reset_parameters() on them, init_weights() on the model, or start from pretrained weights "
            "(OSDPStrategy(pretrained=...)); see docs/large-models.md"
        )
