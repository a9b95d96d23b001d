"""Each block's memory in forward and in backward, measured on 2 ranks beside the cost model's, per plan.

Started by tests/test_segment_memory.py with ``torchrun --nproc-per-node 2``. Usage: ``segment_memory_runner.py
OUT_DIR``; rank 0 writes ``OUT_DIR/segment_memory.json``: per plan, the measured and predicted peak of the step, and per
block and pass (``forward``/``backward``) the largest live bytes measured while it ran and the largest instant the
cost model predicts for it (its segment's ``forward <block>``/``backward <block>`` instants), and whether it recomputes.

A block's forward runs from its first pre-forward hook (before FSDP2's, which gathers) to its last post-forward hook
(after FSDP2's, which reshards); its backward from the first hook of its backward (FSDP2's pre-backward gather, or the
output gradient reaching it) to the backward of the module before it (the block before, or the frozen adapter before
the first block), so that its post-backward (reshard, reduction) is in it.

Each figure is the smallest of three measured steps (after two that initialise FSDP2, the optimizer state and DDP's
buckets): now and then a buffer a collective used outlives it by a moment (gloo's threads hold it), one unit's
all-gather output or reduce-scatter input seen at a later instant than usual, in about one run in five. The steps
are the same computation; the smallest is the one without that race.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
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

BLOCKS = 3
RECOMPUTE_SGO = Decision("shard_grad_op", recompute=True)
PLANS: dict[str, dict[str, Any]] = {
    # The reference: DDP alone, no FSDP2 buffer at all.
    "no_shard": {"": "no_shard", **{f"h.{i}": "no_shard" for i in range(BLOCKS)}},
    "shard_grad_op": {"": "shard_grad_op", **{f"h.{i}": "shard_grad_op" for i in range(BLOCKS)}},
    "mixed": {"": "no_shard", "h.0": "shard_grad_op", "h.1": "full_shard", "h.2": "shard_grad_op"},
    # shard_grad_op blocks that recompute, each with its fc full_shard: the block's pre-backward prefetches the fc,
    # whose pre-forward in the recomputation then only copies out.
    "shard_grad_op+recompute+nested": {
        "": "shard_grad_op",
        **{f"h.{i}": RECOMPUTE_SGO for i in range(BLOCKS)},
        **{f"h.{i}.fc": "full_shard" for i in range(BLOCKS)},
    },
    # The same nested unit under a DDP block (prefetched by the next block's first unit) and a full_shard block, and
    # two nested units (the recomputation gathers both; the later one's prefetch of the earlier is FSDP2's no-op).
    "mixed+recompute+nested": {
        "": "no_shard",
        "h.0": Decision("no_shard", recompute=True),
        "h.0.fc": "full_shard",
        "h.1": Decision("full_shard", recompute=True),
        "h.1.fc": "full_shard",
        "h.1.proj": "full_shard",
        "h.2": "shard_grad_op",
    },
}


class WindowTracker(LiveStorageTracker):
    """:class:`LiveStorageTracker` that also keeps the largest live bytes since the last :meth:`cut`."""

    window = 0

    def start(self, *roots: Any) -> WindowTracker:
        super().start(*roots)
        self.window = self.live
        return self

    def _add(self, delta: int) -> None:
        super()._add(delta)
        self.window = max(self.window, self.live)

    def cut(self) -> int:
        """The largest live bytes since the previous cut (or the start); a new window starts now."""
        largest, self.window = self.window, self.live
        return largest


class Windows:
    """Per block and pass, the largest live bytes while it ran (see the module docstring)."""

    def __init__(self, blocks: list[torch.nn.Module], before: torch.nn.Module) -> None:
        self.tracker: WindowTracker | None = None
        self.current: tuple[str, int] | None = None
        #: the step being measured: per block and pass, its largest live bytes
        self.largest: dict[tuple[str, int], int] = {}
        for i, block in enumerate(blocks):
            # Prepended: before FSDP2's pre-forward (its gather is the block's); appended after FSDP2's post-forward.
            block.register_forward_pre_hook(lambda *_, i=i: self.enter(("forward", i)), prepend=True)
            block.register_forward_hook(lambda *_: self.enter(None))
            block.register_full_backward_pre_hook(lambda *_, i=i: self.enter(("backward", i)), prepend=True)
        before.register_full_backward_pre_hook(lambda *_: self.enter(None))

    def enter(self, window: tuple[str, int] | None) -> None:
        if self.tracker is None or window == self.current:
            return
        largest = self.tracker.cut()
        if self.current is not None:
            self.largest[self.current] = max(self.largest.get(self.current, 0), largest)
        self.current = window

    def measure(self, run_step: Callable[[], None], *roots: Any) -> tuple[int, dict[tuple[str, int], int]]:
        """Run one step under a new tracker of ``roots``; its peak and its figures per block and pass."""
        self.largest = {}
        self.tracker = WindowTracker().start(*roots)
        try:
            run_step()
        finally:
            peak = self.tracker.stop()
            self.enter(None)
            self.tracker = None
        return peak, self.largest


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(width=48, hidden=192, layers=BLOCKS)


def step(root: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, windows: Windows) -> None:
    gpt_step(root, optimizer, tokens, between=lambda: windows.enter(None))  # the loss is no block's


def run(name: str, tokens: torch.Tensor, prof: Any) -> dict[str, Any]:
    lm = model()
    plan = Plan(PLANS[name])
    root = apply_plan(lm, plan, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    windows = Windows(list(lm.h), lm.frozen)
    step(root, optimizer, tokens, windows)  # lazy init, optimizer state
    step(root, optimizer, tokens, windows)  # DDP's bucket rebuild
    steps = [windows.measure(lambda: step(root, optimizer, tokens, windows), lm, optimizer) for _ in range(3)]
    prediction = predict(prof, plan, dist.get_world_size())
    blocks = []
    for i in range(BLOCKS):
        entry: dict[str, Any] = {"recompute": plan.decisions[f"h.{i}"].recomputes}
        for phase in ("forward", "backward"):
            predicted = [v for label, v in prediction.instants if label == f"{phase} h.{i}"]
            entry[phase] = {"measured": min(s[1][(phase, i)] for s in steps), "predicted": max(predicted)}
        blocks.append(entry)
    return {"peak": min(s[0] for s in steps), "predicted": prediction.peak_bytes, "blocks": blocks}


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    train, _ = loaders(batch_size=4)
    batch = next(iter(train))
    prof = profile(model(), batch)
    results = {name: run(name, batch[1], prof) for name in PLANS}
    if dist.get_rank() == 0:
        (out / "segment_memory.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    finish()
