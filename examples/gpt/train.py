"""Train the GPT example through LightningCLI.

Run from the repository root (plan paths in the configs are relative to it), for example::

    python examples/gpt/train.py fit --config examples/gpt/configs/osdp_plan.yaml

``--print_config`` shows every option; any of them can be overridden on the command line
(``--trainer.max_steps 100``, ``--model.width 128``, ``--data.batch_size 32``).
"""

from __future__ import annotations

import math

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_osdp  # registers strategy="osdp" with Lightning

from gpt import GPTModule
from stdlib_text import StdlibTextDataModule

__all__ = ["GPTCLI", "final_report", "main"]


class GPTCLI(LightningCLI):
    """LightningCLI whose data windows always match the model's context (the positional-embedding table)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.context_length", "data.context_length")


def final_report(trainer: Trainer) -> str:
    """One line: the last logged metrics and, under OSDP, the plan with the measured step time and peak memory."""
    parts = []
    for name in ("train_loss", "train_ppl", "train_acc", "val_loss", "val_ppl", "val_acc"):
        value = trainer.callback_metrics.get(name)
        if value is not None and math.isfinite(float(value)):
            parts.append(f"{name}={float(value):.4f}")
    line = f"step {trainer.global_step}: " + (" ".join(parts) or "no metrics logged")
    strategy = trainer.strategy
    if isinstance(strategy, lightning_osdp.OSDPStrategy) and strategy.plan is not None:
        line += f" | {strategy.plan.summary()}"
        if strategy.step_time is not None:
            line += f", step time {strategy.step_time:.3f} s"
        if strategy.peak_memory_bytes is not None:
            line += f", peak memory {strategy.peak_memory_bytes / 2**20:.1f} MiB on rank 0"
    return line


def main() -> None:
    """Entry point: ``python examples/gpt/train.py {fit,validate,...} --config CONFIG``."""
    cli = GPTCLI(GPTModule, StdlibTextDataModule, save_config_kwargs={"overwrite": True})
    if cli.subcommand is not None and cli.trainer.is_global_zero:
        print(f"GPT example: {final_report(cli.trainer)}", flush=True)


if __name__ == "__main__":
    main()
