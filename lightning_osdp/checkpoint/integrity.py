"""Checksums of a checkpoint's files: recorded while the bytes are written, verified as they are read.

[Note: checksums]
Sizes tell a truncated file from a complete one, not a flipped bit: a shard with one bit changed loaded, trained at
``loss inf`` and consolidated into a parameter of 1.7e36 without a word. So the manifest of a sharded checkpoint
records a CRC-32 of every file (``"checksums": {"__0_0.distcp": "crc32:1c291ca3", ...}``), and every reader checks
the files it relies on: a load checks them all (the shards each rank a share, see :func:`verify_shared`),
``consolidate`` all, ``saved_plan`` the plan, profile and index. Small files are checked on the very bytes that are
then parsed; shards through the checkpoint directory the reader holds open, which DCP then reads through (see
``files``' [Note: reading a directory that may be replaced]). CRC-32 detects every error of up to 32 consecutive
bits and is the cheapest check there is (zlib, ~2 GB/s on one core): it guards against disks, networks and copies,
not against someone who rewrites the manifest too (see [Note: pickles in a checkpoint] for that).

Each rank computes the checksums of the files it writes as DCP writes them (:func:`checksumming_writer`: the bytes
pass through on their way to the file, nothing is read back); rank 0 gathers them into the manifest, and computes
those of its own small files (``meta.pt``, the plan) by reading them.

A full file needs no manifest: ``torch.save`` writes a zip archive that stores a CRC-32 of every record, which
:func:`verify_records` checks (``torch.load`` does not).
"""

from __future__ import annotations

import json
import threading
import zipfile
import zlib
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_osdp import distributed
from lightning_osdp._compat import dcp_writer_file_system
from lightning_osdp.checkpoint.errors import CheckpointError, CorruptCheckpointError
from lightning_osdp.checkpoint.files import (
    CheckpointDirectory,
    CheckpointReplacedError,
    changed,
    corrupt_error,
    format_checksum,
)

if TYPE_CHECKING:
    from lightning_osdp.checkpoint.layout import Manifest

__all__ = [
    "CHECKSUM_PATTERN",
    "checksumming_writer",
    "file_checksum",
    "verify_checksums",
    "verify_records",
    "verify_shared",
    "written_checksums",
]

#: A checksum as the manifest records it.
CHECKSUM_PATTERN = r"crc32:[0-9a-f]{8}"
_CHUNK = 1 << 23


