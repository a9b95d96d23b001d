"""The ``osdp`` command: plan a model before renting a cluster, inspect a plan, consolidate a checkpoint.

``osdp plan``
    dry run: the OSDP plan, and DDP / ZeRO-2 / FSDP beside it, for a model on given hardware (``plan.py``);
    ``--plot`` draws its predicted memory over the step beside FSDP's (``plot.py``).
``osdp show PLAN_OR_CHECKPOINT``
    a saved plan as a table, with its profile's figures (``show.py``); ``--plot`` draws it as ``osdp plan`` does.
``osdp consolidate CHECKPOINT OUT.ckpt``
    a sharded checkpoint directory to one Lightning file (``consolidate.py``).
``osdp hardware``
    the built-in hardware figures ``osdp plan --hardware`` uses (``hardware.py``).

Building the parser imports neither torch nor Lightning (``parsers.py``): each subcommand's module is imported
when it runs.

A mistake in what the user gave (an unknown name, a path that does not exist, a budget no plan fits) ends the
command with exit status 2 and one line on stderr, ``osdp: error: ...``; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lightning_osdp.cli.errors import EXIT_USAGE, CLIError

__all__ = ["CLIError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``osdp`` argument parser with every subcommand; ``args.run_module`` names the module that runs the
    chosen one."""
    from lightning_osdp.cli.parsers import COMMANDS

    parser = argparse.ArgumentParser(
        prog="osdp",
        description="Optimal Sharded Data Parallel for Lightning: plan, inspect and consolidate.",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser, module in COMMANDS.values():
        add_parser(subparsers).set_defaults(run_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``osdp`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exit_:  # --help, or a usage error argparse already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    # After parsing, not before: these import torch (see parsers.py's [Note: a parser without torch]).
    from lightning_osdp.checkpoint import CheckpointError
    from lightning_osdp.cli.output import Output
    from lightning_osdp.plan import PlanError

    out = Output(quiet=args.quiet)
    try:
        return int(importlib.import_module(args.run_module).run(args, out))
    except (CLIError, PlanError, CheckpointError) as err:
        message = " ".join(str(err).split())
        print(f"osdp: error: {message}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("osdp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`osdp show ... | head`): not an error of ours. Point stdout at nothing so that
        # the interpreter's final flush does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
