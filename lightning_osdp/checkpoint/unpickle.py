"""Reading a checkpoint's pickles without running code from them.

[Note: pickles in a checkpoint]
Unpickling calls whatever functions a pickle names, so loading a crafted file with ``torch.load(weights_only=False)``
or ``pickle.load`` runs its author's code. A checkpoint holds four kinds of pickle, and each is read with the least
trust it needs:

* Lightning's metadata (``meta.pt`` of a directory, the whole of a full file): ``torch.load(weights_only=True)``,
  which creates only tensors and plain data. Lightning's own entries need no more; hyper-parameters of the user's
  own classes do, and then the load is refused with a message naming the class and the two ways to accept it:
  torch's allow-list (``torch.serialization.add_safe_globals``), or the caller's ``weights_only=False``. (Lightning
  2.6 drops ``Trainer.fit(..., weights_only=...)`` for strategies that restore after ``setup``, as OSDP does: under
  ``fit`` the allow-list is the way, until Lightning passes it.) A pickle naming functions no checkpoint holds
  (``builtins.exec``, ``os.system``) is refused with no way around it offered.
* DCP's index ``.metadata``, a plain pickle that DCP reads with ``pickle.load``: read here with an unpickler that
  creates only the index's own types (:func:`read_dcp_index`), and handed to DCP already read.
* DCP's non-tensor items (optimizer hyper-parameters), which DCP's default planner reads with
  ``torch.load(weights_only=False)``: checked to load with ``weights_only=True`` first (:func:`load_item`), by the
  reader OSDP gives DCP (:class:`IndexedReader`), whatever the planner.
* The ``"osdp"`` entry of a full file, which :func:`~lightning_osdp.checkpoint.saved_plan` needs before Lightning
  loads the file: :func:`skim` reads the file's pickle with every global replaced by an inert stand-in, so the plan
  comes out of any file, whatever else it holds, and nothing in it runs.

DCP's tensor data is read by DCP itself with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_osdp._compat import dcp_reader_file_system
from lightning_osdp.checkpoint.errors import CheckpointError, UntrustedContentError
from lightning_osdp.checkpoint.files import CheckpointDirectory

__all__ = [
    "IndexedReader",
    "SkimmedTensor",
    "load_item",
    "load_torch_file",
    "read_dcp_index",
    "skim",
    "unsafe_globals",
    "weights_only_refusal",
]

#: Modules whose functions no checkpoint holds, and the builtins that run or reach code: a pickle naming one was made
#: to run code when it is loaded. (Other builtins, ``range`` or ``frozenset``, are data a user may keep.)
_CODE_MODULES = {
    "codecs", "code", "ctypes", "importlib", "marshal", "nt", "os", "pickle", "posix", "pty", "runpy", "shutil",
    "socket", "subprocess", "sys", "types", "webbrowser",
}  # fmt: skip
_CODE_BUILTINS = {
    "__import__", "breakpoint", "compile", "delattr", "eval", "exec", "exit", "getattr", "globals", "help", "input",
    "locals", "open", "quit", "setattr", "vars",
}  # fmt: skip


def _runs_code(name: str) -> bool:
    module, _, attribute = name.rpartition(".")
    return module.partition(".")[0] in _CODE_MODULES or (module == "builtins" and attribute in _CODE_BUILTINS)


def _refusal(
    path: Path | str,
    what: str,
    names: list[str],
    *,
    allow_list: bool = True,
    advice: Callable[[str], str] | None = None,
) -> UntrustedContentError:
    """The refusal of ``what`` of checkpoint ``path``, which holds the globals ``names``. ``allow_list``: torch's
    ``add_safe_globals`` lets the load create them (not for DCP's index, which torch does not load). ``advice``: what
    the caller's user can do, given the globals as shown (default: the ways of loading a checkpoint, below)."""
    shown = ", ".join(names)
    head = f"refusing to load {_part(what, path)}: it holds {shown}"
    if any(_runs_code(name) for name in names):
        return UntrustedContentError(
            f"{head}, which no checkpoint holds: the file was made to run code when it is loaded. Do not load it"
        )
    reason = (
        f"{head}, which loading with weights_only=True does not create (plain data and tensors only), and creating "
        "it runs code from the file."
    )
    if advice is not None:
        return UntrustedContentError(f"{reason} {advice(shown)}")
    trust = (
        "load it with weights_only=False: lightning_osdp.checkpoint.load_checkpoint(..., weights_only=False), "
        "consolidate(..., weights_only=False), osdp consolidate --allow-pickle"
    )
    if allow_list:
        trust = (
            f"allow these classes with torch.serialization.add_safe_globals([{shown}]) (or the safe_globals context "
            f"manager around the load), or {trust}"
        )
    return UntrustedContentError(f"{reason} If the checkpoint comes from a source you trust, {trust}")


def _part(what: str, path: Path | str) -> str:
    """``what`` of checkpoint ``path``, for messages (``what`` empty: the checkpoint itself)."""
    return f"{what} of checkpoint {str(path)!r}" if what else f"checkpoint {str(path)!r}"


def unsafe_globals(file: IO[bytes]) -> list[str]:
    """The globals a ``torch.save`` file's pickle names that ``torch.load(weights_only=True)`` does not create (torch's
    own allow-list and the user's ``add_safe_globals``), found by reading the pickle's opcodes without running them
    (``torch.serialization.get_unsafe_globals_in_checkpoint``). Empty for a file that is not a ``torch.save`` file or
    whose pickle cannot be parsed."""
    start = file.tell()
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:
        return []
    finally:
        file.seek(start)


def weights_only_refusal(
    err: BaseException,
    file: IO[bytes],
    path: Path | str,
    what: str,
    *,
    advice: Callable[[str], str] | None = None,
) -> CheckpointError | None:
    """The error to raise when ``torch.load(weights_only=True)`` of ``file`` (``what`` of checkpoint ``path``:
    ``"meta.pt"``; empty: the whole file) raised ``err``; ``None`` when ``err`` is not an unpickling error.
    ``advice``: what the user can do about a refused global (given as shown; default: the ways of loading a
    checkpoint, ``weights_only=False`` among them, which not every caller offers).

    A refusal is recognised by what the file's pickle names (:func:`unsafe_globals`), not by the words of torch's
    message: an :class:`UntrustedContentError` naming those globals. An unpickling error with no such global is a
    damaged pickle: a :class:`CheckpointError` that says so.
    """
    if not isinstance(err, pickle.UnpicklingError):
        return None
    names = unsafe_globals(file)
    if names:
        return _refusal(path, what, names, advice=advice)
    reason = str(err).strip().splitlines()[-1][:300] if str(err).strip() else type(err).__name__
    return CheckpointError(f"cannot read {_part(what, path)}: its pickle is damaged ({reason})")


def load_torch_file(
    file: IO[bytes] | bytes | Path, *, weights_only: bool, what: str, source: Path | str | None = None
) -> Any:
    """``torch.load`` of an open file, its bytes, or a path, on CPU, ``weights_only`` unless the caller trusts the file.

    Args:
        source: the checkpoint, for messages (default: ``file`` when it is a path).

    Raises:
        UntrustedContentError: the file needs more than plain data; the message names the classes and how to opt in
            (or, for a pickle that names functions that run code, says not to load it).
        CheckpointError: the file cannot be read (damaged).
    """
    if isinstance(file, Path):
        with open(file, "rb") as opened:
            return load_torch_file(opened, weights_only=weights_only, what=what, source=source or file)
    where = source if source is not None else "<memory>"
    stream = io.BytesIO(file) if isinstance(file, bytes) else file
    start = stream.tell()
    try:
        return torch.load(stream, map_location="cpu", weights_only=weights_only)
    except Exception as err:
        stream.seek(start)
        refusal = weights_only_refusal(err, stream, where, what)
        if refusal is not None:
            raise refusal from None
        raise CheckpointError(f"cannot read {_part(what, where)}: {type(err).__name__}: {err}") from err


def load_item(data: IO[bytes], *, fqn: str, path: Path | str) -> None:
    """Check that a DCP non-tensor item (``optimizer_0.param_groups.0.lr``) is plain data before DCP's planner
    unpickles it. A pickle that loads with ``weights_only=True`` calls only the functions that load allows, so DCP's
    own ``torch.load(weights_only=False)`` of the same bytes then runs no other code."""
    start = data.tell()
    try:
        torch.load(data, weights_only=True)
    except Exception as err:
        data.seek(start)
        refusal = weights_only_refusal(err, data, path, f"item {fqn!r}")
        if refusal is not None:
            raise refusal from None
        raise CheckpointError(f"cannot read item {fqn!r} of checkpoint {str(path)!r}: {err}") from err
    data.seek(start)


class IndexedReader(FileSystemReader):
    """DCP's reader of the checkpoint ``directory`` holds: it reads every file relative to that open directory (see
    ``files``' [Note: reading a directory that may be replaced]), hands DCP ``index`` (read and checked already, by
    :func:`read_dcp_index`: DCP itself would ``pickle.load`` the file) and, unless ``weights_only=False``, checks each
    non-tensor item to be plain data (:func:`load_item`) before the planner unpickles it, whatever the planner."""

    def __init__(
        self, directory: CheckpointDirectory, index: dcp_metadata.Metadata, *, weights_only: bool = True
    ) -> None:
        super().__init__(directory.path)
        dcp_reader_file_system(self, replace_with=_DirectoryFileSystem(directory))
        self._index = index
        self._weights_only = weights_only

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._index.storage_meta is None:
            self._index.storage_meta = dcp_metadata.StorageMeta()
        self._index.storage_meta.load_id = self.load_id
        return self._index

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._weights_only:
            planner = cast(LoadPlanner, _PlainItems(planner, self.path))
        return super().read_data(plan, planner)


class _DirectoryFileSystem(FileSystem):
    """DCP's local file system, reading the files of one open checkpoint directory (by name, relative to it)."""

    def __init__(self, directory: CheckpointDirectory) -> None:
        self._directory = directory

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        if mode != "rb":
            raise CheckpointError(f"a checkpoint being read is not written to ({path!r}, mode {mode!r})")
        with self._directory.open(Path(path).name) as stream:
            yield stream


class _PlainItems:
    """A DCP load planner whose ``load_bytes`` first checks the item is plain data (the rest is the planner's)."""

    def __init__(self, planner: LoadPlanner, path: Any) -> None:
        self._planner = planner
        self._path = path

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        load_item(value, fqn=read_item.dest_index.fqn, path=self._path)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:  # resolve_tensor, commit_tensor...
        return getattr(self._planner, name)


# ---------------------------------------------------------------------------------------------- DCP's index
#: What a DCP index (``Metadata``) is made of, by module: its dataclasses, ``torch.Size``, dtypes, layouts, memory
#: formats (looked up below), and paths (``StorageMeta.checkpoint_id``).
_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _Refused(pickle.UnpicklingError):
    """A global an index must not name, found by :class:`_IndexUnpickler` (``name``: ``module.attribute``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _INDEX_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


def read_dcp_index(data: bytes, *, source: Path | str, weights_only: bool = True) -> dcp_metadata.Metadata:
    """DCP's index (the bytes of ``.metadata`` of checkpoint ``source``), created from its own types only (see [Note:
    pickles in a checkpoint]); ``weights_only=False`` unpickles it as DCP does.

    Raises:
        UntrustedContentError: the index names anything else.
    """
    try:
        stream = io.BytesIO(data)
        index = (_IndexUnpickler(stream) if weights_only else pickle.Unpickler(stream)).load()
    except _Refused as err:
        raise _refusal(source, "DCP's index '.metadata'", [err.name], allow_list=False) from None
    except Exception as err:  # a damaged file: EOFError, UnpicklingError, ValueError...
        raise CheckpointError(f"cannot read DCP's index '.metadata' of checkpoint {str(source)!r}: {err!r}") from err
    if not isinstance(index, dcp_metadata.Metadata):
        raise CheckpointError(f"'.metadata' of checkpoint {str(source)!r} is not a DCP index")
    return index


# ---------------------------------------------------------------------------------------------- skimming
class _Opaque:
    """Stands in for any object of a skimmed pickle that is not plain data: it takes whatever the pickle gives it
    and does nothing (the real class is never looked up, so none of its code runs)."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{self.qualname}, not loaded>"


