"""Hybrid sharding cases on 2 nodes of 2 ranks, and the checkpoints they exchange with a 1-node run of 2 ranks.

``hybrid_runner.py OUT flat``: under ``torchrun --nproc-per-node 2`` (one node): DDP and a 1-node OSDP plan, each
saving at step 3. ``hybrid_runner.py OUT nodes``: under two ``torchrun --nnodes 2 --nproc-per-node 2`` agents
(Lightning's ``num_nodes=2, devices=2``): DDP, a plan mixing ``hybrid_shard``, ``full_shard``, ``shard_grad_op`` and
``no_shard`` units (plain, and with gradient accumulation and clipping), resumes of the 1-node checkpoints, and a
run that profiles the two levels of the network and plans by itself. ``hybrid_runner.py OUT resume``: 1 node of 2
ranks again, resuming the 2-node checkpoints. Each case writes ``OUT/CASE.rank{R}.pt``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_runner import Recorder, _Messages
from clean_exit import finish

from lightning_osdp import OSDPStrategy, Plan

from models import TinyGPT, loaders

_HYBRID: dict[str, Any] = {
    "": "no_shard",
    "wte": "hybrid_shard",
    "lm_head": "hybrid_shard",
    "h.0": "hybrid_shard",
    "h.1": "full_shard",
    "h.1.fc": "shard_grad_op",
    "h.2": "no_shard",
    "h.2.fc": "hybrid_shard",
    "frozen": "hybrid_shard",
}
PLANS: dict[str, dict[str, Any]] = {
    # Every mode in one model: a hybrid block, a full_shard block with a shard_grad_op Linear inside, a DDP block
    # with a hybrid Linear inside, the tied embedding and head as one hybrid group, a frozen hybrid unit.
    "hybrid": _HYBRID,
    # The same with the hybrid Linear split in two. NOTE: AdamW turns the ~1e-7 rounding differences of a split
    # matmul into ~1e-5 in `pos` after 8 steps on 4 ranks (SGD: 1e-7): this plan is compared with DDP with
    # gradient accumulation (4 optimizer steps) and resumes a 1-node checkpoint; the one above is compared with DDP
    # step by step and saves the checkpoint the 1-node run resumes.
    "hybrid_split": {**_HYBRID, "h.2.fc": ("hybrid_shard", 2)},
    # A one-node plan (no hybrid_shard) of other modes and splits.
    "flat": {
        "": "full_shard",
        "h.0": "shard_grad_op",
        "h.0.fc": ("full_shard", 3),
        "h.1": "no_shard",
        "h.2": "full_shard",
    },
}
#: The step the runs save at, and resume from.
SAVE_STEP = 3


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def fit(
    out: Path,
    name: str,
    *,
    plan: str | None,
    num_nodes: int,
    ckpt_path: Path | None = None,
    max_steps: int = -1,
    save: bool = False,
    accum_clip: bool = False,
    strategy: Any = None,
    model_kwargs: dict[str, Any] | None = None,
) -> None:
    """One ``Trainer.fit`` of TinyGPT on ``num_nodes`` nodes of ``4 // (2 * ...)`` ranks: DDP when ``plan`` is None
    (and no ``strategy``); saves the losses, snapshots and messages of this rank as ``out/name.rank{R}.pt``."""
    L.seed_everything(0, workers=True)
    model = TinyGPT(**(model_kwargs or {}))
    train, _ = loaders()
    recorder = Recorder((SAVE_STEP,))
    callbacks: list[Callback] = [recorder]
    if save:
        callbacks.append(ModelCheckpoint(out / name, filename="{step}", every_n_train_steps=SAVE_STEP, save_top_k=-1))
    if strategy is None:
        strategy = "ddp" if plan is None else OSDPStrategy(plan=Plan(PLANS[plan]), memory_steps=0)
    kwargs: dict[str, Any] = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05} if accum_clip else {}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=num_nodes,
        strategy=strategy,
        max_epochs=2,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=save,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        deterministic=True,
        **kwargs,
    )
    messages = _Messages()
    logging.getLogger("lightning.pytorch").addHandler(messages)
    try:
        trainer.fit(model, train, ckpt_path=ckpt_path)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(messages)
    osdp = trainer.strategy if isinstance(trainer.strategy, OSDPStrategy) else None
    placements = {}
    if osdp is not None:
        for key, param in model.named_parameters():
            placements[key] = [str(p) for p in getattr(param, "placements", ())]
    result = {
        "losses": model.losses,
        "states": recorder.states,
        "global_step": trainer.global_step,
        "messages": messages.lines,
        "plan": osdp.plan.to_dict() if osdp is not None and osdp.plan is not None else None,
        "profile": osdp.profile.to_dict() if osdp is not None and osdp.profile is not None else None,
        "topology": osdp.topology.to_dict() if osdp is not None else None,
        "placements": placements,
    }
    torch.save(result, out / f"{name}.rank{_rank()}.pt")


def flat(out: Path) -> None:
    """One node of two ranks: the checkpoints the 2-node runs resume."""
    fit(out, "flat_ddp", plan=None, num_nodes=1, max_steps=SAVE_STEP, save=True)
    fit(out, "flat_osdp", plan="flat", num_nodes=1, max_steps=SAVE_STEP, save=True)


def nodes(out: Path) -> None:
    """Two nodes of two ranks."""
    fit(out, "ddp", plan=None, num_nodes=2, save=True)  # also the reference of the 2-node checkpoint's resume
    fit(out, "hybrid", plan="hybrid", num_nodes=2, save=True)
    fit(out, "ddp@accum_clip", plan=None, num_nodes=2, accum_clip=True)
    fit(out, "hybrid_split@accum_clip", plan="hybrid_split", num_nodes=2, accum_clip=True)
    # The 1-node checkpoints (2 ranks) resumed on 2 nodes of 2 ranks: OSDP under the hybrid plan, DDP as reference.
    fit(out, "up_ddp", plan=None, num_nodes=2, ckpt_path=out / "flat_ddp" / f"step={SAVE_STEP}.ckpt")
    fit(out, "up_hybrid", plan="hybrid_split", num_nodes=2, ckpt_path=out / "flat_osdp" / f"step={SAVE_STEP}.ckpt")
    # No plan: the strategy measures both levels of the network on the real groups, profiles and solves.
    planned = OSDPStrategy(memory_budget="1GiB", memory_steps=0, plan_out=out / "planned" / "plan.json")
    wider = {"width": 96, "hidden": 384}  # blocks of 110k parameters: bandwidth, not only latency, counts
    fit(out, "planned", plan=None, num_nodes=2, max_steps=2, strategy=planned, model_kwargs=wider)


def resume(out: Path) -> None:
    """One node of two ranks again: the 2-node checkpoints resumed under the 1-node plan."""
    fit(out, "down_ddp", plan=None, num_nodes=1, ckpt_path=out / "ddp" / f"step={SAVE_STEP}.ckpt")
    fit(out, "down_osdp", plan="flat", num_nodes=1, ckpt_path=out / "hybrid" / f"step={SAVE_STEP}.ckpt")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cases = {"flat": flat, "nodes": nodes, "resume": resume}
    cases[sys.argv[2]](out)


if __name__ == "__main__":
    main()
    finish()
