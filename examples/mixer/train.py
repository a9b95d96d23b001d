"""Train the MLP-Mixer example through LightningCLI.

Run from the repository root (plan paths in the configs are relative to it), for example::

    python examples/mixer/train.py fit --config examples/mixer/configs/osdp_plan.yaml

``--print_config`` shows every option. The model's ``num_classes``, ``image_size`` and ``in_channels`` follow the
data module's (``--data.num_classes 20`` changes both).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_osdp  # registers strategy="osdp" with Lightning

from mixer import MixerModule
from synthetic_images import SyntheticImageDataModule

__all__ = ["MixerCLI", "main"]


class MixerCLI(LightningCLI):
    """LightningCLI whose model always matches the generated images and classes."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes")
        parser.link_arguments("data.image_size", "model.image_size")
        parser.link_arguments("data.channels", "model.in_channels")


def main() -> None:
    """Entry point: ``python examples/mixer/train.py {fit,validate,...} --config CONFIG``."""
    cli = MixerCLI(MixerModule, SyntheticImageDataModule, save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    if cli.subcommand is not None and cli.trainer.is_global_zero and isinstance(strategy, lightning_osdp.OSDPStrategy):
        print(f"Mixer example: {strategy.summary()}", flush=True)


if __name__ == "__main__":
    main()
