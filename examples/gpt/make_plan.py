"""Write the example plan file for the GPT model that a config describes.

The module names in a plan must be exactly those of ``GPTModule.named_modules()``, so the plan is generated from
the model itself rather than typed by hand. Run from the repository root::

    python examples/gpt/make_plan.py --config examples/gpt/configs/osdp_plan.yaml

It builds ``GPTModule`` from the config's ``model:`` section and writes the plan to the path given in
``trainer.strategy.init_args.plan`` (or ``--out``). Several ``--config`` are merged in order, as LightningCLI does,
so a plan for the larger model is ``--config .../osdp_plan.yaml --config .../model_10m.yaml --out PATH``.
``--check`` only compares, and exits 1 when the file is out of date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from lightning_osdp import Decision, Plan

from gpt import GPTModule

__all__ = ["ARCHITECTURE", "main", "merge_configs", "mixed_plan", "plan_path_of"]

#: The ``GPTModule`` arguments that change module names or shapes, recorded in the plan's ``info``.
ARCHITECTURE = ("vocab_size", "context_length", "width", "depth", "heads", "mlp_ratio")


def mixed_plan(module: GPTModule) -> Plan:
    """A hand-made plan that exercises every mode and operator splitting on ``module``.

    - root ``""`` (token and positional embeddings, the tied LM head, the final LayerNorm): ``no_shard``; the tied
      embedding/head must be one unit, and the root is the natural one;
    - blocks ``model.blocks.{i}``: ``full_shard`` (ZeRO-3) for even ``i``, ``shard_grad_op`` (ZeRO-2) for odd ``i``;
    - the first block's MLP up-projection ``model.blocks.0.mlp.fc``: ``full_shard`` cut into 2 slices, so only half
      of its weight is gathered at a time.
    """
    plan = Plan.uniform(module, "full_shard")
    blocks = [name for name in plan.decisions if name.startswith("model.blocks.")]
    decisions: dict[str, Decision] = {"": Decision("no_shard")}
    for name in blocks:
        index = int(name.rsplit(".", 1)[1])
        decisions[name] = Decision("full_shard" if index % 2 == 0 else "shard_grad_op")
    decisions["model.blocks.0.mlp.fc"] = Decision("full_shard", split=2)
    architecture = {k: module.hparams[k] for k in ARCHITECTURE}
    result = Plan(decisions, info={"source": "examples/gpt/make_plan.py", "model": architecture})
    result.validate(module)
    return result


def merge_configs(paths: list[str]) -> dict[str, Any]:
    """The YAML files at ``paths`` merged in order, nested mappings key by key (later files win)."""

    def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in update.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merge(out[key], value) if both else value
        return out

    config: dict[str, Any] = {}
    for path in paths:
        config = merge(config, yaml.safe_load(Path(path).read_text()) or {})
    return config


def plan_path_of(config: dict[str, Any]) -> Path:
    """The plan file a LightningCLI config points its OSDP strategy at."""
    strategy = config.get("trainer", {}).get("strategy")
    plan = strategy.get("init_args", {}).get("plan") if isinstance(strategy, dict) else None
    if not plan:
        raise SystemExit("the config has no trainer.strategy.init_args.plan to write")
    return Path(plan)


def main(argv: list[str] | None = None) -> int:
    """Generate (or ``--check``) the plan file; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="LightningCLI config(s), merged in order")
    parser.add_argument("--out", type=Path, help="plan file to write (default: the config's plan path)")
    parser.add_argument("--check", action="store_true", help="compare with the file on disk, write nothing")
    args = parser.parse_args(argv)
    configs = args.config or ["examples/gpt/configs/osdp_plan.yaml"]
    config = merge_configs(configs)
    module = GPTModule(**config.get("model", {}))
    plan = mixed_plan(module)
    path = args.out or plan_path_of(config)
    if args.check:
        current = Plan.load(path).to_dict() if path.exists() else None
        # Through JSON, so that tuples compare equal to the lists a loaded file holds.
        if json.loads(json.dumps(plan.to_dict())) != current:
            flags = " ".join(f"--config {c}" for c in configs)
            print(f"{path} is out of date: run python examples/gpt/make_plan.py {flags}")
            return 1
        print(f"{path} is up to date ({plan.summary()})")
        return 0
    plan.save(path)
    print(f"wrote {path}: {plan.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
