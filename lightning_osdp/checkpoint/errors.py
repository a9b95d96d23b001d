"""Errors a checkpoint raises before any tensor is read, each naming the checkpoint and what is wrong."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointMismatchError", "IncompleteCheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint whose save did not complete (killed mid-save), or whose files were lost or truncated since."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A complete checkpoint that does not fit the model or optimizer: the message names the offending keys."""
