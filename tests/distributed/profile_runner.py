"""Profiles on a real gloo process group: the collective benchmark and a whole ``profile()``, rank by rank.

Started by the tests with ``torchrun --nproc-per-node 2``. Usage: ``profile_runner.py OUT_DIR``; each rank writes
``OUT_DIR/collectives.rank{R}.json`` (the fits ``benchmark_collectives`` returned on that rank) and
``OUT_DIR/profile.rank{R}.json`` (the profile of ``TinyGPT`` that ``profile`` returned on that rank), and
``OUT_DIR/error.rank{R}.json`` (what ``profile`` raised on that rank when rank 1's batch does not run).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp.comm import reduce_scatter_comm
from lightning_osdp.profiling import benchmark_collectives, profile

from models import TinyGPT, loaders


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    start = time.perf_counter()
    fits = benchmark_collectives(time_budget_seconds=1.5)
    seconds = time.perf_counter() - start
    document = {"seconds": seconds, "fits": {op: asdict(fit) for op, fit in fits.items()}}
    # The executor's reduce-scatter on gloo (an in-place all-reduce and a chunk) against gloo's own.
    comm = reduce_scatter_comm(dist.group.WORLD)
    assert comm is not None
    grads = torch.randn(2 * 1031, generator=torch.Generator().manual_seed(rank))
    ours, theirs = torch.empty(1031), torch.empty(1031)
    dist.reduce_scatter_tensor(theirs, grads.clone(), op=dist.ReduceOp.AVG)
    comm(ours, grads.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    document["reduce_scatter_max_difference"] = float((ours - theirs).abs().max())
    document["reduce_scatter_max_value"] = float(theirs.abs().max())
    (out / f"collectives.rank{rank}.json").write_text(json.dumps(document))
    torch.manual_seed(0)
    batch = next(iter(loaders(batch_size=4)[0]))
    # Each rank's own batch, as under a distributed sampler: the profile must still be rank 0's everywhere.
    batch = (batch[0], batch[1].roll(rank, dims=0))
    result = profile(TinyGPT(), batch, collectives=fits)
    result.save(out / f"profile.rank{rank}.json")
    # A batch that does not run through the model on rank 1 only: every rank raises (none waits for the other).
    tokens = batch[1] + (1000 if rank == 1 else 0)
    started = time.perf_counter()
    try:
        profile(TinyGPT(), (batch[0], tokens))
        raised = None
    except Exception as error:
        raised = {"type": type(error).__name__, "message": str(error), "seconds": time.perf_counter() - started}
    (out / f"error.rank{rank}.json").write_text(json.dumps(raised))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    finish()
