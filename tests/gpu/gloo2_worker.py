"""One of the two processes of ``test_gpu_gloo2.py``: started by two single-process torchrun agents
(``--nnodes=2 --nproc-per-node=1``), so ``LOCAL_RANK`` is 0 on both and both train on ``cuda:0``.

Usage: ``gloo2_worker.py DEVICE SCRATCH``. First the collectives FSDP2 and DDP issue, on DEVICE tensors over the gloo
group; then Lightning's DDP against OSDP with a mixed plan, 8 steps each. Writes ``SCRATCH/gloo2.rank{R}.pt``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/; this folder is sys.path[0] already

from clean_exit import finish
from gpu_helpers import BatchMeter, default_foreach, fit_tiny, run_with_default_optimizer, tiny_run

from distributed.runner import PLANS


def probe_collectives(device: torch.device) -> dict[str, str]:
    """The collectives FSDP2 and DDP issue, on ``device`` tensors over the default (gloo) group: each ``"ok"``,
    ``"wrong: ..."`` or ``"error: ..."``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    found: dict[str, str] = {}

    def attempt(name: str, fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            got, want = fn()
            found[name] = "ok" if torch.equal(got.cpu(), want) else f"wrong: {got.cpu().tolist()} != {want.tolist()}"
        except Exception as error:
            found[name] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"

    def all_reduce(op: Any) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(t, op=op)
        total = world * (world + 1) / 2
        return t, torch.full((4,), total / world if op == dist.ReduceOp.AVG else total)

    def all_gather_into_tensor() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(4 * world, device=device)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=device))
        return out, torch.arange(world, dtype=torch.float32).repeat_interleave(4)

    def reduce_scatter_tensor() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, torch.arange(2.0 * world, device=device) * (rank + 1), op=dist.ReduceOp.AVG)
        scale = sum(range(1, world + 1)) / world
        return out, torch.arange(2.0 * rank, 2.0 * rank + 2) * scale

    def broadcast() -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.full((3,), float(rank), device=device)
        dist.broadcast(t, src=0)
        return t, torch.zeros(3)

    attempt("all_reduce_sum", lambda: all_reduce(dist.ReduceOp.SUM))
    attempt("all_reduce_avg", lambda: all_reduce(dist.ReduceOp.AVG))
    attempt("all_gather_into_tensor", all_gather_into_tensor)
    attempt("reduce_scatter_tensor_avg", reduce_scatter_tensor)
    attempt("broadcast", broadcast)
    dist.barrier()
    return found


def fit(device: str, scratch: Path, name: str, foreach: bool | None) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_osdp import OSDPStrategy, Plan

    strategy: Any = DDPStrategy(process_group_backend="gloo")
    if name == "mixed":
        strategy = OSDPStrategy(plan=Plan(PLANS["mixed"]), process_group_backend="gloo")
    meter = BatchMeter()
    trainer, model = fit_tiny(device, scratch, "32-true", strategy, foreach=foreach, callbacks=[meter], num_nodes=2)
    return {
        **tiny_run(trainer, model),
        "step_seconds": statistics.median(meter.seconds[2:]),
        "allocator_peak_bytes": max(meter.allocated) if meter.allocated else None,
        "foreach": foreach,
    }


def main() -> None:
    device, scratch = sys.argv[1], Path(sys.argv[2])
    # The group Lightning's strategies then find and use, so that the probe runs on the same group.
    dist.init_process_group("gloo")
    target = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(target)
    result: dict[str, Any] = {"probe": probe_collectives(target), "runs": {}, "failures": []}
    # The mixed plan first: DDP then runs with the optimizer path it ended up with (see test_gpu_parity.py).
    foreach = default_foreach(device)
    try:
        result["runs"]["mixed"], foreach, default_error = run_with_default_optimizer(
            device, lambda fe: fit(device, scratch, "mixed", fe)
        )
        if default_error is not None:
            result["failures"].append(f"mixed: {default_error}")
    except Exception as error:
        result["failures"].append(f"mixed: training failed: {type(error).__name__}: {str(error)[:300]}")
    try:
        result["runs"]["ddp"] = fit(device, scratch, "ddp", foreach)
    except Exception as error:
        result["failures"].append(f"ddp: training failed: {type(error).__name__}: {str(error)[:300]}")
    torch.save(result, scratch / f"gloo2.rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
    finish()
