"""Runs several 2-process training cases inside one set of processes and saves what each measured.

Started by the tests with ``torchrun --nproc-per-node 2`` (Lightning's TorchElastic environment), so the
processes and the gloo process group are shared by all cases: a Lightning run costs seconds of imports.
Usage: ``runner.py OUT_DIR CASE [CASE ...]``; each case writes ``OUT_DIR/CASE.rank{R}.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

import lightning_osdp
from lightning_osdp import Decision, OSDPStrategy, Plan

from models import TinyGPT, loaders

MIXED = {
    "": "no_shard",
    "h.0": "full_shard",
    "h.1": "shard_grad_op",
    "h.2": "no_shard",
    "h.2.fc": "full_shard",
    "frozen": "full_shard",
}
PLANS: dict[str, dict[str, Any]] = {
    "no_shard": {"": "no_shard", "h.0": "no_shard", "h.1": "no_shard", "h.2": "no_shard"},
    "full_shard": {"": "full_shard", "h.0": "full_shard", "h.1": "full_shard", "h.2": "full_shard"},
    "shard_grad_op": {
        "": "shard_grad_op",
        "h.0": "shard_grad_op",
        "h.1": "shard_grad_op",
        "h.2": "shard_grad_op",
    },
    "mixed": MIXED,
    # Tied embedding and head as their own sharded group, split operators in a sharded block.
    "tied_split": {
        "": "no_shard",
        "wte": "full_shard",
        "lm_head": "full_shard",
        "h.0": "shard_grad_op",
        "h.0.fc": ("full_shard", 4),
        "h.1.proj": ("full_shard", 2),
    },
    # Recomputation in every mode, and in a mixed plan with a tied group, a split Linear inside a recomputed block
    # (its slices' own hooks gather them in the recomputation) and a recomputed DDP block.
    "no_shard+ac": {"": "no_shard", **{f"h.{i}": Decision("no_shard", recompute=True) for i in range(3)}},
    "full_shard+ac": {"": "full_shard", **{f"h.{i}": Decision("full_shard", recompute=True) for i in range(3)}},
    "shard_grad_op+ac": {
        "": "shard_grad_op",
        **{f"h.{i}": Decision("shard_grad_op", recompute=True) for i in range(3)},
    },
    "mixed+ac": {
        "": "no_shard",
        "wte": "full_shard",
        "lm_head": "full_shard",
        "h.0": Decision("full_shard", recompute=True),
        "h.0.fc": ("full_shard", 4),
        "h.1": "shard_grad_op",
        "h.2": Decision("no_shard", recompute=True),
    },
    # Selective recomputation in every mode, and a mixed plan with a unit in each of the three options: the tied
    # embedding and head a sharded group, a selective full_shard block with a split Linear in it (its slices' hooks
    # gather them in the replay), a fully recomputed ZeRO-2 block, a DDP block that keeps its activations.
    "no_shard+sac": {"": "no_shard", **{f"h.{i}": Decision("no_shard", recompute="selective") for i in range(3)}},
    "full_shard+sac": {"": "full_shard", **{f"h.{i}": Decision("full_shard", recompute="selective") for i in range(3)}},
    "shard_grad_op+sac": {
        "": "shard_grad_op",
        **{f"h.{i}": Decision("shard_grad_op", recompute="selective") for i in range(3)},
    },
    "hybrid_shard+sac": {
        "": "hybrid_shard",
        **{f"h.{i}": Decision("hybrid_shard", recompute="selective") for i in range(3)},
    },
    "mixed+sac": {
        "": "no_shard",
        "wte": "full_shard",
        "lm_head": "full_shard",
        "h.0": Decision("full_shard", recompute="selective"),
        "h.0.fc": ("full_shard", 4),
        "h.1": Decision("shard_grad_op", recompute="full"),
        "h.2": "no_shard",
    },
}
# Under bf16-mixed without the split: a Linear split into slices already differs from the whole Linear by about 4e-4
# (relative, losses) under bf16 autocast, recomputed or not (the CPU's bf16 matrix products of the slices round
# differently), which is no property of recomputation.
PLANS["mixed+sac_nosplit"] = {k: v for k, v in PLANS["mixed+sac"].items() if k != "h.0.fc"}
#: Per variant with dropout, the blocks the DDP reference checkpoints by hand: those the plans above recompute
#: (fully; and selectively, the second tuple).
CHECKPOINTED = {"ac": ((0, 1, 2), ()), "acmix": ((0, 2), ()), "sac": ((), (0, 1, 2)), "sacmix": ((1,), (0,))}
#: Variants of "sacmix" under another precision or with gradient accumulation.
SACMIX_VARIANTS = {"sacmix_bf16": {"precision": "bf16-mixed"}, "sacmix_accum": {"accumulate_grad_batches": 2}}


class GradSyncProbe(Callback):
    """Records, after each backward, how far a replicated gradient differs across ranks and whether a sharded
    gradient exists yet."""

    def __init__(self) -> None:
        self.records: list[tuple[int, float | None]] = []
        self.sharded: list[tuple[int, bool]] = []

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        batch = trainer.fit_loop.epoch_loop.batch_idx
        # Under FSDP2 a sharded parameter's `.grad` is set by the gradient reduction: None means none ran.
        sharded = pl_module.h[0].ln_1.weight.grad  # full_shard in the mixed plan
        self.sharded.append((batch, sharded is not None))
        grad = pl_module.ln_f.weight.grad  # in the root unit (no_shard in the mixed plan: a plain tensor under DDP)
        if grad is None or hasattr(grad, "placements"):
            self.records.append((batch, None))
            return
        gathered = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grad.contiguous())
        spread = float((gathered[0] - gathered[1]).abs().max())
        self.records.append((batch, spread))


def run(case: str, out: Path) -> None:
    name, _, variant = case.partition("@")
    L.seed_everything(0, workers=True)
    model = TinyGPT()
    train, val = loaders()
    kwargs: dict[str, Any] = {"precision": "32-true"}
    probe = GradSyncProbe()
    callbacks: list[Callback] = [probe]
    if variant in ("32-true", "bf16-mixed", "bf16-true", "16-mixed"):
        kwargs["precision"] = variant
    elif variant == "accum_clip":
        kwargs.update(accumulate_grad_batches=2, gradient_clip_val=0.05)
    elif variant == "sgd":
        model = TinyGPT(optimizer="sgd")
    elif variant in CHECKPOINTED or variant in SACMIX_VARIANTS:
        full, selective = CHECKPOINTED["sacmix" if variant in SACMIX_VARIANTS else variant]
        by_hand = {"checkpointed": full, "selective": selective} if name == "ddp" else {}
        model = TinyGPT(dropout=0.1, **by_hand)
        kwargs.update(SACMIX_VARIANTS.get(variant, {}))
    strategy: Any = "ddp" if name == "ddp" else OSDPStrategy(plan=Plan(PLANS[name]))
    # 2 nodes x 1 process when the test launches two single-process torchrun agents.
    num_nodes = int(os.environ.get("OSDP_TEST_NUM_NODES", "1"))
    trainer = L.Trainer(
        accelerator=os.environ.get("OSDP_TEST_ACCELERATOR", "cpu"),
        devices=2 // num_nodes,
        num_nodes=num_nodes,
        strategy=strategy,
        max_epochs=2,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        deterministic=True,
        **kwargs,
    )
    trainer.fit(model, train, val)
    val_metrics = trainer.validate(model, val, verbose=False)[0]
    test_metrics = trainer.test(model, val, verbose=False)[0]
    if name == "ddp":
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    else:
        state = {k: v.float() for k, v in trainer.strategy.full_model_state_dict().items()}
    result = {
        "losses": model.losses,
        "seen": model.seen,
        "val": val_metrics,
        "test": test_metrics,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "state": state if dist.get_rank() == 0 else None,
        "grad_sync": probe.records,
        "sharded_grad": probe.sharded,
        "peak_memory_bytes": getattr(trainer.strategy, "peak_memory_bytes", None),
        "step_time": getattr(trainer.strategy, "step_time", None),
        "plan": trainer.strategy.plan.to_dict() if name != "ddp" else None,
    }
    torch.save(result, out / f"{case}.rank{dist.get_rank()}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    assert lightning_osdp.OSDPStrategy.strategy_name == "osdp"
    for case in sys.argv[2:]:
        run(case, out)


if __name__ == "__main__":
    main()
    finish()
