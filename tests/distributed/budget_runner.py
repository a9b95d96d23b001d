"""Sweeps memory budgets from the smallest feasible one to DDP's requirement on 2 ranks, in one launch.

For each budget: ``Trainer(strategy=OSDPStrategy(memory_budget=b))`` profiles, solves, applies and trains; the
measured peak of every rank is saved. Usage: ``budget_runner.py OUT_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import OSDPStrategy, Plan, minimum_budget, predict, profile

from models import TinyGPT, loaders, quiet_trainer

HEADROOM = 0.02


def fit(strategy: OSDPStrategy) -> dict[str, Any]:
    L.seed_everything(0)
    model = TinyGPT(width=48, hidden=192, layers=4)
    train, _ = loaders(batch_size=8)
    trainer = quiet_trainer(
        strategy,
        max_steps=4,
    )
    trainer.fit(model, train)
    peak = torch.tensor([strategy.peak_memory_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    assert strategy.plan is not None
    return {"peak": int(peak), "plan": strategy.plan.to_dict(), "losses": model.losses}


def main() -> None:
    out = Path(sys.argv[1])
    model = TinyGPT(width=48, hidden=192, layers=4)
    batch = next(iter(loaders(batch_size=8)[0]))
    dist.init_process_group("gloo")
    prof = profile(model, batch)
    low = minimum_budget(prof, 2)
    ddp = predict(prof, Plan.uniform(model, "no_shard"), 2).peak_bytes
    # Budgets as a user passes them: the planner plans against (1 - headroom) of each.
    budgets = [int(x / (1 - HEADROOM)) + 1 for x in (low, (low + ddp) / 2, ddp)]
    results = [
        {"budget": b, **fit(OSDPStrategy(memory_budget=b, memory_headroom=HEADROOM, plan_out=out / f"plan{i}.json"))}
        for i, b in enumerate(budgets)
    ]
    if dist.get_rank() == 0:
        torch.save({"low": low, "ddp": ddp, "results": results}, out / "budgets.pt")


if __name__ == "__main__":
    main()
    finish()
