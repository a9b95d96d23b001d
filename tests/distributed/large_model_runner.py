"""Models built on the meta device on 2 ranks: initialization after sharding, pretrained weights of every kind into
the shards, and the eager path's plan and training reproduced, in one launch.

Usage: ``large_model_runner.py OUT_DIR``; writes ``OUT_DIR/large.rank{R}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import Decision, OSDPStrategy, Plan
from lightning_osdp.apply.materialize import materialize
from lightning_osdp.checkpoint import consolidate

from models import BatchNormCNN, ImageDataset, TinyGPT, TokenDataset

MIXED = {
    "": "no_shard",
    "wte": "full_shard",
    "lm_head": "full_shard",
    "h.0": Decision("full_shard", recompute=True),
    "h.0.fc": ("full_shard", 4),
    "h.1": "shard_grad_op",
    "h.2": Decision("no_shard", recompute=True),
}
PLANS = {
    "full_shard": lambda m: Plan.uniform(m, "full_shard"),
    "shard_grad_op": lambda m: Plan.uniform(m, "shard_grad_op"),
    "mixed": lambda m: Plan(MIXED),
}


def trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "deterministic": True,
    }
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def gpt_loader() -> DataLoader:
    return DataLoader(TokenDataset(), batch_size=4)


def on_meta(make: Any, strategy: Any, **kwargs: Any) -> tuple[L.Trainer, Any]:
    t = trainer(strategy, **kwargs)
    with t.init_module(empty_init=True):
        model = make()
    assert all(p.is_meta for p in model.parameters())
    return t, model


def full_state(t: L.Trainer, model: Any) -> dict[str, torch.Tensor] | None:
    state = t.strategy.full_model_state_dict() if isinstance(t.strategy, OSDPStrategy) else model.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None


def reference_initialization() -> dict[str, torch.Tensor]:
    """The unsharded model's materialization (reset_parameters per module, in modules() order; one process)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT()
    materialize(model, torch.device("cpu"))
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def write_checkpoints(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """One set of pretrained weights in the four kinds a user starts from (rank 0 writes, both ranks return them)."""
    torch.manual_seed(1)
    source = TinyGPT()
    weights = {k: v.detach().clone() for k, v in source.state_dict().items()}
    paths = {
        "state_dict": out / "weights.pt",
        "lightning": out / "lightning.ckpt",
        "consolidated": out / "consolidated.ckpt",
        "safetensors": out / "hf",
    }
    # A Lightning checkpoint of the model, and a sharded OSDP checkpoint of it consolidated into one file.
    for kind, strategy in (("lightning", "ddp"), ("sharded", OSDPStrategy(plan=Plan(MIXED)))):
        model = TinyGPT()
        model.load_state_dict(weights)
        t = trainer(strategy, max_steps=0)
        t.fit(model, gpt_loader())
        t.save_checkpoint(out / f"{kind}.ckpt")
    if dist.get_rank() == 0:
        torch.save(weights, paths["state_dict"])
        consolidate(out / "sharded.ckpt", paths["consolidated"])
        from safetensors.torch import save_file

        paths["safetensors"].mkdir()
        # As Hugging Face saves a tied head: once, under the embedding's name.
        save_file(
            {k: v for k, v in weights.items() if k != "lm_head.weight"}, paths["safetensors"] / "model.safetensors"
        )
    dist.barrier()
    return weights, paths


def run_losses(t: L.Trainer, model: Any, loader: DataLoader) -> dict[str, Any]:
    t.fit(model, loader)
    return {"losses": list(model.losses), "state": full_state(t, model), "plan": getattr(t.strategy, "plan", None)}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"reference_init": reference_initialization()}
    # Initialization after sharding equals the unsharded model's, whatever the plan.
    for name, plan in PLANS.items():
        torch.manual_seed(0)
        t, model = on_meta(TinyGPT, OSDPStrategy(plan=plan(TinyGPT())), max_steps=0)
        torch.manual_seed(0)
        t.fit(model, gpt_loader())
        results[f"init:{name}"] = full_state(t, model)
    # Pretrained weights of each kind into a meta model under a mixed plan, against DDP from the same weights.
    weights, paths = write_checkpoints(out)
    reference = TinyGPT()
    reference.load_state_dict(weights)
    results["ddp"] = run_losses(trainer("ddp"), reference, gpt_loader())
    for kind, path in paths.items():
        t, model = on_meta(TinyGPT, OSDPStrategy(plan=Plan(MIXED), pretrained=path))
        results[f"pretrained:{kind}"] = run_losses(t, model, gpt_loader())
    # A model that fits: init_module(empty_init=True) plans and trains as the eager path (a model whose construction
    # order is its modules' order, initialized by reset_parameters alone).
    images = DataLoader(ImageDataset(), batch_size=8)
    for path_kind in ("eager", "meta"):
        L.seed_everything(0)
        strategy = OSDPStrategy(memory_budget="1GiB", plan_out=out / f"{path_kind}.plan.json")
        if path_kind == "eager":
            t, model = trainer(strategy), BatchNormCNN()
        else:
            t, model = on_meta(BatchNormCNN, strategy)
        run = run_losses(t, model, images)
        run["plan"] = run["plan"].to_dict()
        run["profile_mode"] = strategy.profile.mode if strategy.profile else None
        results[f"fits:{path_kind}"] = run
    torch.save(results, out / f"large.rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
    finish()
