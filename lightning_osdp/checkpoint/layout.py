"""What a checkpoint looks like on disk, and how it gets there atomically.

A sharded checkpoint is a directory::

    epoch=0-step=8.ckpt/
        __0_0.distcp        rank 0's shards of the model and optimizer state (DCP)
        __1_0.distcp        rank 1's shards ...
        .metadata           DCP's index: every tensor's global shape and which file holds which chunk
        meta.pt             Lightning's checkpoint without the tensors: epoch, step, loops, callbacks,
                            hyper-parameters, LR schedulers, precision plugin (torch.save)
        plan.json           the plan in force (lightning_osdp.plan format)
        profile.json        the model profile in force, when the strategy had one
        osdp.json           the manifest, written last: format, world size, budget, every file's size and checksum

A full (consolidated) checkpoint is one ``torch.save`` file: Lightning's checkpoint dict with the model's own
state-dict keys, optimizer states in PyTorch's format, and an ``"osdp"`` entry (plan, profile, world size, budget).

[Note: atomic saves]
Every save is written under ``<path>.tmp-<token>`` (same directory, so same file system) and moved to ``<path>``
by one ``rename`` on rank 0 once every rank has written its files. When ``<path>`` already exists (``last.ckpt``
saved again) the two are swapped with ``renameat2(RENAME_EXCHANGE)`` where the OS has it, so that ``<path>`` is at
every instant either the complete old checkpoint or the complete new one; the old one, now at the temporary name,
is then deleted manifest first. Without RENAME_EXCHANGE the old checkpoint is first renamed to
``<path>.old-<token>``: a kill in the instant between the two renames leaves it there, intact, and loading
``<path>`` says where it is.

[Note: saves that commit at the same instant]
Two processes may save one path at once (two runs given one ``dirpath``). What is at ``<path>`` can then change
between any two system calls of a commit: it appears (the other save placed its checkpoint first), it changes kind
(a file for a directory), or, without RENAME_EXCHANGE, it is missing for an instant (the other save moved it aside).
Each step of :func:`commit` is one system call that either does what it says or fails because ``<path>`` changed;
a failure of that kind starts the move again against what is there now, so the later commit wins, as it does when
the saves are seconds apart. The attempts are bounded, so that a path replaced without pause cannot hold a save.

[Note: what a save may replace]
A save replaces what is at its path only when that is a checkpoint: nothing, an empty directory, a checkpoint
directory (every entry a file this layout writes), or a ``torch.save`` file (ours, or Lightning's own ``.ckpt``, as
``last.ckpt`` is after switching strategies). Anything else, the user's results directory given by mistake say, is
refused before any byte is written, and again at the commit, and is left as it was. Interrupted saves leave
``<path>.tmp-<token>`` (and, rarely, ``<path>.old-<token>``) beside the path; a later save removes those only when
the process that made them is gone (the token names its host and pid), so that two saves to one path at the same
time never delete each other's files.

The manifest is the commit record inside the directory: it is written after all shards and metadata (and
``fsync``ed), and deleted first when a checkpoint is removed (once the directory was renamed out of its path, so that
the path never names a checkpoint half deleted: :func:`remove_checkpoint`). A directory without it, or whose files no
longer have the sizes it lists, is an incomplete checkpoint and is refused on load with a message that says so,
instead of DCP failing later on a missing or short file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_osdp.checkpoint.errors import CheckpointError, IncompleteCheckpointError
from lightning_osdp.checkpoint.files import (
    MANIFEST,
    CheckpointDirectory,
    CheckpointReplacedError,
    leftovers,
    missing_checkpoint_error,
    opened,
)
from lightning_osdp.checkpoint.integrity import CHECKSUM_PATTERN, file_checksum

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "MANIFEST",
    "META",
    "PLAN",
    "PROFILE",
    "Manifest",
    "check_replaceable",
    "commit",
    "discard",
    "is_sharded_checkpoint",
    "leftovers",
    "missing_checkpoint_error",
    "new_token",
    "no_room",
    "read_manifest",
    "remove_checkpoint",
    "save_error",
    "temporary_path",
    "write_manifest",
]

#: ``format`` field of the manifest (and of the ``"osdp"`` entry of a full file).
CHECKPOINT_FORMAT = "lightning_osdp.checkpoint"
#: Layout version this release writes and reads.
CHECKPOINT_VERSION = 1
META = "meta.pt"
PLAN = "plan.json"
PROFILE = "profile.json"
log = logging.getLogger(__name__)


@dataclass
class Manifest:
    """The commit record of a checkpoint: written last, it says the save completed and what it holds.

    Attributes:
        state_dict_type: ``"sharded"`` (a DCP directory) or ``"full"`` (one file).
        world_size: ranks that wrote the checkpoint.
        memory_budget: the per-device budget (bytes) the plan was made for, if known.
        optimizers: how many optimizer states the checkpoint holds (0 for a weights-only save).
        plan: file name of the saved plan (``plan.json``), or ``None``.
        profile: file name of the saved profile, or ``None``.
        global_step: Lightning's global step at the save, for messages.
        epoch: Lightning's epoch at the save.
        files: every other file of the directory -> its size in bytes (empty for a full file).
        created: seconds since the epoch.
        versions: torch / lightning_osdp versions that wrote it.
        checksums: file name -> ``"crc32:<hex>"`` of every file in ``files`` (see ``integrity``'s [Note:
            checksums]); empty in checkpoints of lightning_osdp 0.1, which are checked by size only.
    """

    state_dict_type: str
    world_size: int
    memory_budget: int | None = None
    optimizers: int = 0
    plan: str | None = None
    profile: str | None = None
    global_step: int | None = None
    epoch: int | None = None
    files: dict[str, int] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    versions: dict[str, str] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (also the ``"osdp"`` entry of a full file, with the plan and profile inlined)."""
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Any, source: str, *, directory: bool = True) -> Manifest:
        """Parse and check a manifest (``directory``), or the ``"osdp"`` entry of a full file (whose ``plan`` and
        ``profile`` are the documents themselves, returned as ``None`` here).

        Every field is checked for its type and range, and every file name for being a plain name inside the
        directory (no path, no ``..``) that ``files`` lists: the manifest is data from the checkpoint, as trusted as
        the checkpoint. Unknown fields are ignored (a later release may add some).

        Raises:
            CheckpointError: naming ``source``, the field, what it accepts and what it holds.
        """
        if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{source}: not a lightning_osdp checkpoint manifest")
        version = data.get("version")
        if type(version) is not int or version != CHECKPOINT_VERSION:
            raise CheckpointError(
                f"{source}: checkpoint layout version {version!r} is not supported (this lightning_osdp reads "
                f"version {CHECKPOINT_VERSION})"
            )
        check = _Fields(data, source)
        kind = check.get("state_dict_type", "'sharded' or 'full'", lambda v: v in ("sharded", "full"))
        if directory and kind != "sharded":
            raise CheckpointError(
                f"{source}: field 'state_dict_type' of a checkpoint directory must be 'sharded', got {kind!r}"
            )
        files = check.get(
            "files",
            "an object mapping plain file names to sizes in bytes",
            lambda v: isinstance(v, dict) and all(_plain_name(k) and _count(v[k], 0) for k in v),
            default={},
        )
        checksums = check.get(
            "checksums",
            "an object mapping files of 'files' to 'crc32:<8 hex digits>'",
            lambda v: (
                isinstance(v, dict)
                and all(k in files and isinstance(c, str) and re.fullmatch(CHECKSUM_PATTERN, c) for k, c in v.items())
            ),
            default={},
        )
        if directory:
            plan, profile = (check.file_name(name, files) for name in ("plan", "profile"))
        else:
            for name in ("plan", "profile"):
                check.get(name, "an object or null", lambda v: v is None or isinstance(v, dict), default=None)
            plan = profile = None
        return cls(
            state_dict_type=kind,
            world_size=check.get("world_size", "an integer >= 1", lambda v: _count(v, 1)),
            memory_budget=check.get(
                "memory_budget", "a number of bytes (an integer > 0) or null", lambda v: v is None or _count(v, 1)
            ),
            optimizers=check.get("optimizers", "an integer >= 0", lambda v: _count(v, 0), default=0),
            plan=plan,
            profile=profile,
            global_step=check.get(
                "global_step", "an integer >= 0 or null", lambda v: v is None or _count(v, 0), default=None
            ),
            epoch=check.get("epoch", "an integer >= 0 or null", lambda v: v is None or _count(v, 0), default=None),
            files=files,
            created=check.get(
                "created",
                "a time in seconds",
                lambda v: isinstance(v, int | float) and not isinstance(v, bool),
                default=0.0,
            ),
            versions=check.get(
                "versions",
                "an object of strings",
                lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                default={},
            ),
            checksums=checksums,
        )


