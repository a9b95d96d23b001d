"""The demo: a real 2-process CPU training run with ``strategy="osdp"``.

A small GPT (``examples/gpt``) learns the Python standard library's own source, byte by byte. OSDP profiles it on
the first batch, solves for the fastest plan under the memory budget, prints the plan, shards the model with FSDP2
and trains. At the end rank 0 prints the measured throughput and peak memory next to the plan's prediction.

    python examples/demo.py                          # the device's memory as the budget: the plan is DDP-like
    python examples/demo.py --memory-budget 60MiB    # a tight budget: the planner mixes sharded modes in
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpt"))

import lightning_osdp
from lightning_osdp import OSDPStrategy
from lightning_osdp.budget import format_bytes

from gpt import GPTModule
from stdlib_text import StdlibTextDataModule


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-budget", default=None, help="per-device budget, e.g. 60MiB (default: the device)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", default="runs/demo", help="logs, the chosen plan and its profile")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    model = GPTModule(width=args.width, depth=args.depth, heads=4, context_length=args.context, warmup_steps=5)
    data = StdlibTextDataModule(context_length=args.context, batch_size=args.batch_size, max_bytes=1_000_000)
    strategy = OSDPStrategy(memory_budget=args.memory_budget) if args.memory_budget else "osdp"
    trainer = L.Trainer(
        strategy=strategy,
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
    trainer.fit(model, data)

    osdp = trainer.strategy
    assert isinstance(osdp, lightning_osdp.OSDPStrategy) and osdp.plan is not None and osdp.step_time is not None
    if trainer.is_global_zero:
        samples = args.batch_size * trainer.world_size
        tokens = samples * args.context
        report = osdp.plan.report  # the solver's figures (None for a plan passed in with plan=...)
        print("\n=== lightning_osdp demo ===")
        print(f"plan in force : {osdp.plan.summary()} on {trainer.world_size} CPU processes")
        print(f"budget        : {format_bytes(osdp.memory_budget or 0)} per device")
        peak = osdp.peak_memory_bytes or 0
        print(f"peak memory   : {format_bytes(peak)} measured on rank 0", end="")
        if report is not None:
            print(f" (predicted {format_bytes(report.predicted_peak_bytes)})")
        else:
            print()
        print(f"step time     : {osdp.step_time * 1e3:.1f} ms (median)", end="")
        if report is not None:
            print(f" (predicted {report.predicted_step_seconds * 1e3:.1f} ms)")
        else:
            print()
        print(
            f"throughput    : {1 / osdp.step_time:.2f} steps/s, {samples / osdp.step_time:.1f} samples/s, "
            f"{tokens / osdp.step_time:,.0f} tokens/s"
        )
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        print(
            f"final metrics : train_loss {metrics.get('train_loss', float('nan')):.3f}, "
            f"val_ppl {metrics.get('val_ppl', float('nan')):.2f}"
        )


if __name__ == "__main__":
    main()
