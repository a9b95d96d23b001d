"""Train the MLP-Mixer example through LightningCLI.

Run from the repository root (plan paths in the configs are relative to it), for example::

    python examples/mixer/train.py fit --config examples/mixer/configs/osdp_plan.yaml

``--print_config`` shows every option. The model's ``num_classes``, ``image_size`` and ``in_channels`` follow the
data module's (``--data.num_classes 20`` changes both).
"""

from __future__ import annotations

import math

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_osdp  # registers strategy="osdp" with Lightning

from mixer import MixerModule
from synthetic_images import SyntheticImageDataModule

__all__ = ["MixerCLI", "final_report", "main"]


class MixerCLI(LightningCLI):
    """LightningCLI whose model always matches the generated images and classes."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes")
        parser.link_arguments("data.image_size", "model.image_size")
        parser.link_arguments("data.channels", "model.in_channels")


def final_report(trainer: Trainer) -> str:
    """One line: the last logged metrics and, under OSDP, the plan with the measured step time and peak memory."""
    parts = []
    for name in ("train_loss", "train_acc", "val_loss", "val_acc"):
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
    """Entry point: ``python examples/mixer/train.py {fit,validate,...} --config CONFIG``."""
    cli = MixerCLI(MixerModule, SyntheticImageDataModule, save_config_kwargs={"overwrite": True})
    if cli.subcommand is not None and cli.trainer.is_global_zero:
        print(f"Mixer example: {final_report(cli.trainer)}", flush=True)


if __name__ == "__main__":
    main()
