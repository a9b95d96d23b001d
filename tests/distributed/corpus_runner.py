"""The user corpus (``tests/corpus.py``) under the default ``strategy="osdp"`` and Lightning's DDP on 2 ranks.

Usage: ``corpus_runner.py OUT_DIR CASE [CASE ...]``; a case is ``MODEL:RUN``, ``RUN`` one of ``ddp`` (Lightning's DDP
strategy), ``ample`` (OSDP at twice DDP's predicted need) and ``tight`` (OSDP at :data:`TIGHT` of the way from the
planner's minimum to DDP's need: it shards and recomputes). OSDP is given nothing but the budget (and, for a model
built on meta, the pretrained folder DDP loads too). Each case writes ``OUT_DIR/MODEL-RUN.rank{R}.pt``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import OSDPStrategy, Plan, minimum_budget, predict, profile
from lightning_osdp.planning import largest_batch
from lightning_osdp.solver.policy import DEFAULT_MEMORY_HEADROOM

from corpus import CASES, Case, quiet_hf
from models import quiet_trainer

#: Where the tight budget sits between the planner's minimum (0) and DDP's predicted need (1).
TIGHT = 0.3


def budgets(case: Case) -> dict[str, int]:
    """DDP's predicted need and the planner's minimum on the largest batch of the whole dataset (at least the one OSDP
    plans from, the largest of each rank's first batches). The minimum is the larger of the measured profile's and the
    one on fake tensors (which OSDP plans from when a copy of the step does not fit): a step with data-dependent shapes
    (a mixture of experts' routing) is counted at its upper bound there, and a budget between the two would be
    refused, with the smallest budget named."""
    torch.manual_seed(0)
    model = case.build()
    batch = largest_batch(case.loader(), scanned=10**9)[0]
    # As the strategy profiles it: with the Trainer's gradient accumulation.
    accumulation = case.trainer.get("accumulate_grad_batches", 1)
    measured, estimated = (
        dataclasses.replace(
            profile(model, batch, mode=mode, optimizer=case.optimizer), gradient_accumulation=accumulation
        )
        for mode in ("measured", "estimated")
    )
    ddp = predict(measured, Plan.uniform(model, "no_shard"), dist.get_world_size()).peak_bytes
    low = max(minimum_budget(p, dist.get_world_size()) for p in (measured, estimated))
    # The planner plans against the budget less its headroom.
    tight = (low + TIGHT * max(ddp - low, 0)) / (1 - DEFAULT_MEMORY_HEADROOM)
    return {"ample": 2 * ddp, "tight": int(tight) + 1}


def pretrained_folder(case: Case, out: Path, name: str) -> Path:
    """The weights a meta-built run starts from, saved as ``save_pretrained`` saves them (rank 0 writes)."""
    folder = out / f"{name}-pretrained"
    if dist.get_rank() == 0 and not folder.exists():
        torch.manual_seed(0)
        case.build().model.save_pretrained(folder)  # type: ignore[operator]
    dist.barrier()
    return folder


def run(spec: str, out: Path) -> None:
    name, _, kind = spec.partition(":")
    case = CASES[name]
    folder = pretrained_folder(case, out, name) if case.meta else None
    strategy: Any
    if kind == "ddp":
        strategy = DDPStrategy(find_unused_parameters=case.unused_parameters)
    else:
        budget = budgets(case)[kind]
        strategy = OSDPStrategy(memory_budget=budget, pretrained=folder)
    L.seed_everything(0, workers=True)
    epochs = int(os.environ.get("CORPUS_EPOCHS", "2"))  # benchmarks/user_corpus.py runs more, for timed steps
    trainer = quiet_trainer(strategy, max_epochs=epochs, deterministic=True, default_root_dir=out, **case.trainer)
    with trainer.init_module(empty_init=case.meta and kind != "ddp"):
        model = case.build()
    if folder is not None and kind == "ddp":
        from transformers import AutoModelForCausalLM

        model.model.load_state_dict(AutoModelForCausalLM.from_pretrained(folder).state_dict())  # type: ignore[operator]
    loader = case.loader()
    validates = type(model).validation_step is not L.LightningModule.validation_step
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader, loader if validates else None)
    seconds = time.perf_counter() - started
    if kind == "ddp":
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    else:
        state = {k: v.float() for k, v in trainer.strategy.full_model_state_dict().items()}
    check = getattr(trainer.strategy, "prediction_check", None)
    monitor = getattr(trainer.strategy, "monitor", None)
    profiled = getattr(trainer.strategy, "profile", None)
    predicted = predict(profiled, trainer.strategy.plan, dist.get_world_size()) if profiled else None
    # The same plan predicted from a profile measured on a copy (benchmarks/user_corpus.py): what the fake-tensor
    # path's prediction is worth against the measured path's, apart from how the step's time is modelled.
    against_measured = None
    if predicted is not None and profiled.mode != "measured" and os.environ.get("CORPUS_COMPARE_PROFILES"):
        torch.manual_seed(0)
        batch = largest_batch(case.loader(), scanned=10**9)[0]
        measured = profile(case.build(), batch, mode="measured", optimizer=case.optimizer)
        measured = dataclasses.replace(measured, gradient_accumulation=profiled.gradient_accumulation)
        against_measured = predict(measured, trainer.strategy.plan, dist.get_world_size()).step_seconds
    result = {
        "losses": list(model.losses),
        "state": state if dist.get_rank() == 0 else None,
        "buffers": {k: v.detach().float().cpu().clone() for k, v in model.named_buffers()},
        "extra": {k: getattr(model, k) for k in ("epoch_metrics", "skipped") if hasattr(model, k)},
        "plan": trainer.strategy.plan.to_dict() if kind != "ddp" else None,
        "profile": profiled.to_dict() if profiled else None,  # for predictions under other constants
        "step_seconds": [m.seconds for m in monitor.measurements[1:] if not m.tracked] if monitor is not None else [],
        "profile_mode": trainer.strategy.profile.mode if kind != "ddp" and trainer.strategy.profile else None,
        "peak": getattr(trainer.strategy, "peak_memory_bytes", None),
        "setup_peak": getattr(trainer.strategy, "setup_peak_memory_bytes", None),
        "budget": getattr(trainer.strategy, "memory_budget", None),
        "memory_ratio": check.memory_ratio if check is not None else None,  # predicted / measured
        "time_ratio": check.time_ratio if check is not None else None,
        "step_time": getattr(trainer.strategy, "step_time", None),
        "predicted_step_time": predicted.step_seconds if predicted is not None else None,
        "predicted_from_measured_profile": against_measured,
        "timed_steps": sum(not m.tracked for m in monitor.measurements[1:]) if monitor is not None else 0,
        "fit_seconds": seconds,
        "warnings": [str(w.message) for w in caught if "OSDP" in str(w.message)],
    }
    torch.save(result, out / f"{name}-{kind}.rank{dist.get_rank()}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    quiet_hf()
    for spec in sys.argv[2:]:
        run(spec, out)


if __name__ == "__main__":
    main()
    finish()
