"""Lightning usages against Lightning's DDP on 2 ranks: stateful modules (BatchNorm) under recomputation and every
plan shape, manual optimization, clipping, and ``torch.compile``d blocks, in one launch.

Usage: ``usage_runner.py OUT_DIR CASE [CASE ...]``; a case is ``MODEL:PLAN``, ``PLAN`` one of ``ddp`` (Lightning's
DDP strategy), ``ample`` and ``halfway`` (the planner's own plans at twice DDP's predicted need and halfway between
the planner's minimum and DDP's need), or a hand-written plan of :data:`PLANS`. Each case writes
``OUT_DIR/CASE.rank{R}.pt`` (``:`` spelled ``-``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import Decision, OSDPStrategy, Plan, minimum_budget, predict, profile

from models import BatchNormCNN, GANDataset, ImageDataset, ManualGAN, TinyGPT, TokenDataset, quiet_trainer

HEADROOM = 0.02


def gpt_compiled(how: str) -> Callable[[], L.LightningModule]:
    def build() -> L.LightningModule:
        model = TinyGPT()
        for i, block in enumerate(model.h):
            if how == "method":
                block.compile(backend="aot_eager")
            else:
                model.h[i] = torch.compile(block, backend="aot_eager")
        return model

    return build


def bn_compiled() -> L.LightningModule:
    model = BatchNormCNN()
    for block in model.blocks:
        block.compile(backend="aot_eager")
    return model


MODELS: dict[str, tuple[Callable[[], L.LightningModule], Callable[[], DataLoader], dict[str, Any]]] = {
    "bn": (BatchNormCNN, lambda: DataLoader(ImageDataset(), batch_size=8, shuffle=True), {}),
    # toggle_optimizer leaves the other optimizer's parameters without gradients: DDP must be told (Lightning's DDP and
    # OSDP alike).
    "bn_compile": (
        bn_compiled,
        lambda: DataLoader(ImageDataset(), batch_size=8, shuffle=True),
        {"num_sanity_val_steps": 0},
    ),
    "gan": (ManualGAN, lambda: DataLoader(GANDataset(), batch_size=8, shuffle=True), {}),
    "gpt_clip": (TinyGPT, lambda: DataLoader(TokenDataset(), batch_size=4, shuffle=True), {"gradient_clip_val": 0.05}),
    "gpt_clipv": (
        TinyGPT,
        lambda: DataLoader(TokenDataset(), batch_size=4, shuffle=True),
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    ),
    "compile_method": (
        gpt_compiled("method"),
        lambda: DataLoader(TokenDataset(), batch_size=4, shuffle=True),
        {"num_sanity_val_steps": 0},
    ),
    "compile_fn": (
        gpt_compiled("fn"),
        lambda: DataLoader(TokenDataset(), batch_size=4, shuffle=True),
        {"num_sanity_val_steps": 0},
    ),
}

#: Models whose backward leaves some parameters without gradients (``toggle_optimizer``).
UNUSED_PARAMETERS = {"gan"}

PLANS: dict[str, Callable[[L.LightningModule], Plan]] = {
    "full_shard": lambda m: Plan.uniform(m, "full_shard"),
    "shard_grad_op": lambda m: Plan.uniform(m, "shard_grad_op"),
    # HSDP on 2 ranks: shard groups of one rank, replicated across the two (OSDPStrategy(shard_group_size=1)).
    "hybrid_shard": lambda m: Plan.uniform(m, "hybrid_shard"),
    "no_shard": lambda m: Plan.uniform(m, "no_shard"),
    "recompute": lambda m: Plan.uniform(m, "no_shard", recompute=True),
    "full_shard_recompute": lambda m: Plan.uniform(m, "full_shard", recompute=True),
    "selective": lambda m: Plan.uniform(m, "no_shard", recompute="selective"),
    "full_shard_selective": lambda m: Plan.uniform(m, "full_shard", recompute="selective"),
    "mixed": lambda m: Plan(
        {
            "": "no_shard",
            **{
                name: Decision(("full_shard", "shard_grad_op", "no_shard")[i % 3], recompute=i % 2 == 0)
                for i, name in enumerate(Plan.uniform(m, "no_shard").decisions)
                if name
            },
        }
    ),
}


def budgets(build: Callable[[], L.LightningModule], loader: Callable[[], DataLoader]) -> dict[str, int]:
    torch.manual_seed(0)
    model = build()
    prof = profile(model, next(iter(loader())))
    ddp = predict(prof, Plan.uniform(model, "no_shard"), dist.get_world_size()).peak_bytes
    low = minimum_budget(prof, dist.get_world_size())
    return {"ample": 2 * ddp, "halfway": int((low + (ddp - low) / 2) / (1 - HEADROOM)) + 1}


def run(case: str, out: Path) -> None:
    model_name, _, plan_name = case.partition(":")
    build, loader, trainer_kwargs = MODELS[model_name]
    strategy: Any
    if plan_name == "ddp":
        # Lightning's DDP must be told that toggle_optimizer leaves parameters without gradients; OSDP's default
        # (find_unused_parameters=None) turns DDP's detection on for manual optimization by itself.
        strategy = DDPStrategy(find_unused_parameters=model_name in UNUSED_PARAMETERS)
    elif plan_name in ("ample", "halfway"):
        budget = budgets(build, loader)[plan_name]
        strategy = OSDPStrategy(memory_budget=budget, memory_headroom=HEADROOM, plan_out=out / f"{case}.plan.json")
    else:
        torch.manual_seed(0)
        hybrid = {"shard_group_size": 1} if plan_name == "hybrid_shard" else {}
        strategy = OSDPStrategy(plan=PLANS[plan_name](build()), **hybrid)
    torch._dynamo.reset()
    counters.clear()
    L.seed_everything(0, workers=True)
    model = build()
    trainer = quiet_trainer(
        strategy,
        max_epochs=2,
        limit_val_batches=2,
        deterministic=True,
        **trainer_kwargs,
    )
    loaders = loader()
    validates = type(model).validation_step is not L.LightningModule.validation_step
    trainer.fit(model, loaders, loaders if validates else None)
    frames = dict(counters["frames"])
    graphs = int(counters["stats"]["unique_graphs"])
    val = trainer.validate(model, loaders, verbose=False)[0] if validates else {}
    if plan_name == "ddp":
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    else:
        state = {k: v.float() for k, v in trainer.strategy.full_model_state_dict().items()}
    buffers = {k: v.detach().float().cpu().clone() for k, v in model.named_buffers()}
    result = {
        "losses": model.losses,
        "val": val,
        "state": state if dist.get_rank() == 0 else None,
        "buffers": buffers,
        "frames": frames,
        "graphs": graphs,
        "plan": trainer.strategy.plan.to_dict() if plan_name != "ddp" else None,
        "peak": getattr(trainer.strategy, "peak_memory_bytes", None),
        "budget": getattr(trainer.strategy, "memory_budget", None),
    }
    torch.save(result, out / f"{case.replace(':', '-')}.rank{dist.get_rank()}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[2:]:
        run(case, out)


if __name__ == "__main__":
    main()
    finish()
