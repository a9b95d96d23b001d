"""Write the example plan file for the MLP-Mixer that a config describes.

The plan is generated from the model itself, so its module names are exactly those of
``MixerModule.named_modules()``. Run from the repository root::

    python examples/mixer/make_plan.py --config examples/mixer/configs/osdp_plan.yaml

It builds ``MixerModule`` from the config's ``model:`` and ``data:`` sections (the data fixes the number of classes,
image size and channels) and writes the plan to ``trainer.strategy.init_args.plan`` (or ``--out``). ``--check`` only
compares, and exits 1 when the file is out of date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from lightning_osdp import Decision, Plan

from mixer import MixerModule

__all__ = ["main", "model_kwargs", "shape_plan"]

#: ``data:`` options that fix model arguments (as ``MixerCLI`` links them).
_LINKED = {"num_classes": "num_classes", "image_size": "image_size", "channels": "in_channels"}


def shape_plan(module: MixerModule) -> Plan:
    """A hand-made plan that decides by layer shape.

    - root ``""`` (patch embedding, final norm, head) and every block ``model.blocks.{i}`` (its LayerNorms and its
      small token-mixing MLP): ``no_shard``, replicated like DDP: little memory, one all-reduce per block;
    - every channel-mixing MLP ``model.blocks.{i}.channel_mixing`` (98% of a block's weights): ``full_shard``
      (ZeRO-3), gathered only while it computes.
    """
    plan = Plan.uniform(module, "no_shard")
    decisions = dict(plan.decisions)
    for name in [n for n in plan.decisions if n.startswith("model.blocks.")]:
        decisions[f"{name}.channel_mixing"] = Decision("full_shard")
    architecture = {k: v for k, v in module.hparams.items() if k not in ("lr", "weight_decay", "lr_schedule")}
    result = Plan(decisions, info={"source": "examples/mixer/make_plan.py", "model": architecture})
    result.validate(module)
    return result


def model_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``MixerModule`` arguments from a config: its ``model:`` section plus the linked ``data:`` options."""
    kwargs = dict(config.get("model") or {})
    for data_key, model_key in _LINKED.items():
        if data_key in (config.get("data") or {}):
            kwargs[model_key] = config["data"][data_key]
    return kwargs


def main(argv: list[str] | None = None) -> int:
    """Generate (or ``--check``) the plan file; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/mixer/configs/osdp_plan.yaml")
    parser.add_argument("--out", type=Path, help="plan file to write (default: the config's plan path)")
    parser.add_argument("--check", action="store_true", help="compare with the file on disk, write nothing")
    args = parser.parse_args(argv)
    config = yaml.safe_load(Path(args.config).read_text())
    plan = shape_plan(MixerModule(**model_kwargs(config)))
    path = args.out or Path(config["trainer"]["strategy"]["init_args"]["plan"])
    if args.check:
        current = Plan.load(path).to_dict() if path.exists() else None
        # Through JSON, so that tuples compare equal to the lists a loaded file holds.
        if json.loads(json.dumps(plan.to_dict())) != current:
            print(f"{path} is out of date: run python examples/mixer/make_plan.py --config {args.config}")
            return 1
        print(f"{path} is up to date ({plan.summary()})")
        return 0
    plan.save(path)
    print(f"wrote {path}: {plan.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
