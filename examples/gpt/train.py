"""Train the GPT example through LightningCLI.

Run from the repository root (plan paths in the configs are relative to it), for example::

    python examples/gpt/train.py fit --config examples/gpt/configs/osdp_plan.yaml

``--print_config`` shows every option; any of them can be overridden on the command line
(``--trainer.max_steps 100``, ``--model.width 128``, ``--data.batch_size 32``).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_osdp  # registers strategy="osdp" with Lightning

from gpt import GPTModule
from stdlib_text import StdlibTextDataModule

__all__ = ["GPTCLI", "main"]


class GPTCLI(LightningCLI):
    """LightningCLI whose data windows always match the model's context (the positional-embedding table)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.context_length", "data.context_length")


def main() -> None:
    """Entry point: ``python examples/gpt/train.py {fit,validate,...} --config CONFIG``."""
    cli = GPTCLI(GPTModule, StdlibTextDataModule, save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    if cli.subcommand is not None and cli.trainer.is_global_zero and isinstance(strategy, lightning_osdp.OSDPStrategy):
        print(f"GPT example: {strategy.summary()}", flush=True)


if __name__ == "__main__":
    main()
