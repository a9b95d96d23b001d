"""What full recomputation runs in backward, as the profile counts it: torch's own recomputation, operator for
operator (``lightning_osdp/profiling/replay.py`` [Note: the recomputation stops at the last saved tensor])."""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_osdp.cost_model import predict
from lightning_osdp.memory import LiveStorageTracker
from lightning_osdp.plan import Plan
from lightning_osdp.profiling import profile
from lightning_osdp.profiling.replay import OpsTally, count_saves, replay_ops, time_full_replay
from lightning_osdp.profiling.tracer import OpTally, _OpRecorder


class Block(nn.Module):
    """A pre-norm MLP block: its last saved tensors are the down projection's input and weight."""

    def __init__(self, width: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Two blocks of ``block`` in a ModuleList (what the profiler measures as blocks), called in turn."""

    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _torch_recomputation(block: nn.Module, x: Tensor) -> tuple[OpTally, OpTally]:
    """The operators of ``block``'s forward and of torch's recomputation of it in backward, under non-reentrant
    ``torch.utils.checkpoint`` as the executor runs it."""
    runs: list[OpTally] = []

    def forward(t: Tensor) -> Any:
        tally = OpsTally()
        try:
            with _OpRecorder(tally):  # type: ignore[arg-type]
                return block(t)
        finally:  # the recomputation leaves by torch's early-stop exception
            runs.append(tally.ops)

    out = checkpoint(forward, x, use_reentrant=False)
    out.sum().backward()
    assert len(runs) == 2
    return runs[0], runs[1]


def test_the_replay_runs_what_torch_recomputes() -> None:
    block, x = Block(), torch.randn(4, 8, 16, requires_grad=True)
    forward, recomputed = _torch_recomputation(block, x)
    saves = count_saves(block, (x,), {})
    replay = replay_ops(block, (x,), {}, saves)
    assert (replay.matmul_ops, replay.matmul_flops) == (recomputed.matmul_ops, recomputed.matmul_flops)
    assert replay.memory_bytes == recomputed.memory_bytes  # torch's own detaches move no bytes
    # torch stops before the down projection: only the up projection's FLOPs run again, not the forward's all.
    tokens = 4 * 8
    assert recomputed.matmul_flops == 2 * tokens * 16 * 64 < forward.matmul_flops == 2 * 2 * tokens * 16 * 64


def test_a_block_that_saves_nothing_replays_nothing() -> None:
    frozen = Block().requires_grad_(False)
    x = torch.randn(2, 16)
    assert count_saves(frozen, (x,), {}) == 0
    assert replay_ops(frozen, (x,), {}, 0).matmul_flops == 0


def test_the_profile_charges_full_recomputation_its_replay() -> None:
    net, x = Net(), torch.randn(4, 8, 16)
    for mode in ("estimated", "measured"):
        result = profile(net, x, mode=mode)
        for name in ("blocks.0", "blocks.1"):
            forward = sum(m.fwd_seconds for n, m in result.modules.items() if n == name or n.startswith(name + "."))
            replay = result.modules[name].recompute_replay_seconds
            assert replay is not None and replay > 0, (mode, name)
            if mode == "estimated":  # times from the rates: exact, without the measured mode's noise
                assert replay < forward, name
        assert result.modules["blocks"].recompute_replay_seconds is None  # not a block


def test_the_cost_model_charges_the_replay_and_an_earlier_profile_the_whole_forward() -> None:
    net, x = Net(), torch.randn(4, 8, 16)
    estimated = profile(net, x, mode="estimated")
    plan = Plan.uniform(net, "no_shard", recompute="full")
    blocks = ("blocks.0", "blocks.1")
    replays = sum(estimated.modules[b].recompute_replay_seconds or 0.0 for b in blocks)
    assert predict(estimated, plan, 1).step_parts["recompute"] == pytest.approx(replays)
    # A profile from before version 7 has no replay: the recomputation is charged the blocks' whole forward.
    earlier = dataclasses.replace(
        estimated,
        modules={n: dataclasses.replace(m, recompute_replay_seconds=None) for n, m in estimated.modules.items()},
    )
    forwards = sum(m.fwd_seconds for n, m in estimated.modules.items() if n.startswith(blocks))
    assert predict(earlier, plan, 1).step_parts["recompute"] == pytest.approx(forwards)
    assert forwards > replays


def test_a_replay_leaves_nothing_alive_without_a_garbage_collection() -> None:
    # The profiler times replays with garbage collection off (timing.py): a saved output the hook kept would hold
    # its own grad_fn, a cycle alive until the next collection, above the budget in setup (tests/test_user_corpus.py).
    import torch._dynamo  # its first import, inside a forward, leaves a cycle of its own

    block, x = nn.Sequential(nn.Linear(16, 64), nn.Sigmoid(), nn.Linear(64, 16)), torch.randn(8, 16)
    saves = count_saves(block, (x,), {})
    enabled = gc.isenabled()
    gc.disable()
    tracker = LiveStorageTracker("cpu").start()
    try:
        count_saves(block, (x,), {})
        time_full_replay(block, lambda: ((x,), {}), time.perf_counter, saves)
        assert tracker.live == 0
    finally:
        tracker.stop()
        if enabled:
            gc.enable()


def test_a_block_called_twice_a_step_is_charged_two_replays() -> None:
    class Twice(Net):
        def forward(self, x: Tensor) -> Tensor:
            return self.blocks[1](self.blocks[0](self.blocks[0](x)))

    result = profile(Twice(), torch.randn(4, 8, 16), mode="estimated")
    once, twice = (result.modules[f"blocks.{i}"].recompute_replay_seconds for i in (1, 0))
    assert once is not None and twice == pytest.approx(2 * once)


class Temporary(nn.Module):
    """A block whose own code holds a temporary four times its input that nothing saves for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        wide = x.repeat(1, 1, 4)  # saved by nothing: repeat's and sum's backward need only shapes
        return self.lin(x) + wide.sum(-1, keepdim=True)


def test_a_blocks_forward_peak_counts_its_own_codes_temporaries() -> None:
    net, x = Net(Temporary), torch.randn(4, 8, 16)
    result = profile(net, x, mode="estimated")
    wide = 4 * 8 * 64 * 4
    block = result.modules["blocks.0"]
    saved = sum(m.activation_bytes for n, m in result.modules.items() if n.startswith("blocks.0"))
    assert block.forward_peak_bytes is not None
    assert block.forward_peak_bytes >= saved + block.output_bytes + wide
    # The cost model's forward instant of the block holds it; a profile without the figure misses it.
    plan = Plan.uniform(net, "no_shard")
    earlier = dataclasses.replace(
        result, modules={n: dataclasses.replace(m, forward_peak_bytes=None) for n, m in result.modules.items()}
    )
    at = {label: value for label, value in predict(result, plan, 1).instants}
    before = {label: value for label, value in predict(earlier, plan, 1).instants}
    assert at["forward blocks.0"] - before["forward blocks.0"] >= wide
