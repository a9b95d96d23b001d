"""Errors a checkpoint raises before any tensor is read, each naming the checkpoint and what is wrong."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "UntrustedContentError",
]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint whose save did not complete (killed mid-save), or whose files were lost or truncated since."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file whose bytes changed after the save: its checksum (or its records' CRCs) no longer match."""


class UntrustedContentError(CheckpointError):
    """A checkpoint file that holds objects other than plain data and tensors: creating them would run code from the
    file, so it loads only when the caller trusts it (``weights_only=False``)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A complete checkpoint that does not fit the model or optimizer: the message names the offending keys."""
