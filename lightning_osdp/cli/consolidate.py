"""``osdp consolidate CHECKPOINT OUT.ckpt``: a sharded checkpoint directory to one plain Lightning file.

A thin wrapper: the work is :func:`lightning_osdp.checkpoint.consolidate` (see its module for what the file holds).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lightning_osdp.budget import format_bytes
from lightning_osdp.checkpoint.consolidate import consolidate as consolidate_checkpoint
from lightning_osdp.checkpoint.errors import CheckpointError
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.output import Output

__all__ = ["main", "run"]


def run(args: argparse.Namespace, out: Output) -> int:
    """Run ``osdp consolidate``; returns the exit status."""
    start = time.perf_counter()
    if not Path(args.checkpoint).exists() and not Path(args.checkpoint).is_symlink():
        # A link to nothing is `last.ckpt` between two saves of a running training: consolidate reads it again.
        raise CLIError(f"checkpoint {args.checkpoint!r} does not exist")
    try:
        with out.step(f"consolidating {args.checkpoint}"):
            path = consolidate_checkpoint(
                args.checkpoint, args.out, optimizer=not args.weights_only, weights_only=not args.allow_pickle
            )
    except CheckpointError as err:
        raise CLIError(str(err)) from None
    out.print(f"wrote {path} ({format_bytes(path.stat().st_size)}) in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``osdp consolidate`` with ``argv`` (default ``sys.argv[1:]``); returns its exit
    status (2 when the checkpoint is refused, with the reason on stderr). ``python -m
    lightning_osdp.checkpoint.consolidate`` runs it."""
    from lightning_osdp.cli import main as osdp

    return osdp(["consolidate", *(sys.argv[1:] if argv is None else argv)])
