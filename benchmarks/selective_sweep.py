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
per-round ratios. ``--out`` writes it all as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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


def train(plan: Plan, args: argparse.Namespace) -> tuple[float, int]:
    """Median step seconds after the warm-up and the peak live bytes, each the largest over ranks."""
    meter = Meter(memory_steps=args.memory_steps)
    fit_briefly(make_model(args), OSDPStrategy(plan=plan), args, [meter])
    figures = torch.tensor([statistics.median(meter.times[args.warmup :]), float(max(meter.peaks))])
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return float(figures[0]), int(figures[1])


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
    measured: dict[str, list[tuple[float, int]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            measured[name].append(train(cases[name], args))
        if rank == 0:
            print(f"round {r}: " + ", ".join(f"{n} {measured[n][-1][0] * 1e3:.0f} ms" for n in names), flush=True)

    def ratios(a: str, b: str) -> tuple[float, float, float, float]:
        ta, tb = [t for t, _ in measured[a]], [t for t, _ in measured[b]]
        per_round = [x / y for x, y in zip(ta, tb, strict=True)]
        return min(ta) / min(tb), statistics.median(ta) / statistics.median(tb), min(per_round), max(per_round)

    for row in rows:
        name = row["case"]
        row["predicted_peak"] = predict(prof, cases[name], world).peak_bytes
        row["measured_peak"] = max(p for _, p in measured[name])
        row["fits"] = row["measured_peak"] <= row["budget"]
        row["step_fastest"] = min(t for t, _ in measured[name])
        row["step_median"] = statistics.median(t for t, _ in measured[name])
        if "without" in row:
            fastest, median, lo, hi = ratios(name, f"{name}-without")
            row.update(speedup_fastest=1 / fastest, speedup_median=1 / median, per_round=(1 / hi, 1 / lo))
    aa_fastest, aa_median, aa_lo, aa_hi = ratios("A/A", "b0")
    if rank == 0:
        print(
            f"\nGPT width {args.width}, depth {args.depth}, context {args.context}, batch {args.batch}, {world} ranks"
        )
        print(f"minimum budget {format_bytes(low)}, DDP's need {format_bytes(ddp_need)}")
        print(f"{'budget':>10} {'pred':>10} {'meas':>10} {'ratio':>6} fits  step ms (fastest/median)  plan")
        for row in rows:
            print(
                f"{format_bytes(row['budget']):>10} {format_bytes(row['predicted_peak']):>10} "
                f"{format_bytes(row['measured_peak']):>10} {row['predicted_peak'] / row['measured_peak']:>6.3f} "
                f"{'yes' if row['fits'] else 'NO':>4}  "
                f"{row['step_fastest'] * 1e3:7.1f} / {row['step_median'] * 1e3:7.1f}"
                f"  {row['plan']}"
            )
            if "without" in row:
                lo, hi = row["per_round"]
                print(
                    f"{'':>10} with selective vs without ({row['without']}): {row['speedup_fastest']:.3f}x fastest, "
                    f"{row['speedup_median']:.3f}x median (rounds {lo:.3f}-{hi:.3f}); predicted "
                    f"{row['predicted_step_without'] / row['predicted_step']:.3f}x"
                )
        print(
            f"A/A (b0 against itself): {1 / aa_fastest:.3f}x fastest, {1 / aa_median:.3f}x median "
            f"(rounds {1 / aa_hi:.3f}-{1 / aa_lo:.3f})"
        )
        if args.out:
            aa = {"fastest": 1 / aa_fastest, "median": 1 / aa_median, "rounds": (1 / aa_hi, 1 / aa_lo)}
            args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows, "aa": aa}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
