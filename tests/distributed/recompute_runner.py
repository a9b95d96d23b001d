"""How many all-gathers a step of a recomputing plan runs, and its measured peak against the cost model's, on 2 ranks.

Started by tests/test_recompute.py with ``torchrun --nproc-per-node 2``. Usage: ``recompute_runner.py OUT_DIR``;
rank 0 writes ``OUT_DIR/recompute.json``: per plan, the all-gathers of the second step (the first runs FSDP2's lazy
init) and its measured and predicted peak memory.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import Decision, Plan, apply_plan, predict, profile
from lightning_osdp.memory import LiveStorageTracker

from models import TinyGPT, gpt_step, loaders

PLANS: dict[str, dict[str, Any]] = {
    "full_shard": {"": "no_shard", **{f"h.{i}": "full_shard" for i in range(3)}},
    "full_shard+recompute": {"": "no_shard", **{f"h.{i}": Decision("full_shard", recompute=True) for i in range(3)}},
    # A full_shard unit nested in a recomputed block: its own pre-forward gathers it in the recomputation.
    "nested": {"": "no_shard", "h.0": "shard_grad_op", "h.0.fc": "full_shard", "h.1": "no_shard", "h.2": "no_shard"},
    "nested+recompute": {
        "": "no_shard",
        "h.0": Decision("shard_grad_op", recompute=True),
        "h.0.fc": "full_shard",
        "h.1": "no_shard",
        "h.2": "no_shard",
    },
    "full_shard+selective": {
        "": "no_shard",
        **{f"h.{i}": Decision("full_shard", recompute="selective") for i in range(3)},
    },
    "nested+selective": {
        "": "no_shard",
        "h.0": Decision("shard_grad_op", recompute="selective"),
        "h.0.fc": "full_shard",
        "h.1": "no_shard",
        "h.2": "no_shard",
    },
}


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(width=48, hidden=192)


def run(name: str, tokens: torch.Tensor, prof: Any) -> dict[str, Any]:
    lm = model()
    plan = Plan(PLANS[name])
    root = apply_plan(lm, plan, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    gpt_step(root, optimizer, tokens)  # lazy init, optimizer state
    gpt_step(root, optimizer, tokens)  # DDP's bucket rebuild
    calls = 0
    # FSDP2's all-gather (and OSDP's on CPU, comm.py) is one of these, whichever this torch has: count the calls.
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def counting(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, counting(originals[n]))
    tracker = LiveStorageTracker().start(lm, optimizer)
    try:
        gpt_step(root, optimizer, tokens)
    finally:
        for n in names:
            setattr(dist, n, originals[n])
        peak = tracker.stop()
    return {"all_gathers": calls, "peak": peak, "predicted": predict(prof, plan, dist.get_world_size()).peak_bytes}


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    train, _ = loaders(batch_size=4)
    batch = next(iter(train))
    tokens = batch[1]
    prof = profile(model(), batch)
    results = {name: run(name, tokens, prof) for name in PLANS}
    if dist.get_rank() == 0:
        (out / "recompute.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    finish()