def _count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _plain_name(name: Any) -> bool:
    """A file name inside a directory: no separator, not ``.`` or ``..``, not empty."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(sep in name for sep in ("/", "\\", "\0"))
        and os.path.basename(name) == name
    )


class _Fields:
    """The fields of one manifest document, each read with its check."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def get(self, name: str, accepted: str, ok: Callable[[Any], bool], **default: Any) -> Any:
        if name not in self.data:
            if "default" in default:
                return default["default"]
            raise CheckpointError(f"{self.source}: field {name!r} is missing")
        value = self.data[name]
        if not ok(value):
            raise CheckpointError(f"{self.source}: field {name!r} must be {accepted}, got {_shown(value)}")
        return value

    def file_name(self, name: str, files: dict[str, int]) -> str | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not _plain_name(value):
            raise CheckpointError(
                f"{self.source}: field {name!r} must name a file of the checkpoint (a plain file name inside its "
                f"directory) or be null, got {_shown(value)}"
            )
        if value not in files:
            raise CheckpointError(f"{self.source}: field {name!r} names {value!r}, which is not listed in 'files'")
        return str(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint directory (complete or not), as opposed to a file."""
    return Path(path).is_dir()


def new_token() -> str:
    """A name component unique to one save, for the temporary path: time, host, process id, random. The host and pid
    tell a later save whether the process that wrote a leftover is still running (see :func:`abandoned`)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "_"


def abandoned(leftover: Path) -> bool:
    """Whether ``leftover`` (a ``.tmp-<token>`` or ``.old-<token>`` sibling) was left by a process that is gone: one
    of this host whose pid no longer runs. A leftover of another host, or of a live process (a save in progress, in
    this process or another), is not abandoned."""
    parts = re.split(r"\.(?:tmp|old)-", leftover.name)[-1].split("-")
    # `<date>-<time>-<host>-<pid>-<hex>`; lightning_osdp 0.1 wrote `<date>-<time>-<pid>-<hex>`, and ran on one host.
    if len(parts) == 5:
        host, pid_text = parts[2], parts[3]
    elif len(parts) == 4:
        host, pid_text = _host(), parts[2]
    else:
        return False  # not a name a save of ours makes: not ours to delete
    if host != _host() or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, owned by someone else
        return False
    return False


def temporary_path(path: Path, token: str) -> Path:
    """Where a save of ``path`` is written before it is committed: ``<path>.tmp-<token>``, beside it."""
    return path.with_name(f"{path.name}.tmp-{token}")


def write_manifest(directory: Path, manifest: Manifest, checksums: Mapping[str, str] | None = None) -> None:
    """Record every file of ``directory`` with its size and checksum, then write the manifest durably (the commit
    record). ``checksums`` are those computed while the files were written (``integrity.written_checksums``); the
    others are computed here, by reading the file."""
    files = [p for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST]
    for file in files:
        # The manifest vouches for these files: they must be on disk before it is (DCP's are already synced).
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    known = checksums or {}
    manifest.files = {p.name: p.stat().st_size for p in files}
    manifest.checksums = {p.name: known.get(p.name) or file_checksum(p) for p in files}
    _write_durably(directory / MANIFEST, (json.dumps(manifest.to_dict(), indent=1) + "\n").encode())
    _fsync_directory(directory)


def read_manifest(path: str | os.PathLike[str] | CheckpointDirectory) -> Manifest:
    """The manifest of checkpoint directory ``path``, after checking that the save completed and no file was lost.

    ``path`` may be a :class:`~lightning_osdp.checkpoint.files.CheckpointDirectory` already open: the manifest and
    the sizes are then those of the directory it holds (see its [Note: reading a directory that may be replaced]).

    Raises:
        IncompleteCheckpointError: no manifest (the save was interrupted, or another tool wrote the directory), or
            a listed file missing or of another size.
        CheckpointError: a listed file is a symbolic link, or not a regular file.
    """
    with opened(path) as directory:
        return _read_manifest(directory)


def _read_manifest(directory: CheckpointDirectory) -> Manifest:
    path = directory.path
    if directory.size(MANIFEST) is None:
        if directory.replaced():
            raise directory.replaced_error()
        hint = (
            "it is the temporary directory of a save that did not complete (the process was killed or failed mid-save)"
            if ".tmp-" in path.name
            else "the save that wrote it did not complete (killed or failed mid-save), or it was not written by "
            "lightning_osdp"
        )
        sibling = _complete_sibling(path)
        raise IncompleteCheckpointError(
            f"refusing to load checkpoint {str(path)!r}: it has no {MANIFEST} manifest, so {hint}. Load the "
            "previous complete checkpoint instead" + (f" ({str(sibling)!r})." if sibling else ".")
        )
    try:
        document = directory.json(MANIFEST)
    except CheckpointReplacedError:
        raise
    except CheckpointError as err:
        raise IncompleteCheckpointError(
            f"refusing to load checkpoint {str(path)!r}: unreadable manifest ({err})"
        ) from None
    manifest = Manifest.from_dict(document, str(path / MANIFEST))
    lost = []
    for name, size in manifest.files.items():
        actual = directory.size(name)
        if actual != size:
            lost.append(f"{name} ({'missing' if actual is None else f'{actual} bytes'}, expected {size} bytes)")
    if lost:
        if directory.replaced():
            raise directory.replaced_error()
        raise IncompleteCheckpointError(
            f"refusing to load checkpoint {str(path)!r}: files were lost or truncated after it was written: "
            + ", ".join(lost)
        )
    return manifest


def commit(tmp: Path, path: Path) -> None:
    """Move the completed save ``tmp`` to ``path`` atomically, replacing what was there (see [Note: atomic saves]).

    Called by one process (rank 0) once every rank's files are written. Other processes may commit saves of the same
    path at the same time (see [Note: saves that commit at the same instant]).
    """
    if tmp.is_dir():
        _fsync_directory(tmp)
    for _ in range(_COMMIT_ATTEMPTS):
        check_replaceable(path)
        if _move_into_place(tmp, path):
            break
    else:
        raise CheckpointError(
            f"saving checkpoint {str(path)!r} failed: other saves of that path replaced it {_COMMIT_ATTEMPTS} times in "
            "a row while this one was being moved into place. Give each run its own checkpoint directory"
        )
    _fsync_directory(path.parent)
    for stale in leftovers(path):
        # Earlier interrupted saves of this path, superseded now that a save completed; a save still in progress (in
        # another process: two saves to one path) keeps its files.
        if abandoned(stale):
            log.info("removing %s, left by an interrupted save", stale)
            discard(stale, left_by="an interrupted save")


#: How often a commit starts again when other saves of its path keep changing what is there.
_COMMIT_ATTEMPTS = 100

#: `rename` errors that mean something is at the target (a directory onto a directory that is not empty, or onto a
#: file, a file onto a directory).
_TARGET_THERE = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR})


