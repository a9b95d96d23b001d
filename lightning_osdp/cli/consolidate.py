"""``osdp consolidate CHECKPOINT OUT.ckpt``: a sharded checkpoint directory to one plain Lightning file.

A thin wrapper: the work is :func:`lightning_osdp.checkpoint.consolidate` (see its module for what the file holds).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from lightning_osdp.budget import format_bytes
from lightning_osdp.checkpoint import CheckpointError, consolidate
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.output import Output

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``osdp consolidate``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "consolidate",
        help="turn a sharded OSDP checkpoint directory into one .ckpt file (no OSDP needed to load it)",
        description="Turn a sharded lightning_osdp checkpoint directory into one Lightning .ckpt file that "
        "MyModule.load_from_checkpoint() loads without OSDP, a process group or a GPU.",
    )
    parser.add_argument("checkpoint", help="sharded checkpoint directory")
    parser.add_argument("out", help="the .ckpt file to write")
    parser.add_argument("--weights-only", action="store_true", help="leave the optimizer states out")
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="also create objects of other classes than plain data and tensors from the checkpoint (Lightning "
        "hyper-parameters of your own classes, say): this runs code from the checkpoint, so only for checkpoints "
        "from a source you trust",
    )
    return parser


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
