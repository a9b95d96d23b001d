"""Shared helpers: launching multi-process runs with real launchers on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: quiet, single-threaded, and importing this checkout."""
    env = dict(os.environ)
    # In-process Lightning runs of earlier tests leave their rendezvous in os.environ (a port this process still
    # holds, ranks): a child that inherited them would wait for peers that never come.
    for key in ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(key, None)
    env["MASTER_PORT"] = str(free_port())
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        MASTER_ADDR="127.0.0.1",
    )
    env.update(extra)
    return env


def torchrun(
    script: Path, *args: str, nproc: int = 2, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torch.distributed.run`` with ``nproc`` local ranks; raise with its output on failure."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, env=child_env(**(env or {})), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_example(
    example: str, config: str, steps: int, log_dir: Path, *, timeout: float = 300, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``python examples/EXAMPLE/train.py fit --config examples/EXAMPLE/configs/CONFIG`` as the README runs it,
    shortened to ``steps`` steps (validation once, at the end, on 2 batches; every step logged under ``log_dir``;
    200 kB of text); fails the test with the output when it does not exit 0."""
    cmd = [
        sys.executable,
        f"examples/{example}/train.py",
        "fit",
        "--config",
        f"examples/{example}/configs/{config}",
        "--trainer.max_steps",
        str(steps),
        "--trainer.val_check_interval",
        str(steps),
        "--trainer.limit_val_batches",
        "2",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.logger.init_args.save_dir",
        str(log_dir),
        "--data.max_bytes",
        "200000",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@pytest.fixture(scope="session")
def world1() -> Iterator[object]:
    """A real one-rank gloo process group and 1-D device mesh in this process (FSDP2 needs a group), destroyed at the
    end of the session (a gloo group alive at interpreter exit can abort the process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    if dist.is_initialized():
        dist.destroy_process_group()
