"""Selective recomputation across memory budgets: the planner's plan with it against the best plan without it.

Run: ``python -m torch.distributed.run --nproc-per-node 2 benchmarks/selective_sweep.py [--width ...]``.

1. Profiles the GPT of ``examples/gpt`` (activations most of its memory at the default shape) once on the process
   group; the sweep's ``--budgets`` budgets run evenly from the new minimum (``minimum_budget``: full recomputation
   allowed) to DDP's predicted need, each given as a user gives it: the planner plans against ``1 - --headroom`` of
   it.
2. At each budget solves twice from that profile: with every option (``recompute="auto"``: none, selective or full
   per unit) and without selective recomputation (the same profile less its selective figures, so ``"auto"`` chooses
   between none and full only, as the planner before it did).
3. Trains each distinct plan with ``OSDPStrategy(plan=...)`` for ``--rounds`` interleaved rounds (each round runs every
   case, in a rotated order, so that load from elsewhere hits the cases alike), and the first budget's plan twice per
   round (``A/A``: the spread of one plan against itself, the noise floor of the ratios).

Prints per budget: the plan, its predicted and measured peak (largest over rounds and ranks, live tensor storages,
``benchmarks/throughput.py``'s meter) and whether the peak stays under the budget; and where the plan uses selective
recomputation, its step time against the plan without it, as the ratio of the *fastest* rounds and of the *median*
rounds (load only slows a round down, so the fastest is the closest to what the code costs), with the range of the
per-round ratios; the same for the CPU seconds the process spends per step (``time.process_time``), which other
processes' load changes far less than the wall time on a shared machine. ``--out`` writes it all as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from lightning_osdp import OSDPStrategy, Plan, minimum_budget, predict, profile
from lightning_osdp.budget import format_bytes
from lightning_osdp.profiling import ModelProfile
from lightning_osdp.solver import solve

from gpt import GPTModule
from throughput import Meter, RandomTokens, add_model_arguments, fit_briefly


def make_model(args: argparse.Namespace) -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        context_length=args.context,
        lr_schedule="constant",
        dropout=args.dropout,
    )


def without_selective(prof: ModelProfile) -> ModelProfile:
    """``prof`` less its blocks' selective figures: the planner then offers none and full recomputation only."""
    stripped = copy.deepcopy(prof)
    for m in stripped.modules.values():
        m.selective_kept_bytes = m.selective_forward_bytes = m.selective_replay_seconds = None
    return stripped


