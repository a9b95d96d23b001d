"""Processes for tests/test_checkpoint_hostile.py: a writer racing the test's reader, and saves onto a full disk.

``hostile_runner.py OUT save-generations PATH N``: one process (no process group) saving a small model to ``PATH``
``N`` times, sharded; generation ``g`` has every parameter equal to ``g`` and ``global_step == g``. It prints
``saved g`` after each save.

``hostile_runner.py OUT full-disk DIR``: under ``torchrun --nproc-per-node 2``, with ``DIR`` a small file system
(the test mounts a 3 MiB tmpfs there): a small sharded save to ``DIR/last.ckpt`` that fits, then saves that do not
fit (sharded, full, and a consolidation by rank 0). Each rank writes what happened, and what ``DIR`` holds
afterwards, to ``OUT/full-disk.rank{R}.json`` (``DIR`` vanishes with the mount).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import checkpoint as ckpt


def generation_model(g: int, width: int = 128, layers: int = 4) -> nn.Module:
    """The model of generation ``g``: every parameter equal to ``g``."""
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(g))
    return model


def save_generation(path: Path, g: int, **kwargs: Any) -> None:
    """Save generation ``g`` to ``path`` (sharded, no process group)."""
    model = generation_model(g, **kwargs)
    state = {"state_dict": ckpt.sharded_model_state(model), "global_step": g}
    ckpt.save_checkpoint(state, path, module=model, context=ckpt.CheckpointContext(world_size=1))


def save_generations(path: Path, saves: int) -> None:
    for g in range(2, saves + 2):
        save_generation(path, g, width=256, layers=8)
        print(f"saved {g}", flush=True)


def _sharded(width: int, layers: int, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def full_disk(out: Path, directory: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    context = ckpt.CheckpointContext(world_size=world)
    path = directory / "last.ckpt"
    small = _sharded(64, 2, mesh)  # ~33 KB
    ckpt.save_checkpoint(
        {"state_dict": ckpt.sharded_model_state(small), "global_step": 1}, path, module=small, context=context
    )
    large = _sharded(512, 4, mesh)  # ~4.2 MB: more than the file system holds
    report: dict[str, Any] = {}
    report["sharded"] = _outcome(
        lambda: ckpt.save_checkpoint(
            {"state_dict": ckpt.sharded_model_state(large), "global_step": 2}, path, module=large, context=context
        )
    )
    report["after_sharded"] = sorted(p.name for p in directory.iterdir())
    report["full"] = _outcome(
        lambda: ckpt.save_checkpoint(
            {"state_dict": ckpt.full_model_state(large), "global_step": 3},
            directory / "full.ckpt",
            module=large,
            context=context,
            state_dict_type="full",
        )
    )
    report["after_full"] = sorted(p.name for p in directory.iterdir())
    dist.barrier()
    # The previous checkpoint is still there, complete, and loads (every rank reads it).
    report["previous_step"] = ckpt.load_checkpoint(path)["global_step"]
    if rank == 0:
        # The file system filled up by something else, all but 8 KiB: the consolidated file (~35 KB) does not fit.
        free = os.statvfs(directory)
        (directory / "filler").write_bytes(bytes(max(free.f_bavail * free.f_frsize - 8192, 0)))
        report["consolidate"] = _outcome(lambda: ckpt.consolidate(path, directory / "small-full.ckpt"))
        report["after_consolidate"] = sorted(p.name for p in directory.iterdir())
    (out / f"full-disk.rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    finish()


def main() -> None:
    out, case = Path(sys.argv[1]), sys.argv[2]
    if case == "save-generations":
        save_generations(Path(sys.argv[3]), int(sys.argv[4]))
    elif case == "full-disk":
        full_disk(out, Path(sys.argv[3]))
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main()
