"""A byte-level language-modelling corpus that every machine has offline: the Python standard library's sources.

The files are read from the running interpreter's installation (``sysconfig.get_paths()["stdlib"]``), so nothing
is downloaded, and every rank of a job reads the same bytes. Which files are used, in which order, and whether a
file is training or validation text depend only on its path relative to the library root, through SHA-1 (never
Python's ``hash()``, which is salted per process and would give every rank a different corpus).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "FILE_SEPARATOR",
    "ByteTokenizer",
    "StdlibTextDataModule",
    "TokenWindows",
    "path_fraction",
    "stdlib_source_files",
]

#: Byte placed between two files in the token stream: ASCII "file separator", which source code never contains,
#: so the model can learn where a file ends without a special token outside the 256 byte values.
FILE_SEPARATOR = 0x1C

# Third-party packages and caches live under the stdlib directory but are not the standard library (and differ
# from machine to machine).
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no unknown token, no training, exact round trip for any text."""

    vocab_size: int = 256

    def encode(self, text: str) -> Tensor:
        """Token ids (``int64``) of ``text``'s UTF-8 bytes."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """Text from token ids; a byte sequence cut inside a multi-byte character decodes to U+FFFD there."""
        values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


def stdlib_source_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """The ``.py`` files under ``root`` (default: this interpreter's standard library), as sorted POSIX paths
    relative to ``root``; third-party ``site-packages`` and caches are left out."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for directory, subdirs, files in os.walk(base):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        rel = Path(directory).relative_to(base)
        found.extend((rel / name).as_posix() for name in files if name.endswith(".py"))
    return sorted(found)


def path_fraction(path: str, salt: str) -> float:
    """A number in ``[0, 1)`` that depends only on ``salt`` and ``path``: the same on every machine and rank."""
    digest = hashlib.sha1(f"{salt}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class TokenWindows(Dataset[Tensor]):
    """Non-overlapping windows of ``context_length + 1`` tokens over a 1-D token stream.

    Item ``i`` starts at token ``i * context_length``: consecutive windows share one token, the last target of a
    window being the first input of the next, so that every token of the stream is predicted exactly once.
    """

    def __init__(self, tokens: Tensor, context_length: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"expected a 1-D token stream, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.context_length = context_length

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.context_length, 0)

    def __getitem__(self, index: int) -> Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.context_length
        return self.tokens[start : start + self.context_length + 1].long()


class StdlibTextDataModule(L.LightningDataModule):
    """Byte-level text of the Python standard library, split into training and validation by file.

    Files are visited in the order of a per-path hash (a spread sample of the library, not just the modules whose
    names start with "a"); each file goes to validation when a second, independent per-path hash falls below
    ``val_fraction``. Files are added until training holds ``(1 - val_fraction) * max_bytes`` bytes and validation
    ``val_fraction * max_bytes`` (the file crossing a limit is cut there), so that setup reads a bounded amount.

    Args:
        context_length: tokens a model sees per sample; a sample holds ``context_length + 1`` (inputs + targets).
        batch_size: samples per batch and per process.
        max_bytes: total bytes read (training + validation).
        val_fraction: share of files, and of ``max_bytes``, used for validation.
        num_workers: DataLoader worker processes.
        root: directory to read instead of the interpreter's standard library.
    """

    def __init__(
        self,
        context_length: int = 64,
        batch_size: int = 16,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        root: str | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.context_length = context_length
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
        self.tokenizer = ByteTokenizer()
        self.train_files: list[str] = []
        self.val_files: list[str] = []
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read the files and build the training and validation windows (idempotent)."""
        if self.train_set is not None:
            return
        files = stdlib_source_files(self.root)
        if not files:
            raise FileNotFoundError(f"no .py files under {self.root}")
        order = sorted(files, key=lambda p: (path_fraction(p, "order"), p))
        limits = {"val": int(self.max_bytes * self.val_fraction)}
        limits["train"] = self.max_bytes - limits["val"]
        chunks: dict[str, list[bytes]] = {"train": [], "val": []}
        used = {"train": 0, "val": 0}
        chosen: dict[str, list[str]] = {"train": [], "val": []}
        for path in order:
            split = "val" if path_fraction(path, "split") < self.val_fraction else "train"
            room = limits[split] - used[split]
            if room <= 0:
                if all(used[s] >= limits[s] for s in limits):
                    break
                continue
            data = (self.root / path).read_bytes()[:room]
            chunks[split].append(data)
            used[split] += len(data)
            chosen[split].append(path)
        self.train_files, self.val_files = chosen["train"], chosen["val"]
        self.train_set = TokenWindows(_join(chunks["train"]), self.context_length)
        self.val_set = TokenWindows(_join(chunks["val"]), self.context_length)
        if len(self.train_set) == 0 or len(self.val_set) == 0:
            raise ValueError(
                f"max_bytes={self.max_bytes} leaves no full window of {self.context_length + 1} tokens for "
                f"training ({used['train']} bytes) or validation ({used['val']} bytes); raise max_bytes"
            )
        rank_zero_info(
            f"StdlibText: {len(self.train_files)} files / {used['train']:,} bytes / {len(self.train_set):,} windows "
            f"for training, {len(self.val_files)} files / {used['val']:,} bytes / {len(self.val_set):,} windows "
            f"for validation, from {self.root}"
        )

    def train_dataloader(self) -> DataLoader[Tensor]:
        """Shuffled training windows (Lightning swaps in a ``DistributedSampler`` on several processes)."""
        assert self.train_set is not None, "call setup() first"
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, drop_last=True
        )

    def val_dataloader(self) -> DataLoader[Tensor]:
        """Validation windows in file order."""
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


def _join(chunks: Iterable[bytes]) -> Tensor:
    stream = bytes([FILE_SEPARATOR]).join(chunks)
    # uint8 keeps the corpus at one byte per token; windows are widened to int64 when read.
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8) if stream else torch.empty(0, dtype=torch.uint8)
