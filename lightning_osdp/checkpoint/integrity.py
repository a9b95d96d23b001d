"""Checksums of a checkpoint's files: recorded while the bytes are written, verified before they are read.

[Note: checksums]
Sizes tell a truncated file from a complete one, not a flipped bit: a shard with one bit changed loaded, trained at
``loss inf`` and consolidated into a parameter of 1.7e36 without a word. So the manifest of a sharded checkpoint
records a CRC-32 of every file (``"checksums": {"__0_0.distcp": "crc32:1c291ca3", ...}``), and every reader checks
the files it relies on first: a load checks them all (each rank a share, see :func:`verify_shared`),
``consolidate`` all, ``saved_plan`` the plan, profile and index. CRC-32 detects every error of up to 32 consecutive
bits and is the cheapest check there is (zlib, ~2 GB/s on one core): it guards against disks, networks and copies,
not against someone who rewrites the manifest too (see [Note: pickles in a checkpoint] for that).

Each rank computes the checksums of the files it writes as DCP writes them (:func:`checksumming_writer`: the bytes
pass through on their way to the file, nothing is read back); rank 0 gathers them into the manifest, and computes
those of its own small files (``meta.pt``, the plan) by reading them.

A full file needs no manifest: ``torch.save`` writes a zip archive that stores a CRC-32 of every record, which
:func:`verify_records` checks (``torch.load`` does not).
"""

from __future__ import annotations

import threading
import zipfile
import zlib
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_osdp import distributed
from lightning_osdp._compat import dcp_writer_file_system
from lightning_osdp.checkpoint.errors import CorruptCheckpointError

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


def _format(crc: int) -> str:
    return f"crc32:{crc:08x}"


def file_checksum(path: Path) -> str:
    """The checksum of a file (``"crc32:<8 hex digits>"``)."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            crc = zlib.crc32(view[:size], crc)
    return _format(crc)


# ---------------------------------------------------------------------------------------------- while writing
class _ChecksummingStream:
    """A file being written sequentially, with the CRC-32 of every byte written so far."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.crc = 0
        #: False once the writer seeks: the bytes written are then not the file's bytes in order.
        self.sequential = True

    def write(self, data: Any) -> int:
        written: int = self._raw.write(data)
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
        with super().create_stream(path, mode) as stream:
            if "w" not in mode or "+" in mode:
                yield stream
            else:
                counted = _ChecksummingStream(stream)
                yield counted
        if counted is not None and counted.sequential:
            with self._lock:
                self.checksums[Path(path).name] = _format(counted.crc)

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
def _failures(directory: Path, manifest: Manifest, names: Iterable[str]) -> list[str]:
    failures = []
    for name in names:
        expected = manifest.checksums.get(name)
        if expected is None:
            continue
        try:
            actual = file_checksum(directory / name)
        except OSError as err:
            failures.append(f"{name} (unreadable: {err.strerror or err})")
            continue
        if actual != expected:
            failures.append(f"{name} (checksum {actual}, recorded {expected} when it was saved)")
    return failures


def _corrupt(directory: Path, failures: list[str]) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"refusing to load checkpoint {str(directory)!r}: the content of {', '.join(sorted(failures))} changed after "
        "the save, its size unchanged (a disk, memory or copy error). Load another checkpoint, or copy this one again "
        "from where it was written"
    )


def verify_checksums(directory: Path, manifest: Manifest, names: Iterable[str] | None = None) -> None:
    """Check the files ``names`` (default: all) of checkpoint ``directory`` against the manifest's checksums, in this
    process. A checkpoint without checksums (written by lightning_osdp 0.1) passes: its sizes were checked when its
    manifest was read.

    Raises:
        CorruptCheckpointError: naming every file whose content changed.
    """
    failures = _failures(directory, manifest, manifest.checksums if names is None else names)
    if failures:
        raise _corrupt(directory, failures)


def verify_shared(directory: Path, manifest: Manifest) -> None:
    """:func:`verify_checksums` of every file, shared out between the ranks (a collective when a process group is
    initialised): file ``i`` is read by rank ``i mod world size`` only, and every rank raises if any file failed."""
    names = sorted(manifest.checksums)
    mine = _failures(directory, manifest, names[distributed.rank() :: distributed.world_size()])
    failures = [f for share in distributed.all_gather(mine) for f in share]
    if failures:
        raise _corrupt(directory, failures)


def verify_records(path: Path, *, shared: bool = False) -> None:
    """Check every record of a ``torch.save`` file against the CRC-32 the zip archive stores for it. A file of the
    legacy (pre-zip) format, or written with ``torch.serialization.set_crc32_options(False)``, has none to check.

    Args:
        shared: the ranks share the records out (record ``i`` is read by rank ``i mod world size``) and every rank
            raises if any failed: a collective when a process group is initialised.

    Raises:
        CorruptCheckpointError: naming the file and the record.
    """
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            if shared:
                records = records[distributed.rank() :: distributed.world_size()]
            failure = _bad_record(archive, records)
    except (zipfile.BadZipFile, EOFError) as err:  # the archive's directory: every rank reads it, and fails alike
        failure = str(err)
    failures = [f for f in (distributed.all_gather(failure) if shared else [failure]) if f is not None]
    if failures:
        raise CorruptCheckpointError(
            f"refusing to load checkpoint file {str(path)!r}: it is damaged ({failures[0]}): its bytes changed after "
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
