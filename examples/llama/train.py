"""Train the Llama example through LightningCLI, on the GPT example's corpus (the standard library's bytes).

Run from the repository root, for example::

    python examples/llama/train.py fit --config examples/llama/configs/osdp.yaml

``--print_config`` shows every option; any of them can be overridden on the command line
(``--trainer.max_steps 100``, ``--model.dim 128``, ``--data.batch_size 32``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_osdp  # registers strategy="osdp" with Lightning

# The data module is the GPT example's: byte windows of the standard library's sources, nothing downloaded.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))

from llama import LlamaModule
from stdlib_text import StdlibTextDataModule

__all__ = ["LlamaCLI", "main"]


class LlamaCLI(LightningCLI):
    """LightningCLI whose data windows always match the model's context (the rotary tables' length)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.context_length", "data.context_length")


def main() -> None:
    """Entry point: ``python examples/llama/train.py {fit,validate,...} --config CONFIG``."""
    cli = LlamaCLI(LlamaModule, StdlibTextDataModule, save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    if cli.subcommand is not None and cli.trainer.is_global_zero and isinstance(strategy, lightning_osdp.OSDPStrategy):
        print(f"Llama example: {strategy.summary()}", flush=True)


if __name__ == "__main__":
    main()
