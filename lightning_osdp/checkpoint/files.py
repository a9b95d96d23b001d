"""A checkpoint directory opened once, and every file of it read relative to that opened directory.

[Note: reading a directory that may be replaced]
``last.ckpt`` is saved again every few steps while other processes read it (an evaluation job, an upload, ``osdp
show``): a save swaps the whole directory for the new one in one rename (``layout``'s [Note: atomic saves]) and then
deletes the old one. A reader that opens each file by its path, ``<path>/meta.pt`` then ``<path>/__0_0.distcp``,
may get the first from one save and the second from the next: mixed states that no checksum can catch (each file is
intact, and the checksums were checked before the data was read, against whichever manifest was read first).

So a reader opens the checkpoint directory once (``open(path, O_DIRECTORY)``, which follows a link named by the user:
``last.ckpt -> epoch=3.ckpt`` as Lightning's ``save_last="link"`` makes it) and opens every file *relative to that
open directory* (``os.open(name, dir_fd=...)``). A save never changes a directory it has committed, it only renames
and deletes it; so every file opened through the pinned directory belongs to the save that wrote the manifest read
through it, whatever is at ``path`` by then. Once that save is deleted, opening one of its files fails (the file is
gone from the directory the reader holds): the reader then compares the directory it holds with what is at
``path`` now, and says the checkpoint was replaced while it was being read (:class:`CheckpointReplacedError`)
instead of calling a missing file a lost one. A checkpoint deleted rather than replaced (``ModelCheckpoint``'s
``save_top_k`` dropping ``step=5.ckpt`` while ``last.ckpt`` still links to it) leaves its path first, in one rename
(``layout.remove_checkpoint``), so the same comparison says so, and a link met dangling is read again too
(:func:`dangling_link_error`). A file already open stays readable after its deletion. A reader in
one process (``osdp consolidate``, ``osdp show``, :func:`~lightning_osdp.checkpoint.read_sharded_tensors`) then
reads it again (:func:`read_retrying`); ranks loading it together compare what they opened (see ``sharded``).

Small files (the manifest, ``meta.pt``, DCP's index, the plan and profile) are read once into memory, and their
checksums are checked on those same bytes, which are then parsed. Shards are checked through the pinned directory
and read through it by DCP: each is a file of the same save, never rewritten in place.

[Note: nothing is read from outside the checkpoint]
Every file is opened with ``O_NOFOLLOW`` (a symbolic link is refused, not followed), must be a regular file (a FIFO
would block, a device would read forever: opened non-blocking, checked with ``fstat``), and is named by a plain name
the manifest lists (``layout.Manifest.from_dict``). A link whose target has the size and checksum the manifest
records is refused all the same: the checkpoint is data from its directory, and nothing outside it is read.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

from lightning_osdp.checkpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

__all__ = [
    "MANIFEST",
    "CheckpointDirectory",
    "CheckpointReplacedError",
    "dangling_link_error",
    "leftovers",
    "missing_checkpoint_error",
    "read_retrying",
]

T = TypeVar("T")
_CHUNK = 1 << 23
#: How many times a reader in one process reads a checkpoint that was replaced while it read it.
_ATTEMPTS = 5
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class CheckpointReplacedError(CheckpointError):
    """The checkpoint was replaced by a newer save (``last.ckpt`` saved again) while it was being read: nothing of it
    was used. Read it again."""


#: The manifest's file name: a sharded checkpoint's commit record (``layout.py`` writes it).
MANIFEST = "osdp.json"


def leftovers(path: Path) -> list[Path]:
    """Temporary or set-aside siblings of ``path`` left by interrupted saves (``.tmp-*``, ``.old-*``)."""
    parent = path.parent
    if not parent.is_dir():
        return []
    prefixes = (f"{path.name}.tmp-", f"{path.name}.old-")
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefixes))


def missing_checkpoint_error(path: Path) -> CheckpointError:
    """The error for a checkpoint path that does not exist, naming what interrupted saves left beside it (or, for a
    link to nothing, :func:`dangling_link_error`'s)."""
    dangling = dangling_link_error(path)
    if dangling is not None:
        return dangling
    found = leftovers(path)
    if not found:
        return CheckpointError(f"checkpoint {str(path)!r} does not exist")
    complete = [p for p in found if p.is_file() or (p / MANIFEST).is_file()]
    detail = (
        f"; the previous checkpoint was set aside intact at {str(complete[0])!r} by an interrupted save"
        if complete
        else f"; an interrupted save left {', '.join(repr(str(p)) for p in found)}, which is incomplete"
    )
    return CheckpointError(f"checkpoint {str(path)!r} does not exist{detail}")


def dangling_link_error(path: Path) -> CheckpointReplacedError | None:
    """For a ``path`` that is a symbolic link to nothing, the error that says so; ``None`` otherwise.

    ``ModelCheckpoint(save_last="link")`` keeps ``last.ckpt`` a link to the newest save: with ``save_top_k`` the
    save it names is deleted, then the link made anew, so a reader can meet it dangling for an instant. It is read
    again (a :class:`CheckpointReplacedError`, which :func:`read_retrying` retries); a link that stays dangling is
    named as one."""
    try:
        target = os.readlink(path)
    except OSError:
        return None
    if os.path.exists(path):
        return None
    return CheckpointReplacedError(
        f"checkpoint {str(path)!r} is a link to {target!r}, which does not exist: the save it named was deleted (a "
        "training that saves with ModelCheckpoint(save_last='link') links it to each newer save, and save_top_k "
        "deletes the older ones). Read it again, or give the path of a checkpoint that exists"
    )


class CheckpointDirectory:
    """A checkpoint directory held open: every file is opened relative to it, never through a symbolic link (see
    [Note: reading a directory that may be replaced] and [Note: nothing is read from outside the checkpoint]).

    Closed by :meth:`close`, at the end of a ``with`` block, or when garbage-collected (a
    :class:`~lightning_osdp.checkpoint.ShardedState` keeps it open until the strategy has loaded its tensors).

    Raises:
        CheckpointError: ``path`` does not exist or is not a directory.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        except FileNotFoundError:
            raise missing_checkpoint_error(self.path) from None
        except NotADirectoryError:
            raise CheckpointError(f"checkpoint {str(self.path)!r} is not a directory") from None
        except OSError as err:
            raise CheckpointError(f"cannot open checkpoint {str(self.path)!r}: {err.strerror or err}") from None
        self._fd = fd
        info = os.fstat(fd)
        self._identity = (info.st_dev, info.st_ino)
        self._finalizer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        """Close the directory (files already open stay open)."""
        self._finalizer()

    def __enter__(self) -> CheckpointDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointDirectory({str(self.path)!r})"

    # ------------------------------------------------------------------------------------------ what it holds
    def replaced(self) -> bool:
        """Whether ``path`` now names another directory than the one held (a newer save, or none)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return True
        return (info.st_dev, info.st_ino) != self._identity

    def replaced_error(self) -> CheckpointReplacedError:
        return CheckpointReplacedError(
            f"checkpoint {str(self.path)!r} was replaced by a newer save while it was being read (a training saves "
            "it again); nothing of it was used: read it again"
        )

    def size(self, name: str) -> int | None:
        """The size of file ``name`` (``None``: there is none), without following a link.

        Raises:
            CheckpointError: ``name`` is a symbolic link or not a regular file.
        """
        try:
            info = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as err:
            raise self._unreadable(name, err) from None
        self._check_kind(name, info.st_mode)
        return info.st_size

    def names(self) -> list[str]:
        """The entries of the directory held, sorted."""
        return sorted(os.listdir(self._fd))

    # ------------------------------------------------------------------------------------------ reading
    def open(self, name: str) -> IO[bytes]:
        """File ``name`` of the directory held, opened for reading (a plain file, not a link).

        Raises:
            CheckpointReplacedError: the file is gone because the checkpoint was replaced since it was opened.
            IncompleteCheckpointError: the file is missing from the checkpoint.
            CheckpointError: ``name`` is a symbolic link or not a regular file.
        """
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=self._fd)
        except FileNotFoundError:
            raise self.missing(name) from None
        except OSError as err:
            if err.errno == errno.ELOOP:
                self._check_kind(name, stat.S_IFLNK)
            raise self._unreadable(name, err) from None
        try:
            self._check_kind(name, os.fstat(fd).st_mode)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def read(self, name: str, *, size: int | None = None, checksum: str | None = None) -> bytes:
        """The bytes of file ``name``, checked against the ``size`` and ``checksum`` the manifest records (when given)
        on those very bytes.

        Raises:
            IncompleteCheckpointError: the file is shorter or longer than recorded.
            CorruptCheckpointError: its checksum differs.
        """
        with self.open(name) as f:
            data = f.read()
        if size is not None and len(data) != size:
            raise IncompleteCheckpointError(
                f"refusing to load checkpoint {str(self.path)!r}: files were lost or truncated after it was written: "
                f"{name} ({len(data)} bytes, expected {size} bytes)"
            )
        if checksum is not None and format_checksum(zlib.crc32(data)) != checksum:
            raise corrupt_error(self.path, [changed(name, format_checksum(zlib.crc32(data)), checksum)])
        return data

    def checksum(self, name: str) -> str:
        """The checksum (``"crc32:<8 hex digits>"``) of file ``name``, read through the directory held."""
        crc = 0
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        with self.open(name) as f:
            while size := f.readinto(buffer):  # type: ignore[attr-defined]
                crc = zlib.crc32(view[:size], crc)
        return format_checksum(crc)

    def json(self, name: str, *, size: int | None = None, checksum: str | None = None) -> Any:
        """File ``name`` parsed as JSON (see :meth:`read`)."""
        data = self.read(name, size=size, checksum=checksum)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r}: unreadable {name} ({type(err).__name__}: {err})"
            ) from None

    # ------------------------------------------------------------------------------------------ errors
    def missing(self, name: str) -> CheckpointError:
        """The error for file ``name`` not found in the directory held."""
        if self.replaced():
            return self.replaced_error()
        return IncompleteCheckpointError(
            f"refusing to load checkpoint {str(self.path)!r}: files were lost after it was written: {name} (missing)"
        )

    def _check_kind(self, name: str, mode: int) -> None:
        if stat.S_ISREG(mode):
            return
        if stat.S_ISLNK(mode):
            try:
                target = repr(os.readlink(name, dir_fd=self._fd))
            except OSError:
                target = "elsewhere"
            raise CheckpointError(
                f"refusing to load checkpoint {str(self.path)!r}: {name} is a symbolic link (to {target}), and a "
                "checkpoint's files are plain files inside its directory: nothing outside it is read. Copy the file "
                "into the checkpoint if it belongs there"
            )
        raise CheckpointError(
            f"refusing to load checkpoint {str(self.path)!r}: {name} is not a regular file (a directory, a pipe or a "
            "device), which no save writes"
        )

    def _unreadable(self, name: str, err: OSError) -> CheckpointError:
        return CheckpointError(f"cannot read {name} of checkpoint {str(self.path)!r}: {err.strerror or err}")