class CPUMeter(Callback):
    """CPU seconds of this process per training batch (``time.process_time``): what the step's own code costs, which
    load from other processes on a shared machine changes far less than the wall time (a blocked collective waits
    without spending any)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.process_time()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.process_time() - self._t0)


def train(plan: Plan, args: argparse.Namespace) -> tuple[float, int, float]:
    """Median step seconds (wall) after the warm-up, the peak live bytes and the median CPU seconds per step, each the
    largest over ranks."""
    meter, cpu = Meter(memory_steps=args.memory_steps), CPUMeter()
    fit_briefly(make_model(args), OSDPStrategy(plan=plan), args, [meter, cpu])
    figures = torch.tensor(
        [
            statistics.median(meter.times[args.warmup :]),
            float(max(meter.peaks)),
            statistics.median(cpu.times[args.warmup :]),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return float(figures[0]), int(figures[1]), float(figures[2])


def uses_selective(plan: Plan) -> bool:
    return any(d.recompute == "selective" for d in plan.decisions.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--budgets", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--headroom", type=float, default=0.02, help="the planner's memory headroom")
    parser.add_argument("--out", type=Path)
    parser.set_defaults(width=192, depth=4, heads=4, context=256, batch=8, steps=10, warmup=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = torch.stack([RandomTokens(args.batch, args.context)[i] for i in range(args.batch)])
    prof = profile(make_model(args), batch)
    stripped = without_selective(prof)
    ddp_need = predict(prof, Plan.uniform(make_model(args), "no_shard"), world).peak_bytes
    low = minimum_budget(prof, world)
    # Budgets as a user gives them: the planner plans against (1 - headroom) of each, as OSDPStrategy does.
    planned = [int(low + (ddp_need - low) * i / (args.budgets - 1)) for i in range(args.budgets)]
    budgets = [int(p / (1 - args.headroom)) + 1 for p in planned]
    # Per budget, the plan with every option and the best plan without selective recomputation.
    cases: dict[str, Plan] = {}
    rows: list[dict[str, Any]] = []
    for i, (budget, target) in enumerate(zip(budgets, planned, strict=True)):
        with_it, without_it = solve(prof, target, world), solve(stripped, target, world)
        cases[f"b{i}"] = with_it
        row: dict[str, Any] = {"budget": budget, "plan": with_it.summary(), "case": f"b{i}"}
        if uses_selective(with_it):
            cases[f"b{i}-without"] = without_it
            row["without"] = without_it.summary()
            row["predicted_step"] = with_it.report.predicted_step_seconds if with_it.report else None
            row["predicted_step_without"] = without_it.report.predicted_step_seconds if without_it.report else None
        rows.append(row)
    cases["A/A"] = cases["b0"]
    names = list(cases)
    measured: dict[str, list[tuple[float, int, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            measured[name].append(train(cases[name], args))
        if rank == 0:
            print(
                f"round {r}: "
                + ", ".join(
                    f"{n} {measured[n][-1][0] * 1e3:.0f} ms ({measured[n][-1][2] * 1e3:.0f} CPU)" for n in names
                ),
                flush=True,
            )

    def ratios(a: str, b: str, field: int = 0) -> tuple[float, float, float, float]:
        ta, tb = [m[field] for m in measured[a]], [m[field] for m in measured[b]]
        per_round = [x / y for x, y in zip(ta, tb, strict=True)]
        return min(ta) / min(tb), statistics.median(ta) / statistics.median(tb), min(per_round), max(per_round)

    for row in rows:
        name = row["case"]
        row["predicted_peak"] = predict(prof, cases[name], world).peak_bytes
        row["measured_peak"] = max(m[1] for m in measured[name])
        row["fits"] = row["measured_peak"] <= row["budget"]
        row["step_fastest"] = min(m[0] for m in measured[name])
        row["step_median"] = statistics.median(m[0] for m in measured[name])
        row["cpu_fastest"] = min(m[2] for m in measured[name])
        row["cpu_median"] = statistics.median(m[2] for m in measured[name])
        if "without" in row:
            fastest, median, lo, hi = ratios(name, f"{name}-without")
            row.update(speedup_fastest=1 / fastest, speedup_median=1 / median, per_round=(1 / hi, 1 / lo))
            fastest, median, lo, hi = ratios(name, f"{name}-without", 2)
            row.update(cpu_speedup_fastest=1 / fastest, cpu_speedup_median=1 / median, cpu_per_round=(1 / hi, 1 / lo))
    aa_fastest, aa_median, aa_lo, aa_hi = ratios("A/A", "b0")
    cpu_aa = ratios("A/A", "b0", 2)
    if rank == 0:
        print(
            f"\nGPT width {args.width}, depth {args.depth}, context {args.context}, batch {args.batch}, {world} ranks"
        )
        print(f"minimum budget {format_bytes(low)}, DDP's need {format_bytes(ddp_need)}")
        print(f"{'budget':>10} {'pred':>10} {'meas':>10} {'ratio':>6} fits  step ms (fastest/median)  CPU ms  plan")
        for row in rows:
            print(
                f"{format_bytes(row['budget']):>10} {format_bytes(row['predicted_peak']):>10} "
                f"{format_bytes(row['measured_peak']):>10} {row['predicted_peak'] / row['measured_peak']:>6.3f} "
                f"{'yes' if row['fits'] else 'NO':>4}  "
                f"{row['step_fastest'] * 1e3:7.1f} / {row['step_median'] * 1e3:7.1f}  "
                f"{row['cpu_fastest'] * 1e3:5.0f} / {row['cpu_median'] * 1e3:5.0f}  {row['plan']}"
            )
            if "without" in row:
                lo, hi = row["per_round"]
                print(
                    f"{'':>10} with selective vs without ({row['without']}): {row['speedup_fastest']:.3f}x fastest, "
                    f"{row['speedup_median']:.3f}x median (rounds {lo:.3f}-{hi:.3f}); predicted "
                    f"{row['predicted_step_without'] / row['predicted_step']:.3f}x; CPU time "
                    f"{row['cpu_speedup_fastest']:.3f}x fastest, {row['cpu_speedup_median']:.3f}x median (rounds "
                    f"{row['cpu_per_round'][0]:.3f}-{row['cpu_per_round'][1]:.3f})"
                )
        print(
            f"A/A (b0 against itself): {1 / aa_fastest:.3f}x fastest, {1 / aa_median:.3f}x median "
            f"(rounds {1 / aa_hi:.3f}-{1 / aa_lo:.3f}); CPU time {1 / cpu_aa[0]:.3f}x fastest, {1 / cpu_aa[1]:.3f}x "
            f"median (rounds {1 / cpu_aa[3]:.3f}-{1 / cpu_aa[2]:.3f})"
        )
        if args.out:
            aa = {
                "fastest": 1 / aa_fastest,
                "median": 1 / aa_median,
                "rounds": (1 / aa_hi, 1 / aa_lo),
                "cpu": {"fastest": 1 / cpu_aa[0], "median": 1 / cpu_aa[1], "rounds": (1 / cpu_aa[3], 1 / cpu_aa[2])},
            }
            args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows, "aa": aa}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
