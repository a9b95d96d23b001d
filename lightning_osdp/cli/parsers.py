"""The ``osdp`` command's arguments: one ``add_*_parser`` per subcommand, and the vocabulary they accept.

[Note: a parser without torch]
``osdp --help``, ``osdp plan --help`` and every usage error are answered by the parser alone, so building it
imports neither torch nor Lightning, which take many times longer to import than the help takes to print: this
module imports ``argparse`` and the built-in hardware table only, and each subcommand's module (``plan.py``,
``show.py``...) is imported when that subcommand runs. ``tests/test_imports.py`` checks it in a fresh interpreter.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_osdp.cli.hardware import HARDWARE, NETWORKS

# NOTE: lightning_osdp.solver.policy.DEFAULT_MEMORY_HEADROOM, written out: importing it would import torch (a test
# keeps the two equal).
DEFAULT_MEMORY_HEADROOM_TEXT = "0.02"
# NOTE: lightning_osdp.solver.ilp.SOLVERS, written out for the same reason (the same test keeps them equal).
SOLVERS = ("highs",)
# NOTE: lightning_osdp.solver.ilp.DEFAULT_GAP, written out for the same reason (the same test keeps them equal).
DEFAULT_GAP = 1e-3

__all__ = [
    "COMMANDS",
    "MFU_CONVENTIONS",
    "MODE_NAMES",
    "OPTIMIZERS",
    "PRECISIONS",
    "add_consolidate_parser",
    "add_hardware_parser",
    "add_plan_parser",
    "add_show_parser",
]

#: Lightning's precision flags the dry run accepts, and the flag each alias stands for; 64-bit has no tensor-core
#: rate worth modelling. ``bf16-fsdp`` is ``Trainer(precision="bf16-mixed")`` with
#: ``OSDPStrategy(mixed_precision="bf16")``: sharded units gather bf16 and reduce fp32 (FSDP2's policy).
PRECISIONS: dict[str, str] = {
    "32": "32-true",
    "32-true": "32-true",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16-true",
    "bf16-fsdp": "bf16-fsdp",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "16-true": "16-true",
}

#: ``osdp plan --optimizer`` names: the ``torch.optim`` class and its keyword arguments (the state it keeps is all
#: a dry run needs of it).
OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {
    "adamw": ("AdamW", {}),
    "adam": ("Adam", {}),
    "sgd": ("SGD", {"lr": 0.1}),
    "sgd-momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
}

#: ``osdp plan --mfu-convention`` names, the default first (``lightning_osdp.cli.plan.model_flops_utilization``).
MFU_CONVENTIONS: tuple[str, ...] = ("palm", "flash-attention")

#: ``lightning_osdp.plan.MODES``, spelled out here because that module imports torch (a test checks they agree).
MODE_NAMES: tuple[str, ...] = ("no_shard", "shard_grad_op", "full_shard", "hybrid_shard")

# ``format_bytes(lightning_osdp.budget.CUDA_RESERVE_BYTES)``, for the same reason (a test checks they agree).
_CUDA_RESERVE = "2.00 GiB"

_PLAN_EXAMPLE = """example: a GPT-2-XL-shaped model (1.3B parameters) on 8 GeForce RTX 4090s
  osdp plan --model examples/gpt/gpt.py:GPTModule \\
      --init-args '{"width": 2048, "depth": 24, "heads": 16, "context_length": 1024, "vocab_size": 50304}' \\
      --world-size 8 --memory 24GiB --hardware rtx4090-pcie --batch-size 4"""


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``osdp plan`` and its options (run by ``lightning_osdp.cli.plan``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="dry-run OSDP, DDP, ZeRO-2 and FSDP for a model on given hardware (no GPU needed)",
        description="Will it fit, and how fast? Profile a model on fake tensors with the target hardware's figures,\n"
        "solve the OSDP plan under a per-device memory budget, and compare it with DDP, ZeRO-2 and FSDP\n"
        "(and HSDP on several nodes), with the largest batch size each fits. Needs no GPU and no cluster.",
        epilog=_PLAN_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="YAML",
        help="LightningCLI config(s); model:, data.batch_size, trainer.precision/devices and the "
        "OSDP strategy's init args are read (repeatable, later ones override)",
    )
    model.add_argument("--model", metavar="CLASS", help="module:Class, package.module.Class or path/to/file.py:Class")
    model.add_argument("--init-args", metavar="JSON", help="the model's __init__ arguments as a JSON object")
    model.add_argument(
        "--init-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one __init__ argument (value read as YAML); repeatable, overrides --init-args",
    )
    model.add_argument(
        "--batch",
        metavar="SPEC",
        help="DTYPE:SHAPE per tensor (int64:8x1025; comma-separated for a tuple) or module:function "
        "called with the batch size; default: the model's example_input_array, or token windows of "
        "context_length + 1",
    )
    model.add_argument("--batch-size", type=int, metavar="N", help="per-device batch size")
    model.add_argument(
        "--accumulate-grad-batches",
        type=int,
        metavar="K",
        help="micro-batches per optimizer step, as the Trainer's accumulate_grad_batches (default: config, else 1): "
        "the unsharded gradients are held between them, and a step trains K batches",
    )
    model.add_argument(
        "--tokens-per-sample",
        type=int,
        metavar="T",
        help="tokens a sample trains on, for the tokens/s per GPU columns (default: the token windows' "
        "context_length; none for a --batch or an example_input_array)",
    )
    model.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        help="Lightning precision (default: config, else 32-true); bf16-fsdp: bf16-mixed with "
        "OSDPStrategy(mixed_precision='bf16'), FSDP2 gathering bf16 and reducing fp32",
    )
    model.add_argument(
        "--optimizer",
        choices=["auto", *OPTIMIZERS],
        default="auto",
        help="optimizer whose state is counted; auto: configure_optimizers(), AdamW if it needs a Trainer",
    )
    machine = parser.add_argument_group("machine")
    machine.add_argument(
        "--world-size", type=int, metavar="N", help="number of GPUs (default: config devices x num_nodes)"
    )
    machine.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="machines (with --gpus-per-node; world size N x G, default: as few as hold --world-size)",
    )
    machine.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs of each machine (with --nodes)")
    machine.add_argument(
        "--network",
        metavar="NAME",
        help=f"built-in network between nodes: {', '.join(NETWORKS)} (default: the --hardware entry's)",
    )
    machine.add_argument(
        "--memory",
        metavar="BYTES",
        help="per-device memory budget, e.g. 24GiB (default: the config's, else the GPU's memory "
        f"less {_CUDA_RESERVE})",
    )
    machine.add_argument("--hardware", metavar="NAME", help=f"built-in figures: {', '.join(HARDWARE)}")
    machine.add_argument(
        "--hardware-profile",
        metavar="JSON",
        help="measured figures: a saved profile (osdp_plan.profile.json) from a run on the target",
    )
    planner = parser.add_argument_group("planner")
    planner.add_argument(
        "--modes", metavar="M[,M...]", help=f"modes OSDP may choose (default: all of {', '.join(MODE_NAMES)})"
    )
    planner.add_argument("--max-split", type=int, metavar="K", help="largest operator-splitting factor (default 8)")
    planner.add_argument(
        "--shard-group-size",
        type=int,
        metavar="S",
        help="ranks a hybrid_shard unit shards over, as OSDPStrategy(shard_group_size=...) (default: one node's)",
    )
    planner.add_argument(
        "--activation-checkpointing",
        choices=("auto", "selective", "full", "none"),
        metavar="{auto,selective,full,none}",
        help="recomputation the planner may choose, as OSDPStrategy(activation_checkpointing=...): auto (per unit, "
        "where it pays), selective or full on every block, none (default: the config's, else auto)",
    )
    # The flags are OSDPStrategy's argument names (PlannerOptions' fields); the shorter ones they had first stay.
    planner.add_argument(
        "--solver-time-limit",
        "--time-limit",
        dest="solver_time_limit",
        type=float,
        default=10.0,
        metavar="S",
        help="wall-clock safety net of the ILP solve (seconds per solver run; the solve stops on work limits), "
        "as OSDPStrategy(solver_time_limit=...)",
    )
    planner.add_argument(
        "--solver-gap",
        "--gap",
        dest="solver_gap",
        type=float,
        default=DEFAULT_GAP,
        metavar="G",
        help="relative optimality gap the OSDP solve stops at, as OSDPStrategy(solver_gap=...) (default: %(default)g)",
    )
    planner.add_argument(
        "--solver",
        choices=(*SOLVERS, "cbc"),
        default=SOLVERS[0],
        help="the ILP's solver: highs (HiGHS in process, the only one; cbc was removed and plans on HiGHS with a "
        "warning), as OSDPStrategy(solver=...) (default: %(default)s)",
    )
    planner.add_argument(
        "--memory-headroom",
        "--headroom",
        dest="memory_headroom",
        type=float,
        metavar="F",
        help="fraction of the budget the planner keeps free, as OSDPStrategy(memory_headroom=...) does "
        f"(default: the config's, else {DEFAULT_MEMORY_HEADROOM_TEXT})",
    )
    parser.add_argument("--out", metavar="PLAN.json", help="save the OSDP plan here (its profile beside it)")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the OSDP plan's predicted memory over the step beside FSDP's, and the plan (needs matplotlib)",
    )
    report = parser.add_argument_group("report")
    report.add_argument(
        "--mfu-convention",
        choices=MFU_CONVENTIONS,
        default=MFU_CONVENTIONS[0],
        help="palm: causal attention counted in full, as PaLM's appendix B, torchtitan and docs/benchmarks.md "
        "count it; flash-attention: at the half of the scores its kernels compute, as FlashAttention's "
        "benchmarks count it (default: %(default)s)",
    )
    _add_all_units(report)
    return parser


def _add_all_units(parser: Any) -> None:
    """``--all-units``, for the commands that print a plan table (``plan``, ``show``)."""
    parser.add_argument(
        "--all-units",
        action="store_true",
        help="list every unit in the plan table (default: runs of identical blocks folded into one line)",
    )


def add_show_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``osdp show`` (run by ``lightning_osdp.cli.show``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "show",
        help="show a saved plan (plan file, sharded checkpoint directory or .ckpt file) as a table",
        description="Show a saved OSDP plan as a table: from a plan file (with NAME.profile.json beside it, if "
        "any), a sharded checkpoint directory or a .ckpt file. With a profile, each unit's predicted memory and "
        "time are shown; --plot draws its predicted memory over the step beside FSDP's.",
    )
    parser.add_argument("path", help="plan .json, sharded checkpoint directory, or .ckpt file")
    parser.add_argument("--world-size", type=int, metavar="N", help="predict for N ranks (default: the saved one)")
    parser.add_argument("--profile", action="store_true", help="also print the per-module profile")
    parser.add_argument("--depth", type=int, default=None, metavar="D", help="fold the profile table to depth D")
    _add_all_units(parser)
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the memory over the step beside FSDP's, and the plan (needs matplotlib)",
    )
    return parser


def add_consolidate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``osdp consolidate`` (run by ``lightning_osdp.cli.consolidate``)."""
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


def add_hardware_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``osdp hardware`` (run by ``lightning_osdp.cli.hardware``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "hardware",
        help="list the built-in hardware figures that osdp plan --hardware uses",
        description="The built-in hardware figures: data-sheet peaks, the efficiencies applied, and the collective "
        "times they imply at a world size. Approximations: see lightning_osdp/cli/hardware.py.",
    )
    parser.add_argument("--world-size", type=int, default=8, metavar="N", help="world size of the collective times")
    return parser


#: Subcommand -> (its parser, the module whose ``run(args, out)`` runs it), in ``osdp --help`` order.
COMMANDS: dict[str, tuple[Any, str]] = {
    "plan": (add_plan_parser, "lightning_osdp.cli.plan"),
    "show": (add_show_parser, "lightning_osdp.cli.show"),
    "consolidate": (add_consolidate_parser, "lightning_osdp.cli.consolidate"),
    "hardware": (add_hardware_parser, "lightning_osdp.cli.hardware"),
}
