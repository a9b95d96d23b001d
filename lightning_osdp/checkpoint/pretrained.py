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

[Note: checked before profiling]
Everything that decides whether a checkpoint fits the model is in the files' headers (safetensors' JSON header; a
``torch.save`` file's pickle, loaded ``mmap=True``, whose tensors are views of the unread file) and in the model's
shapes and dtypes, which a model built on the meta device has too. :func:`validate_pretrained` checks it all (keys
missing and extra, shapes, dtypes, a key in two files, headers that cannot be read, pickles refused) before the
strategy profiles and solves, so that bad weights fail in seconds, not after the plan; :func:`load_pretrained` runs
the same check (:func:`_fit`, the one place it is decided) before it copies a row. A dtype other than the
parameter's is an error (``int64`` copied into ``float32`` trains on garbage; ``float16`` into ``float32`` is a
silent precision change) unless the caller opts in with ``cast`` (``OSDPStrategy(pretrained_cast=True)``), which
casts between dtypes of one kind only, floating point to floating point (or integer to integer): no cast turns an
integer tensor into weights.

[Note: links in a pretrained folder]
The path given is the user's: a link there (to a folder or a file) is followed. The ``*.safetensors`` entries of a
folder are not: each is opened by its resolved path, which must be a regular file inside the folder (resolved), or,
when the folder is a snapshot of a Hugging Face cache (``.../models--ORG--NAME/snapshots/REV``), inside that
``models--ORG--NAME`` directory, where the snapshot's links lead (``../../blobs/SHA``). A link anywhere else (a file
outside, ``/etc/passwd``) is refused before it is opened, naming the link and its target.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
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

__all__ = ["PretrainedLoad", "check_before_setup", "initialize_weights", "load_pretrained", "validate_pretrained"]


@dataclass
class PretrainedLoad:
    """What :func:`load_pretrained` did (or :func:`validate_pretrained` found it would do): the checkpoint, the prefix
    its keys are read under, the tensors loaded, those of them cast to the model's dtype, the model's keys it lacks
    (left as initialized), and the bytes this rank read."""

    source: str
    prefix: str
    loaded: int = 0
    cast: int = 0
    missing: list[str] = field(default_factory=list)
    bytes_read: int = 0

    def describe(self, verb: str = "loaded") -> str:
        under = f" under the prefix {self.prefix!r}" if self.prefix else ""
        cast = f" ({self.cast} cast to the model's dtypes)" if self.cast else ""
        kept = f"; {len(self.missing)} kept their initialization: {', '.join(self.missing[:5])}" if self.missing else ""
        return f"{verb} {self.loaded} tensors from {self.source}{under}{cast}{kept}"


