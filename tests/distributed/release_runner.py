"""Live memory in the middle of a mixed plan's forward, with and without OSDP's all-gather release, on 2 ranks.

Started by tests/test_executor.py with ``torchrun --nproc-per-node 2``. Usage: ``release_runner.py OUT_DIR``; each
rank writes ``OUT_DIR/release.rank{R}.json``: the live bytes when ``h.1`` (``no_shard``, after the ``full_shard``
``h.0``) ends its forward, with the release (``released``) and without it (``kept``), and the size of ``h.0``'s
flat all-gather buffer.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import Plan, apply_plan
from lightning_osdp.apply import executor
from lightning_osdp.memory import LiveStorageTracker

from models import TinyGPT


def live_after_h1(release: bool) -> tuple[int, int]:
    executor.releases_all_gather_after_forward = lambda device_type: release  # type: ignore[assignment]
    torch.manual_seed(0)
    model = TinyGPT()
    world = dist.get_world_size()
    flat = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in model.h[0].parameters()) * world * 4
    mesh = init_device_mesh("cpu", (world,))
    root = apply_plan(model, Plan({"": "no_shard", "h.0": "full_shard"}), mesh=mesh)
    tracker = LiveStorageTracker().start(model)
    seen: list[int] = []
    model.h[1].register_forward_hook(lambda *_: seen.append(tracker.live))
    root(torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0)))
    tracker.stop()
    return seen[0], flat


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    released, flat = live_after_h1(True)
    kept, _ = live_after_h1(False)
    result = {"released": released, "kept": kept, "flat_bytes": flat}
    (out / f"release.rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    finish()