class SkimmedTensor:
    """A tensor of a skimmed file: its shape only (the data is not read)."""

    __slots__ = ("shape",)  # no attribute a crafted pickle could set besides its shape, checked below

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __setstate__(self, state: Any) -> None:
        pass


def _rebuild_tensor(storage: Any, offset: Any, size: Any, *args: Any) -> Any:
    if isinstance(size, tuple) and all(isinstance(s, int) for s in size):
        return SkimmedTensor(size)
    return _Opaque()


def _rebuild_parameter(data: Any, *args: Any) -> Any:
    return data


#: Globals a skim resolves to something useful; every other one is an inert stand-in.
_SKIM_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
}


class _Skimmer(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        known = _SKIM_GLOBALS.get((module, name))
        if known is not None:
            return known
        return type("Opaque", (_Opaque,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:
        return None  # a tensor's storage: never read


def skim(path: Path) -> Any:
    """The content of a ``torch.save`` file with plain data as saved, tensors as :class:`SkimmedTensor` (their
    shapes) and every other object inert (see [Note: pickles in a checkpoint]). Reads only the pickle, not the
    tensors' data, and checks that record's CRC.

    Raises:
        CheckpointError: the file is not a ``torch.save`` (zip) file, or its pickle is damaged.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(names) != 1:
                raise CheckpointError(f"checkpoint file {str(path)!r} is not a torch.save file (no data.pkl record)")
            data = archive.read(names[0])  # zipfile checks the record's CRC-32
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointError(f"cannot read checkpoint file {str(path)!r}: {err}") from None
    try:
        return _Skimmer(io.BytesIO(data)).load()
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint file {str(path)!r}: damaged pickle ({err!r})") from None