@dataclass(frozen=True)
class _Stored:
    """A checkpoint tensor as its file's header describes it; ``file``: its file's name within a folder (``None`` for
    a single-file checkpoint), for messages."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str | None = None


class _Reader(Protocol):
    tensors: dict[str, _Stored]

    def rows(self, key: str, start: int, stop: int) -> Tensor: ...


class _TorchFile:
    """A ``torch.save`` file, memory-mapped: tensors are views of the file (their shapes and dtypes read, their data
    not until a row is copied)."""

    def __init__(self, path: Path) -> None:
        try:
            content = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:
            with open(path, "rb") as file:
                refusal = weights_only_refusal(err, file, path, "", advice=_pickle_advice(path))
            if refusal is not None:
                raise refusal from None
            raise CheckpointError(
                f"cannot read pretrained weights {str(path)!r} ({type(err).__name__}: {err}); a file written by "
                "torch.save (zip format), a .safetensors file or a folder of them is expected"
            ) from err
        state = content.get("state_dict", content) if isinstance(content, dict) else None
        if not isinstance(state, dict) or not any(isinstance(v, Tensor) for v in state.values()):
            raise CheckpointError(
                f"pretrained weights {str(path)!r}: no state dict found (a mapping of names to tensors, or a Lightning "
                "checkpoint's 'state_dict')"
            )
        self.state = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, Tensor)}
        self.tensors = {k: _Stored(tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        tensor = self.state[key]
        return tensor if tensor.dim() == 0 else tensor[start:stop]


def _pickle_advice(path: Path) -> Callable[[str], str]:
    """What a user can do about a ``pretrained=`` file whose pickle names classes ``weights_only=True`` does not create
    (the advice of :func:`~lightning_osdp.checkpoint.unpickle.weights_only_refusal`, for ``pretrained=``, which has no
    ``weights_only`` switch)."""

    def advice(shown: str) -> str:
        return (
            f"OSDPStrategy(pretrained=...) reads only plain data and tensors, and has no switch to trust a file. "
            f"Either allow these classes in every process before fit, with torch.serialization.add_safe_globals("
            f"[{shown}]) at the top of the script, or, if the file comes from a source you trust, save its weights "
            f"alone and pass that file: torch.save(torch.load({str(path)!r}, weights_only=False)['state_dict'], "
            "'weights.pt')"
        )

    return advice


#: safetensors' dtype names (its format's ``dtype`` field), by the torch dtype they are; those this torch lacks drop.
_SAFETENSORS_DTYPES = {
    name: getattr(torch, attribute)
    for name, attribute in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "C64": "complex64",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16",
        "U32": "uint32", "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }.items()
    if hasattr(torch, attribute)
}  # fmt: skip
#: The largest header safetensors itself reads (its ``MAX_HEADER_SIZE``).
_MAX_HEADER_BYTES = 100_000_000


def _safetensors_header(path: Path, name: str, shown: Path) -> dict[str, _Stored]:
    """The tensors of the safetensors file ``path`` (``shown`` in messages; ``name`` recorded as each tensor's file),
    from its header, checked as safetensors checks it when it opens the file: a header that parses, entries that are
    tensors, and data offsets that cover the rest of the file exactly (a truncated download fails here)."""

    def damaged(why: str) -> CheckpointError:
        return CheckpointError(f"pretrained weights file {str(shown)!r} is not a readable safetensors file: {why}")

    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            length = int.from_bytes(file.read(8), "little") if size >= 8 else None
            if length is None or length > _MAX_HEADER_BYTES or 8 + length > size:
                raise damaged(
                    f"its {size} bytes do not hold the header its first 8 bytes announce "
                    "(truncated by an interrupted download or copy?)"
                )
            raw = file.read(length)
    except OSError as err:
        raise CheckpointError(f"cannot read pretrained weights file {str(shown)!r}: {err}") from None

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        named = dict(pairs)
        if len(named) != len(pairs):
            twice = sorted({k for k, _ in pairs if [n for n, _ in pairs].count(k) > 1})
            raise damaged(f"its header names {', '.join(map(repr, twice[:5]))} more than once")
        return named

    try:
        header = json.loads(raw, object_pairs_hook=unique)
    except ValueError as err:  # UnicodeDecodeError and json's JSONDecodeError among them
        raise damaged(f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    tensors: dict[str, _Stored] = {}
    spans: list[tuple[int, int]] = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            start, stop = entry["data_offsets"]
            if not all(type(n) is int and n >= 0 for n in (*shape, start, stop)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise damaged(f"the entry of {key!r} is not a tensor safetensors reads: {str(entry)[:200]}") from None
        if stop - start != math.prod(shape) * dtype.itemsize:
            raise damaged(f"{key!r} ({dtype}, {shape}) spans {stop - start} bytes")
        spans.append((start, stop))
        tensors[key] = _Stored(shape, dtype, name)
    covered = 0
    for start, stop in sorted(spans):
        if start != covered:
            raise damaged("its tensors' data overlap or leave gaps")
        covered = stop
    data = size - 8 - length
    if covered != data:
        truncated = " (truncated by an interrupted download or copy?)" if covered > data else ""
        raise damaged(f"its header describes {covered} bytes of tensors, and {data} follow it{truncated}")
    return tensors


class _SafetensorsFiles:
    """The ``*.safetensors`` files of a folder (or one file): their tensors read from their headers, their rows
    through safetensors' lazy slices, each file opened at its first row read (a slice reads only its rows).

    Args:
        files: ``(path, name)`` of each file: the path it is opened by, and its name within the folder (``None``
            for a single file).
    """

    def __init__(self, files: list[tuple[Path, str | None]], source: Path, stack: ExitStack) -> None:
        self._source = source
        self._stack = stack
        self._path: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        self.tensors: dict[str, _Stored] = {}
        for path, name in files:
            shown = source / name if name is not None else source
            for key, stored in _safetensors_header(path, name or source.name, shown).items():
                first = self.tensors.get(key)
                if first is not None:
                    raise CheckpointMismatchError(
                        f"pretrained weights {str(source)!r}: {key!r} is in two files, "
                        f"{str(source / str(first.file))!r} and {str(shown)!r}; which one holds the weights is "
                        "not for the loader to guess (remove the stale file, e.g. one left by an earlier download)"
                    )
                self.tensors[key] = stored if name is not None else _Stored(stored.shape, stored.dtype)
                self._path[key] = path

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        path = self._path[key]
        try:
            handle = self._handles.get(path)
            if handle is None:
                from safetensors import safe_open

                handle = self._handles[path] = self._stack.enter_context(
                    safe_open(str(path), framework="pt", device="cpu")
                )
            part = handle.get_slice(key)
            return part[:] if len(part.get_shape()) == 0 else part[start:stop]
        except Exception as err:  # safetensors' SafetensorError, an OSError: the file changed since its header was read
            file = self.tensors[key].file
            raise CheckpointError(
                f"cannot read {key!r} of pretrained weights {str(self._source / file if file else self._source)!r}: "
                f"{type(err).__name__}: {err}"
            ) from err


def _folder_files(folder: Path) -> list[tuple[Path, str | None]]:
    """The ``*.safetensors`` files of ``folder``, each as ``(its resolved path, its name)``, every link among them
    checked to lead inside the folder, or inside the Hugging Face cache entry the folder is a snapshot of (see [Note:
    links in a pretrained folder])."""
    root = folder.resolve()
    snapshot = root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--")
    allowed = root.parent.parent if snapshot else root
    where = f"the folder or its Hugging Face cache entry {str(allowed)!r}" if snapshot else "the folder"
    files: list[tuple[Path, str | None]] = []
    for entry in sorted(folder.glob("*.safetensors")):
        try:
            target = entry.resolve()
        except (OSError, RuntimeError) as err:  # a loop of links (RuntimeError before Python 3.13)
            raise CheckpointError(
                f"pretrained weights {str(folder)!r}: {entry.name!r} cannot be resolved: {err}"
            ) from None
        if not target.is_relative_to(allowed):
            raise CheckpointError(
                f"pretrained weights {str(folder)!r}: {entry.name!r} is a link to {str(target)!r}, outside {where}; "
                "a link in a pretrained folder is followed only inside it (docs/large-models.md). Copy the file into "
                "the folder, or pass the file itself as pretrained="
            )
        if not target.is_file():
            what = f"a link to {str(target)!r}, which is not a file" if entry.is_symlink() else "not a file"
            raise CheckpointError(f"pretrained weights {str(folder)!r}: {entry.name!r} is {what}")
        files.append((target, entry.name))
    return files


@contextmanager
def _open(source: Path) -> Iterator[_Reader]:
    if not source.exists():
        raise CheckpointError(f"pretrained weights {str(source)!r} do not exist")
    files: list[tuple[Path, str | None]] = _folder_files(source) if source.is_dir() else [(source, None)]
    if not files:
        raise CheckpointError(f"pretrained weights {str(source)!r}: a folder without .safetensors files")
    if source.is_dir() or source.suffix == ".safetensors":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise CheckpointError(
                f"pretrained weights {str(source)!r} are safetensors, which need the safetensors package: "
                "pip install safetensors (or lightning-osdp[hf])"
            ) from None
        with ExitStack() as stack:
            yield _SafetensorsFiles(files, source, stack)
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


def _dtype_kind(dtype: torch.dtype) -> str:
    """The kind of values ``dtype`` holds; a cast keeps values only within one kind."""
    if dtype == torch.bool:
        return "boolean"
    if dtype.is_complex:
        return "complex"
    return "floating-point" if dtype.is_floating_point else "integer"


def _some(items: list[str], shown: int = 5) -> str:
    """The first ``shown`` of ``items``, and how many more, for a message."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


@dataclass
class _Fit:
    """How a checkpoint fits a model: what would be loaded (``result``, ``missing`` filled) and, for each checkpoint
    key read, the model's tensors it fills (``(live key, tensor)``: the slices of a split parameter, or one)."""

    result: PretrainedLoad
    reads: list[tuple[str, list[tuple[str, Tensor]]]]


def _fit(module: nn.Module, reader: _Reader, source: Path, *, prefix: str | None, strict: bool, cast: bool) -> _Fit:
    """Check the checkpoint ``reader`` reads against ``module`` (sharded or not, its tensors real or on meta) from
    shapes and dtypes alone: every problem found is raised at once (see [Note: checked before profiling])."""
    slices = SliceMap.of(module)
    targets: dict[str, list[tuple[str, Tensor]]] = {}  # canonical key -> (live key, tensor)
    for key, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, Tensor):
            targets.setdefault(slices.canonical(key), []).append((key, tensor))
    shown = repr(str(source))
    result = PretrainedLoad(str(source), _match_prefix(list(reader.tensors), set(targets), prefix, shown))
    unknown: list[str] = []
    shapes: list[str] = []
    dtypes: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}  # (checkpoint's, model's) -> keys
    reads: list[tuple[str, list[tuple[str, Tensor]]]] = []
    filled: set[int] = set()
    for key, stored in reader.tensors.items():
        label = f"{key} (in {stored.file})" if stored.file is not None else key
        live = targets.get(result.prefix + key)
        if live is None:
            unknown.append(label)
            continue
        filled.update(id(tensor) for _, tensor in live)  # present: a misfit is reported as one, not as lacking
        full = tuple(slices.canonical_shape(live[0][0], live[0][1].shape))  # the slices of a split one agree
        if stored.shape != full:
            shapes.append(f"{label}: checkpoint {stored.shape}, model {full}")
            continue
        wanted = live[0][1].dtype
        if stored.dtype != wanted:
            across = _dtype_kind(stored.dtype) != _dtype_kind(wanted)
            if across or not cast:
                dtypes.setdefault((stored.dtype, wanted), []).append(label)
                continue
            result.cast += 1
        reads.append((key, live))
        result.loaded += 1
    result.missing = sorted(name for name, live in targets.items() if not any(id(t) in filled for _, t in live))
    problems = []
    if unknown:
        problems.append(
            f"{len(unknown)} of its keys are not the model's: {_some(unknown)} (under the prefix "
            f"{result.prefix!r}: OSDPStrategy(pretrained_prefix=...) names the prefix of the model's names they are "
            "read under)"
        )
    if shapes:
        problems.append(f"other shapes: {_some(shapes)}")
    if dtypes:
        pairs = [
            f"{len(keys)} {stored} in the checkpoint, {wanted} in the model: {_some(keys)}"
            for (stored, wanted), keys in dtypes.items()
        ]
        kinds = {_dtype_kind(stored) != _dtype_kind(wanted) for stored, wanted in dtypes}
        advice = []
        if False in kinds:
            advice.append(
                "OSDPStrategy(pretrained_cast=True) casts them to the model's dtypes (a precision change: rounding "
                "when it narrows), or convert the model to the checkpoint's dtype (Trainer(precision=...))"
            )
        if True in kinds:
            advice.append(
                "no cast crosses kinds of values (integer, boolean, complex, floating point): these are not the "
                "tensors the model expects"
            )
        problems.append(f"other dtypes: {'; '.join(pairs)}. {'; '.join(advice)}")
    if result.missing and strict:
        problems.append(
            f"the weights lack {len(result.missing)} of the model's keys: {_some(result.missing)}; set "
            "strict_loading = False on the LightningModule to keep their initialization"
        )
    if problems:
        raise CheckpointMismatchError(
            f"pretrained weights {shown} do not fit the model:" + "".join(f"\n  - {p}" for p in problems)
        )
    return _Fit(result, reads)


