"""``osdp consolidate CHECKPOINT OUT.ckpt``: a sharded checkpoint directory to one plain Lightning file.

A thin wrapper: the work is :func:`lightning_osdp.checkpoint.consolidate` (see its module for what the file holds).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lightning_osdp.budget import format_bytes
from lightning_osdp.checkpoint import CheckpointError, consolidate
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.output import Output

__all__ = ["run"]


def run(args: argparse.Namespace, out: Output) -> int:
    """Run ``osdp consolidate``; returns the exit status."""
    start = time.perf_counter()
    if not Path(args.checkpoint).exists():
        raise CLIError(f"checkpoint {args.checkpoint!r} does not exist")
    try:
        with out.step(f"consolidating {args.checkpoint}"):
            path = consolidate(
                args.checkpoint, args.out, optimizer=not args.weights_only, weights_only=not args.allow_pickle
            )
    except CheckpointError as err:
        raise CLIError(str(err)) from None
    out.print(f"wrote {path} ({format_bytes(path.stat().st_size)}) in {time.perf_counter() - start:.1f} s")
    return 0
