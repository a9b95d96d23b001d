"""The demo: a real 2-process CPU training run with ``strategy="osdp"``, at a budget where OSDP must decide.

A small GPT (``examples/gpt``) learns the Python standard library's own source, byte by byte. OSDP profiles it on
the first batch, solves for the fastest plan under the memory budget, prints the plan, shards the model with FSDP2
(DDP for the replicated units), recomputes activations where that pays, and trains. At the end rank 0 prints what
DDP and FSDP would have needed, the plan's prediction and what it measured, and the throughput.

    python examples/demo.py                          # a budget FULL_SHARD alone cannot meet: the plan must decide
    python examples/demo.py --memory-budget 200MiB   # an ample budget: the plan is DDP
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpt"))

import lightning_osdp
from lightning_osdp import OSDPStrategy, Plan, predict, profile
from lightning_osdp.budget import format_bytes

from gpt import GPTModule
from stdlib_text import StdlibTextDataModule

#: The automatic budget, as a fraction of what FULL_SHARD needs without recomputation (predicted): below it, only a
#: plan that recomputes some activations fits; above the smallest budget any plan meets.
TIGHT = 0.55


def model(args: argparse.Namespace) -> GPTModule:
    L.seed_everything(0)
    return GPTModule(width=args.width, depth=args.depth, heads=4, context_length=args.context, warmup_steps=5)


def data(args: argparse.Namespace) -> StdlibTextDataModule:
    return StdlibTextDataModule(context_length=args.context, batch_size=args.batch_size, max_bytes=1_000_000)


def tight_budget(args: argparse.Namespace) -> int:
    """A budget below FULL_SHARD's predicted need on ``args.devices`` ranks (memory does not depend on the collectives'
    speed, so a one-process profile of one batch tells it)."""
    loader = data(args)
    loader.prepare_data()
    loader.setup("fit")
    first = next(iter(loader.train_dataloader()))
    module = model(args)
    # The example's configure_optimizers reads the Trainer's step count (its schedule); the state is AdamW's.
    prof = profile(module, first, optimizer=torch.optim.AdamW)
    need = predict(prof, Plan.uniform(module, "full_shard"), args.devices).peak_bytes
    return int(TIGHT * need)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--memory-budget",
        default="auto",
        help=f"per-device budget, e.g. 60MiB; 'auto': {TIGHT:.0%} of FULL_SHARD's predicted need (default)",
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", default="runs/demo", help="logs, the chosen plan and its profile")
    args = parser.parse_args(argv)

    budget = tight_budget(args) if args.memory_budget == "auto" else args.memory_budget
    trainer = L.Trainer(
        strategy=OSDPStrategy(memory_budget=budget),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        val_check_interval=args.steps,
        limit_val_batches=4,
        log_every_n_steps=10,
        default_root_dir=args.out,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    gpt = model(args)
    trainer.fit(gpt, data(args))

    osdp = trainer.strategy
    assert isinstance(osdp, lightning_osdp.OSDPStrategy) and osdp.plan is not None and osdp.step_time is not None
    if trainer.is_global_zero:
        samples = args.batch_size * trainer.world_size
        tokens = samples * args.context
        print("\n=== lightning_osdp demo ===")
        if osdp.profile is not None:
            # What the plain strategies would need, from the same profile (rank 0's, with this run's collectives).
            needs = []
            for name, mode, recompute in (("DDP", "no_shard", False), ("FSDP", "full_shard", False)):
                baseline = Plan.uniform(gpt, mode, recompute=recompute)
                needs.append(f"{name} {format_bytes(predict(osdp.profile, baseline, trainer.world_size).peak_bytes)}")
            print(f"would need : {', '.join(needs)} per device (predicted); budget {format_bytes(osdp.memory_budget)}")
        print(f"run        : {osdp.summary()}")
        print(
            f"throughput : {1 / osdp.step_time:.2f} steps/s, {samples / osdp.step_time:.1f} samples/s, "
            f"{tokens / osdp.step_time:,.0f} tokens/s on {trainer.world_size} CPU processes"
        )


if __name__ == "__main__":
    main()