def validate_pretrained(
    module: nn.Module,
    source: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    strict: bool = True,
    cast: bool = False,
) -> PretrainedLoad:
    """Check that the full checkpoint ``source`` fits ``module``, reading no tensor's data: its files' headers against
    the model's shapes and dtypes (the model may be on the meta device, and need not be sharded). What setup runs
    before it profiles (see [Note: checked before profiling]); :func:`load_pretrained` runs the same check.

    Returns:
        What :func:`load_pretrained` would load (``bytes_read`` 0).

    Raises:
        CheckpointError: as :func:`load_pretrained`.
    """
    path = Path(source)
    with _open(path) as reader:
        return _fit(module, reader, path, prefix=prefix, strict=strict, cast=cast).result


def load_pretrained(
    module: nn.Module,
    source: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    strict: bool = True,
    cast: bool = False,
) -> PretrainedLoad:
    """Read the full checkpoint ``source`` into ``module`` (sharded or not), each rank reading only the rows of its
    shards (see [Note: reading only the shards]).

    Args:
        module: the model, after the plan was applied (its split and sharded parameters live).
        source: a ``torch.save`` file (a state dict, or a Lightning checkpoint with ``"state_dict"``), a
            ``.safetensors`` file, or a folder of them (a Hugging Face model folder; see [Note: links in a pretrained
            folder]).
        prefix: the prefix of the model's keys the checkpoint's keys are read under (default: found, see the Note).
        strict: a model key the checkpoint lacks is an error (unless tied to one it has).
        cast: a tensor whose dtype differs from its parameter's but holds the same kind of values (floating point,
            integer) is cast to it; otherwise, and always across kinds (``int64`` into ``float32``), it is an error.

    Raises:
        CheckpointError: the source cannot be read (a damaged header, a key in two files, a link that leads out of
            the folder) or would run code (``UntrustedContentError``).
        CheckpointMismatchError: keys, shapes or dtypes that are not the model's (all of them, in one message).
    """
    path = Path(source)
    with _open(path) as reader:
        fit = _fit(module, reader, path, prefix=prefix, strict=strict, cast=cast)
        slices = SliceMap.of(module)
        for key, live in fit.reads:
            for name, tensor in live:
                alias = slices.aliases.get(name)
                offset = alias.row_offset if alias is not None and tensor.dim() > 0 else 0
                own_rows = tensor.shape[0] if tensor.dim() > 0 else 1
                start, stop = _local_rows(tensor, own_rows)
                value = reader.rows(key, offset + start, offset + stop)
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if local.numel() != value.numel():
                    raise CheckpointError(f"{name}: this rank holds {tuple(local.shape)}, rows {start}:{stop} read")
                with torch.no_grad():
                    local.copy_(value.reshape(local.shape))
                fit.result.bytes_read += value.numel() * value.element_size()
    return fit.result