def _overtaken(err: OSError, path: Path) -> bool:
    """Whether a rename onto ``path`` failed with ``err`` because another save placed its checkpoint there since."""
    return err.errno in _TARGET_THERE and os.path.lexists(path)


def _move_into_place(tmp: Path, path: Path) -> bool:
    """One attempt at moving ``tmp`` to ``path``, replacing what is there; ``False`` when another save changed what
    is at ``path`` in between (see [Note: saves that commit at the same instant])."""
    if not os.path.lexists(path):
        try:
            os.rename(tmp, path)
        except OSError as err:
            if _overtaken(err, path):
                return False
            raise
        return True
    try:
        exchanged = _exchange(tmp, path)
    except FileNotFoundError:
        return False  # moved away in between
    if exchanged:
        discard(tmp, left_by="the save it replaced")  # `tmp` now holds the previous checkpoint
        return True
    if path.is_file() and tmp.is_file():
        os.replace(tmp, path)
        return True
    aside = path.with_name(f"{path.name}.old-{tmp.name.rpartition('.tmp-')[2]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        os.rename(tmp, path)
    except OSError as err:
        if _overtaken(err, path):
            discard(aside, left_by="the save it replaced")  # another save took the place: replaced all the same
            return False
        raise
    discard(aside, left_by="the save it replaced")
    return True


#: Names a checkpoint directory holds: DCP's shard files and index (and its temporary index), and ours.
_LAYOUT_NAMES = re.compile(r"__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?")


def check_replaceable(path: Path) -> None:
    """Raise :class:`CheckpointError` unless a save may replace what is at ``path`` (see [Note: what a save may
    replace]): nothing, a symbolic link (the link is replaced, not what it points to), an empty file or a
    ``torch.save`` file, an empty directory or a checkpoint directory."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        return
    if stat.S_ISREG(mode):
        try:
            with open(path, "rb") as f:
                # On the open file: another save may swap what is at `path` at any instant.
                if os.fstat(f.fileno()).st_size == 0 or zipfile.is_zipfile(f):
                    return
        except FileNotFoundError:
            return
        except IsADirectoryError:
            mode = stat.S_IFDIR  # replaced by another save's checkpoint directory meanwhile: check that
        else:
            raise CheckpointError(
                f"refusing to save to {str(path)!r}: it is a file that is not a checkpoint (not a torch.save file), "
                "and saving would replace it. Choose another path, or move that file away first"
            )
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"refusing to save to {str(path)!r}: it is neither a file nor a directory")
    foreign = _foreign_entries(path)
    if foreign:
        shown = ", ".join(repr(name) for name in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise CheckpointError(
            f"refusing to save to {str(path)!r}: it is a directory that is not a checkpoint (it holds {shown}, "
            "which no checkpoint save writes), and saving would replace it with everything in it. Choose another "
            "path, or move that directory away first"
        )


def _foreign_entries(directory: Path) -> list[str]:
    """Entries of ``directory`` that no checkpoint save writes (sub-directories included), sorted. Entries that
    vanish while they are listed (another save replacing the same checkpoint) are not foreign."""
    ours = {MANIFEST, META, PLAN, PROFILE}
    foreign = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):  # replaced meanwhile, by another save of this path
        return []
    for entry in entries:
        try:
            plain_file = entry.is_file(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if plain_file and (entry.name in ours or _LAYOUT_NAMES.fullmatch(entry.name)):
            continue
        if os.path.lexists(entry.path):
            foreign.append(entry.name)
    return sorted(foreign)


#: Errors of a write that found no room: the device is full, the user's quota is spent, or a file hit its size limit.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
#: Free bytes under which a failed write is taken for a full file system when no error says why (torch's zip writer
#: reports a short write as "unexpected pos", without the OS error).
_NEARLY_FULL = 1 << 20


def no_room(err: BaseException, directory: Path) -> bool:
    """Whether a save into ``directory`` that raised ``err`` failed for lack of room: an ``ENOSPC``, ``EDQUOT`` or
    ``EFBIG`` among ``err``, its causes and (for DCP's ``CheckpointException``) every rank's failure; else less than
    1 MiB free on ``directory``'s file system. Call it before the partial save is removed."""
    stack: list[Any] = [err]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            stack.extend(item)
            continue
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in _NO_ROOM:
            return True
        stack.extend((item.__cause__, item.__context__, *getattr(item, "failures", {}).values()))
    try:
        free = os.statvfs(directory)
    except OSError:
        return False
    return free.f_bavail * free.f_frsize < _NEARLY_FULL


def save_error(path: Path, err: BaseException, *, full: bool) -> CheckpointError:
    """The error of a save to ``path`` that failed with ``err`` (``full``: for lack of room, see :func:`no_room`),
    once its partial save is removed: it names the checkpoint, the cause, and what is at ``path`` now."""
    if isinstance(err, CheckpointError):
        return err
    now = (
        f"the previous checkpoint at {str(path)!r} is unchanged"
        if os.path.lexists(path)
        else f"nothing was written at {str(path)!r}"
    )
    if full:
        return CheckpointError(
            f"saving checkpoint {str(path)!r} failed: no space left on device (the file system of "
            f"{str(path.parent)!r} is full); the partial save was removed and {now}. Free space there, or save "
            "elsewhere"
        )
    return CheckpointError(
        f"saving checkpoint {str(path)!r} failed ({_first_failure(err)}); the partial save was removed and {now}"
    )


def _first_failure(err: BaseException) -> str:
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = min(failures.items())
        first = failure[0] if isinstance(failure, tuple) else failure
        return f"on rank {rank}: {type(first).__name__}: {first}"
    return f"{type(err).__name__}: {err}"


def discard(tmp: Path, *, left_by: str = "a failed save") -> None:
    """Remove ``tmp`` (by default a failed save's temporary file or directory) as far as it can be removed; what
    cannot be is logged, not raised: the save that leaves it has already failed or completed."""
    try:
        _remove(tmp)
    except FileNotFoundError:
        pass  # removed meanwhile, by another save of the same path
    except OSError as err:
        log.warning("could not remove %s, left by %s: %s", tmp, left_by, err)


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint file or directory.

    A directory is first renamed out of its path, to ``<path>.tmp-<token>`` (one step), then deleted there, manifest
    first: so ``path`` names the complete checkpoint until the instant it names nothing, as a commit replaces it
    (see [Note: atomic saves]). A reader holding it open (``last.ckpt -> step=5.ckpt``, while
    ``ModelCheckpoint(save_top_k=...)`` drops ``step=5.ckpt``) then finds it replaced and reads again, instead of
    meeting a directory that lost its manifest or files and calling the save incomplete. A deletion interrupted
    half-way leaves the temporary name, which a later save of the path removes once this process is gone, and which
    no loader takes for a checkpoint."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        aside = temporary_path(path, new_token())
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return  # deleted meanwhile
        path = aside
    _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _complete_sibling(path: Path) -> Path | None:
    """For ``X.tmp-*`` or ``X.old-*``, ``X`` if it is a complete checkpoint."""
    for marker in (".tmp-", ".old-"):
        if marker in path.name:
            final = path.with_name(path.name.rpartition(marker)[0])
            if final.is_file() or (final / MANIFEST).is_file():
                return final
    return None


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(directory: Path) -> None:
    # A rename or a new file is durable once its directory entry is: fsync the directory (POSIX).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc: Any = None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the OS or the
    file system does not have it.

    Raises:
        OSError: the swap failed otherwise (``FileNotFoundError``: ``a`` or ``b`` is not there).
    """
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            _libc = False
    if not _libc or not hasattr(_libc, "renameat2"):
        return False
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))
