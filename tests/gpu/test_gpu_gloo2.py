"""Two ranks on one device over gloo (two NCCL ranks cannot share one GPU): two single-process torchrun agents, each
with ``LOCAL_RANK=0`` (``gloo2_worker.py``). First the collectives FSDP2 and DDP issue (all-reduce sum and average,
all-gather into a tensor, reduce-scatter, broadcast) on device tensors; then Lightning's DDP against a mixed plan.

Gloo can run these collectives on CUDA tensors, according to torch's source (``ProcessGroupGloo``): all-reduce stages
the tensors through pinned host memory, all-gather into a tensor is split into a list all-gather, which has a CUDA
path, and the reduce-scatter OSDP gives FSDP2 on gloo is an all-reduce (``lightning_osdp/comm.py``). This test checks
what happens rather than trusting that.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gpu_helpers import DEVICES, PARITY_RTOL, compare_runs

from conftest import ROOT, child_env

Record = Callable[[str, object], None]
WORKER = Path(__file__).resolve().parent / "gloo2_worker.py"


@pytest.mark.distributed
@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_on_one_device_train_as_ddp_over_gloo(device: str, tmp_path: Path, record_property: Record) -> None:
    env = child_env(CUBLAS_WORKSPACE_CONFIG=":4096:8")
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={env['MASTER_PORT']}",
                str(WORKER),
                device,
                str(tmp_path),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    outputs = []
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            # SIGTERM: torchrun passes it on to its workers, which run in sessions of their own (a SIGKILL of the
            # agent would leave them running).
            for other in agents:
                other.terminate()
            outputs.append(agent.communicate(timeout=30)[0] + "\n(timed out)")
    for node, text in enumerate(outputs):
        print(f"--- agent {node} (last lines) ---\n" + "\n".join(text.splitlines()[-25:]))
    record_property("returncodes", [a.returncode for a in agents])
    paths = [tmp_path / f"gloo2.rank{rank}.pt" for rank in range(2)]
    assert all(p.exists() for p in paths), (
        f"a rank wrote no result (agent exit statuses {[a.returncode for a in agents]})"
    )
    results = [torch.load(p, weights_only=False) for p in paths]
    record_property(f"collectives_on_{device}_over_gloo", results[0]["probe"])
    runs = {}
    for rank, result in enumerate(results):
        if {"mixed", "ddp"} <= set(result["runs"]):
            mixed, ddp = result["runs"]["mixed"], result["runs"]["ddp"]
            # Rank 0 holds the full state; the other compares losses only.
            gaps = compare_runs(mixed, ddp) if rank == 0 else compare_runs({**mixed, "state": {}}, {**ddp, "state": {}})
            runs[f"rank{rank}"] = {
                **gaps,
                "foreach": mixed["foreach"],
                "step_seconds": {"ddp": ddp["step_seconds"], "mixed": mixed["step_seconds"]},
                "allocator_peak_bytes": {"ddp": ddp["allocator_peak_bytes"], "mixed": mixed["allocator_peak_bytes"]},
            }
    record_property("runs", runs)

    wrong = {name: status for name, status in results[0]["probe"].items() if status != "ok"}
    assert not wrong, f"collectives on {device} tensors over gloo: {wrong}"
    failures = sorted({f for r in results for f in r["failures"]})
    assert not failures, "\n".join(failures)
    rtol = PARITY_RTOL["32-true"]
    for rank, gaps in runs.items():
        assert gaps["loss_rel"] <= rtol and gaps["param_rel"] <= rtol, (
            f"{rank}: the mixed plan ends {gaps['param_rel']:.2e} (parameters) and {gaps['loss_rel']:.2e} (losses) "
            f"from DDP over gloo; tolerance {rtol:.0e}"
        )