def format_checksum(crc: int) -> str:
    """A CRC-32 as the manifest records it: ``"crc32:<8 hex digits>"``."""
    return f"crc32:{crc:08x}"


def changed(name: str, actual: str, recorded: str) -> str:
    """One file's entry in :func:`corrupt_error`."""
    return f"{name} (checksum {actual}, recorded {recorded} when it was saved)"


def corrupt_error(path: Path, failures: list[str]) -> CorruptCheckpointError:
    """The error for files of checkpoint ``path`` whose content changed after the save."""
    return CorruptCheckpointError(
        f"refusing to load checkpoint {str(path)!r}: the content of {', '.join(sorted(failures))} changed after "
        "the save, its size unchanged (a disk, memory or copy error). Load another checkpoint, or copy this one again "
        "from where it was written"
    )


def read_retrying(read: Callable[[], T]) -> T:
    """``read()``, again (up to 5 times in all, 0.1 s apart) while it raises :class:`CheckpointReplacedError`: a
    reader in one process of a checkpoint that a training keeps replacing. The last error is raised."""
    for attempt in range(_ATTEMPTS):
        try:
            return read()
        except CheckpointReplacedError:
            if attempt == _ATTEMPTS - 1:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


@contextmanager
def opened(path: str | os.PathLike[str] | CheckpointDirectory) -> Iterator[CheckpointDirectory]:
    """``path`` opened as a :class:`CheckpointDirectory` for the block (closed after it unless it was given open)."""
    if isinstance(path, CheckpointDirectory):
        yield path
        return
    with CheckpointDirectory(path) as directory:
        yield directory