def _strict(module: nn.Module) -> bool:
    """Whether a model key the checkpoint lacks is an error: Lightning's ``strict_loading`` of the module."""
    return bool(getattr(module, "strict_loading", True))


def check_before_setup(module: nn.Module, source: Path, *, prefix: str | None, cast: bool) -> PretrainedLoad:
    """:func:`validate_pretrained` as setup runs it before profiling, on the LightningModule (its ``strict_loading``
    honoured), with the arguments :func:`initialize_weights` later loads with."""
    return validate_pretrained(module, source, prefix=prefix, strict=_strict(module), cast=cast)


def initialize_weights(
    module: nn.Module,
    uninitialized: list[str],
    *,
    pretrained: Path | None,
    prefix: str | None,
    resuming: bool,
    cast: bool = False,
) -> None:
    """After the plan is applied: pretrained weights into the shards, unless the run resumes (its checkpoint holds the
    weights), and a warning naming what neither a ``reset_parameters()`` nor the weights initialized.

    Args:
        module: the LightningModule, sharded and materialized (its ``strict_loading`` is honoured).
        uninitialized: the modules materialization left without an initializer (``root.uninitialized``).
        pretrained: the full checkpoint to start from (``OSDPStrategy(pretrained=...)``), or ``None``.
        prefix: the prefix the checkpoint's keys are read under (``None``: found).
        resuming: whether ``fit(ckpt_path=...)`` restores the weights after setup.
        cast: cast weights to their parameters' dtypes within a kind (``OSDPStrategy(pretrained_cast=...)``).
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    if resuming:
        return
    missing: set[str] | None = None
    if pretrained is not None:
        loaded = load_pretrained(module, pretrained, prefix=prefix, strict=_strict(module), cast=cast)
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
