"""A language model with a large untied head on 2 ranks: its measured peak against its budget, and a run over its
budget correcting the next one. Usage: ``loss_budget_runner.py OUT_DIR``; rank 0 writes ``OUT_DIR/loss_budget.pt``.

1. Budgets as a user passes them (the planner keeps its default headroom free): the smallest feasible one and the one
   half way to DDP's need. ``Trainer(strategy=OSDPStrategy(memory_budget=b))`` profiles, plans and trains; every
   rank's measured peak is kept, with the plan's prediction.
2. A run with a callback holding a buffer through backward that the profile never sees, at a budget DDP just fits:
   it goes over its budget, warns and records the miss in its profile; it saves a checkpoint; a second run resumes
   from it at the same budget, plans again from the saved profile, and stays under the budget.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import OSDPStrategy, Plan, predict, profile
from lightning_osdp.solver import minimum_budget
from lightning_osdp.solver.policy import smallest_memory_budget

from models import BackwardBuffer, quiet_trainer

VOCAB, WIDTH, CONTEXT, BATCH = 4096, 64, 32, 2


class HeadLM(L.LightningModule):
    """Embedding, two MLP blocks, an untied LM head over 4,096 tokens; cross-entropy in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(2)
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader() -> DataLoader[Tensor]:
    tokens = torch.randint(0, VOCAB, (64, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(tokens, batch_size=BATCH)  # type: ignore[arg-type]


def fit(strategy: OSDPStrategy, callbacks: list[Callback], steps: int = 5, **kwargs: Any) -> dict[str, Any]:
    """Train; the plan, its prediction, rank 0's peak, every rank's largest, and the warnings rank 0 saw."""
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        strategy,
        max_steps=steps,
        callbacks=callbacks,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(HeadLM(), loader(), **kwargs)
    peak = torch.tensor([strategy.peak_memory_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    assert strategy.plan is not None and strategy.profile is not None
    return {
        "plan": strategy.plan.to_dict(),
        "predicted": predict(strategy.profile, strategy.plan, 2).peak_bytes,
        "correction": strategy.profile.measured_peak_correction,
        "peak": strategy.peak_memory_bytes,
        "peak_max": int(peak),
        "warnings": [str(w.message) for w in caught],
        "summary": strategy.summary(),
        "trainer": trainer,
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    prof = profile(HeadLM(), next(iter(loader())))
    # Sharding only (no recomputation): the plans this test was made for, where the loss's tensors are the peak.
    low = minimum_budget(prof, 2, recompute=False)
    ddp = predict(prof, Plan.uniform(HeadLM(), "no_shard"), 2).peak_bytes
    smallest = smallest_memory_budget(prof, 2, recompute=False)
    budgets = {"smallest": smallest, "halfway": int(smallest * (low + ddp) / 2 / low) + 1}
    results: dict[str, Any] = {"low": low, "ddp": ddp, "head_logits": BATCH * CONTEXT * VOCAB * 4}
    for name, budget in budgets.items():
        strategy = OSDPStrategy(memory_budget=budget, plan_out=out / f"{name}.json", activation_checkpointing=False)
        run = fit(strategy, [])
        run.pop("trainer")
        results[name] = {"budget": budget, **run}

    # A budget DDP fits with no headroom to spare, and a buffer of a third of it through every backward.
    budget, extra = ddp + 1, ddp // 3
    over = fit(
        OSDPStrategy(memory_budget=budget, memory_headroom=0.0, plan_out=out / "over.json"), [BackwardBuffer(extra)]
    )
    over.pop("trainer").save_checkpoint(out / "over.ckpt")
    again = fit(
        OSDPStrategy(memory_budget=budget, memory_headroom=0.0, plan_out=out / "again.json"),
        [BackwardBuffer(extra)],
        steps=10,
        ckpt_path=out / "over.ckpt",
    )
    again.pop("trainer")
    results["over"] = {"budget": budget, **over}
    results["again"] = {"budget": budget, **again}
    if dist.get_rank() == 0:
        torch.save(results, out / "loss_budget.pt")


if __name__ == "__main__":
    main()
    finish()
