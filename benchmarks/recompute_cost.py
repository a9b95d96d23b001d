"""What full recomputation adds to a block's step, against what the profile charges for it.

Run: ``python benchmarks/recompute_cost.py [--rounds 5] [--repeats 20]`` (one process, one thread; about 4 minutes).

For each block (the examples' GPT block and Llama block at a few widths, a batch of 2 x 128 tokens), per round, in
a rotated order (load from elsewhere hits the cases alike):

* *plain*: the block's forward and backward, twice (``plain`` and ``plain again``: the A/A spread, the noise floor);
* *checkpointed*: the same under non-reentrant ``torch.utils.checkpoint``, as OSDP's executor runs a block with
  ``recompute="full"``;
* *forward*: the block's forward alone (with gradients enabled): what the cost model charged a recomputation before
  it stopped at the last saved tensor;
* *replay*: the profiler's figure (``lightning_osdp/profiling/replay.py``'s ``time_full_replay``): the forward up to
  its last saved tensor, where torch's recomputation stops.

Each figure is the median of ``--repeats`` calls after a warm-up. Printed per block: what checkpointing adds
(checkpointed - plain), the forward and the replay, as the fastest and the median round, and the replay's and the
forward's ratio to what checkpointing adds (per-round ratios: median and range), beside the A/A ratio's range; and
the same in CPU seconds (``time.process_time``), which other processes' load changes far less than the wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "llama"))

from lightning_osdp.profiling.replay import count_saves, time_full_replay

BATCH, CONTEXT = 2, 128
KINDS = ("plain", "plain again", "checkpointed", "forward", "replay")


def gpt_block(width: int) -> tuple[nn.Module, tuple[Tensor, ...]]:
    from gpt import GPTModule

    module = GPTModule(width=width, depth=1, heads=4, context_length=CONTEXT)
    return module.model.blocks[0], (torch.randn(BATCH, CONTEXT, width, requires_grad=True),)


def llama_block(width: int) -> tuple[nn.Module, tuple[Tensor, ...]]:
    from llama import Llama

    model = Llama(vocab_size=256, context_length=CONTEXT, dim=width, n_layers=1, n_heads=4, n_kv_heads=2)
    x = torch.randn(BATCH, CONTEXT, width, requires_grad=True)
    return model.layers[0], (x, model.rope_cos, model.rope_sin)


def timers(block: nn.Module, args: tuple[Tensor, ...]) -> dict[str, Callable[[], None]]:
    saves = count_saves(block, args, {})

    def plain() -> None:
        block(*args).sum().backward()

    def checkpointed() -> None:
        checkpoint(block, *args, use_reentrant=False).sum().backward()

    def forward() -> None:
        with torch.enable_grad():
            block(*args)

    def replay() -> None:
        time_full_replay(block, lambda: (args, {}), time.perf_counter, saves)

    return {"plain": plain, "plain again": plain, "checkpointed": checkpointed, "forward": forward, "replay": replay}


def median_call(f: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``f`` over ``repeats`` calls, after two warm-up calls."""
    f()
    f()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        f()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cases = {f"GPT block, width {w}": gpt_block(w) for w in (256, 512, 1024)}
    cases |= {f"Llama block, width {w}": llama_block(w) for w in (256, 1024)}
    calls = {name: timers(*case) for name, case in cases.items()}
    # figures[case][kind] = one (wall, cpu) per round
    figures: dict[str, dict[str, list[tuple[float, float]]]] = {n: {k: [] for k in KINDS} for n in cases}
    names = list(cases)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            kinds = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
            for kind in kinds:
                figures[name][kind].append(median_call(calls[name][kind], args.repeats))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    for clock, index in (("wall", 0), ("CPU", 1)):
        print(f"\n{clock} ms (fastest / median round); ratios: median of the rounds' (lowest - highest)\n")
        print("| block | added by checkpointing | forward | replay | replay / added | forward / added | A/A |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            f = {k: [v[index] * 1e3 for v in figures[name][k]] for k in KINDS}
            added = [c - p for c, p in zip(f["checkpointed"], f["plain"], strict=True)]

            def cell(xs: list[float]) -> str:
                return f"{min(xs):.2f} / {statistics.median(xs):.2f}"

            def ratio(xs: list[float], ys: list[float]) -> str:
                rs = [x / y for x, y in zip(xs, ys, strict=True)]
                return f"{statistics.median(rs):.2f} ({min(rs):.2f} - {max(rs):.2f})"

            print(
                f"| {name} | {cell(added)} | {cell(f['forward'])} | {cell(f['replay'])} | "
                f"{ratio(f['replay'], added)} | {ratio(f['forward'], added)} | {ratio(f['plain again'], f['plain'])} |"
            )


if __name__ == "__main__":
    main()