def file_checksum(path: Path) -> str:
    """The checksum of a file (``"crc32:<8 hex digits>"``)."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            crc = zlib.crc32(view[:size], crc)
    return format_checksum(crc)


# ---------------------------------------------------------------------------------------------- while writing
class _ChecksummingStream:
    """A file being written sequentially, with the CRC-32 of every byte written so far."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.crc = 0
        #: False once the writer seeks: the bytes written are then not the file's bytes in order.
        self.sequential = True
        #: The first error the file raised: torch's zip writer reports a failed write as its own RuntimeError
        #: ("unexpected pos"), losing the cause (ENOSPC), which the file system raises again in its place.
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written: int = self._raw.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view[:written] if written is not None else view, self.crc)
        return written

    def seek(self, *args: Any) -> int:
        self.sequential = False
        result: int = self._raw.seek(*args)
        return result

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush, close...
        return getattr(self._raw, name)


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording the checksum of every file written through it, by file name."""

    def __init__(self) -> None:
        self.checksums: dict[str, str] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        counted: _ChecksummingStream | None = None
        try:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode or "+" in mode:
                    yield stream
                else:
                    counted = _ChecksummingStream(stream)
                    yield counted
        except Exception as err:
            if counted is not None and counted.error is not None and err is not counted.error:
                raise counted.error from err
            raise
        if counted is not None and counted.sequential:
            with self._lock:
                self.checksums[Path(path).name] = format_checksum(counted.crc)

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)  # DCP writes `.metadata.tmp`, then renames it
        with self._lock:
            value = self.checksums.pop(Path(path).name, None)
            if value is not None:
                self.checksums[Path(new_path).name] = value


def checksumming_writer(path: Path) -> FileSystemWriter:
    """DCP's ``FileSystemWriter`` for ``path`` (files synced), recording each file's checksum as it is written
    (:func:`written_checksums`)."""
    writer = FileSystemWriter(path, sync_files=True)
    # If a torch release stops writing through this file system, the save computes the checksums by reading the
    # files back (`write_manifest`). tests/test_checkpoint_safety.py checks that every file DCP writes is
    # checksummed while it is written.
    dcp_writer_file_system(writer, replace_with=_ChecksummingFileSystem())
    return writer


def written_checksums(writer: FileSystemWriter) -> dict[str, str]:
    """File name -> checksum of every file this process wrote through ``writer``."""
    fs = dcp_writer_file_system(writer)
    return dict(fs.checksums) if isinstance(fs, _ChecksummingFileSystem) else {}


# ---------------------------------------------------------------------------------------------- before reading
def _failures(directory: CheckpointDirectory, manifest: Manifest, names: Iterable[str]) -> list[str]:
    failures = []
    for name in names:
        expected = manifest.checksums.get(name)
        if expected is None:
            continue
        try:
            actual = directory.checksum(name)
        except CheckpointReplacedError:
            raise
        except CheckpointError as err:
            failures.append(f"{name} ({err})")
            continue
        if actual != expected:
            failures.append(changed(name, actual, expected))
    return failures


def verify_checksums(directory: CheckpointDirectory, manifest: Manifest, names: Iterable[str] | None = None) -> None:
    """Check the files ``names`` (default: all) of the checkpoint ``directory`` holds against the manifest's checksums,
    in this process. A checkpoint without checksums (written by lightning_osdp 0.1) passes: its sizes were checked
    when its manifest was read.

    Raises:
        CorruptCheckpointError: naming every file whose content changed.
        CheckpointReplacedError: the checkpoint was replaced while its files were read.
    """
    failures = _failures(directory, manifest, manifest.checksums if names is None else names)
    if failures:
        if directory.replaced():
            raise directory.replaced_error()
        raise corrupt_error(directory.path, failures)


def verify_shared(directory: CheckpointDirectory, manifest: Manifest, names: Iterable[str]) -> None:
    """:func:`verify_checksums` of ``names``, shared out between the ranks (a collective when a process group is
    initialised): file ``i`` is read by rank ``i mod world size`` only, and every rank raises if any file failed.

    The ranks also compare the manifests they read: ranks that opened different saves of the checkpoint (it was
    replaced between their opens) all raise :class:`CheckpointReplacedError`, rather than load a mix of two saves.
    """
    mine: list[str] | str
    try:
        mine = _failures(directory, manifest, sorted(names)[distributed.rank() :: distributed.world_size()])
    except CheckpointReplacedError:
        mine = "replaced"
    fingerprint = json.dumps(manifest.to_dict(), sort_keys=True)
    shares = distributed.all_gather((fingerprint, mine))
    if any(share == "replaced" or seen != fingerprint for seen, share in shares):
        raise directory.replaced_error()
    failures = [f for _, share in shares for f in share]
    if failures:
        raise corrupt_error(directory.path, failures)


def verify_records(file: IO[bytes], *, source: Path, shared: bool = False) -> None:
    """Check every record of a ``torch.save`` file (open in ``file``) against the CRC-32 the zip archive stores for
    it. A file of the legacy (pre-zip) format, or written with ``torch.serialization.set_crc32_options(False)``, has
    none to check.

    Args:
        source: the file's path, for messages.
        shared: the ranks share the records out (record ``i`` is read by rank ``i mod world size``) and every rank
            raises if any failed: a collective when a process group is initialised. The ranks also compare the
            archives' directories (every record's CRC): ranks that opened different saves of the file (it was
            replaced between their opens) raise :class:`CheckpointReplacedError`.

    Raises:
        CorruptCheckpointError: naming the file and the record.
    """
    fingerprint: Any = None
    if not zipfile.is_zipfile(file):
        failure = None
    else:
        try:
            file.seek(0)
            with zipfile.ZipFile(file) as archive:
                records = archive.infolist()
                fingerprint = [(info.filename, info.CRC, info.file_size) for info in records]
                if shared:
                    records = records[distributed.rank() :: distributed.world_size()]
                failure = _bad_record(archive, records)
        except (zipfile.BadZipFile, EOFError) as err:  # the archive's directory: every rank reads it, and fails alike
            failure = str(err)
    file.seek(0)
    outcomes = distributed.all_gather((fingerprint, failure)) if shared else [(fingerprint, failure)]
    if any(seen != fingerprint for seen, _ in outcomes):
        raise CheckpointReplacedError(
            f"checkpoint file {str(source)!r} was replaced by a newer save while the ranks were reading it (a training "
            "saves it again); nothing of it was used: read it again"
        )
    failures = [f for _, f in outcomes if f is not None]
    if failures:
        raise CorruptCheckpointError(
            f"refusing to load checkpoint file {str(source)!r}: it is damaged ({failures[0]}): its bytes changed after "
            "it was written (a disk, memory or copy error), or it was cut short. Load another checkpoint"
        )


def _bad_record(archive: zipfile.ZipFile, records: Iterable[zipfile.ZipInfo]) -> str | None:
    """The first of ``records`` whose bytes do not match their CRC-32, as zipfile describes it; ``None`` if all do."""
    for info in records:
        if info.CRC == 0 and info.file_size:
            continue  # written without CRCs
        try:
            with archive.open(info) as record:
                while record.read(_CHUNK):
                    pass
        except (zipfile.BadZipFile, EOFError) as err:
            return str(err)
    return None
