"""Sweeps memory budgets from the smallest feasible one (recomputation allowed) to DDP's requirement on 2 ranks, for a
GPT whose activations are most of its memory, in one launch; and measures FULL_SHARD without recomputation, and a
plan with selective recomputation forced on every block (``activation_checkpointing="selective"``).

For each budget: ``Trainer(strategy=OSDPStrategy(memory_budget=b))`` profiles, solves (recomputation chosen where it
pays), applies and trains; the measured peak of every rank is saved. Usage: ``recompute_sweep_runner.py OUT_DIR``.
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

from lightning_osdp import OSDPStrategy, Plan, minimum_budget, predict, profile

from models import TinyGPT, TokenDataset, quiet_trainer

HEADROOM = 0.02
BUDGETS = 6
CONTEXT = 128


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(width=48, hidden=192, layers=4, context=CONTEXT)


def loader() -> DataLoader:
    return DataLoader(TokenDataset(64, length=CONTEXT + 1), batch_size=8)


def fit(strategy: OSDPStrategy) -> dict[str, Any]:
    L.seed_everything(0)
    lm = model()
    trainer = quiet_trainer(
        strategy,
        max_steps=3,
    )
    trainer.fit(lm, loader())
    peak = torch.tensor([strategy.peak_memory_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    assert strategy.plan is not None
    report = strategy.plan.report
    return {
        "peak": int(peak),
        "plan": strategy.plan.to_dict(),
        "predicted": report.predicted_peak_bytes if report is not None else None,  # None: a plan given by hand
        "losses": lm.losses,
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    prof = profile(model(), next(iter(loader())))
    ddp_plan = Plan.uniform(model(), "no_shard")
    ddp = predict(prof, ddp_plan, 2)
    activations = sum(m.activation_bytes for m in prof.modules.values()) + prof.extra_activation_bytes
    low = minimum_budget(prof, 2)
    low_without = minimum_budget(prof, 2, recompute=False)
    # Budgets as a user passes them: the planner plans against (1 - headroom) of each.
    planned = [low + (ddp.peak_bytes - low) * i / (BUDGETS - 1) for i in range(BUDGETS)]
    budgets = [int(x / (1 - HEADROOM)) + 1 for x in planned]
    results = [
        {"budget": b, **fit(OSDPStrategy(memory_budget=b, memory_headroom=HEADROOM, plan_out=out / f"plan{i}.json"))}
        for i, b in enumerate(budgets)
    ]
    full_shard = fit(OSDPStrategy(plan=Plan.uniform(model(), "full_shard")))
    # Selective recomputation forced on every block, half-way from its own minimum to DDP's need.
    low_selective = minimum_budget(prof, 2, recompute="selective")
    selective_budget = int((low_selective + ddp.peak_bytes) / 2 / (1 - HEADROOM)) + 1
    selective = {
        "budget": selective_budget,
        **fit(
            OSDPStrategy(memory_budget=selective_budget, memory_headroom=HEADROOM, activation_checkpointing="selective")
        ),
    }
    if dist.get_rank() == 0:
        torch.save(
            {
                "low": low,
                "low_without_recompute": low_without,
                "ddp": ddp.peak_bytes,
                "activations": activations,
                "results": results,
                "full_shard_peak": full_shard["peak"],
                "low_selective": low_selective,
                "selective": selective,
            },
            out / "sweep.pt",
        )


if __name__ == "__main__":
    main()
    finish()
