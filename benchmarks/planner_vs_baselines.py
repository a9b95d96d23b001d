"""OSDP's planner against the baselines it mixes, across memory budgets, in one run.

Run: ``python -m torch.distributed.run --nproc-per-node 2 benchmarks/planner_vs_baselines.py [--width ...]``.

1. Measures the baselines once: Lightning's DDP strategy, and FSDP2 applied per block by Lightning's
   ModelParallelStrategy with FULL_SHARD and SHARD_GRAD_OP (peak memory and throughput; they do not depend on
   the budget).
2. Profiles the model and asks the solver for the smallest budget any plan meets (``minimum_budget``); the
   largest budget swept is DDP's requirement as a budget given to OSDP: DDP's measured peak divided by
   ``1 - memory_headroom`` (the planner keeps that fraction free, so at DDP's bare peak it could not choose DDP).
3. For ``--budgets`` budgets evenly spaced between the two, trains with ``OSDPStrategy(memory_budget=b)``
   (profile, solve, apply, train) and measures it the same way.

Prints, per budget: OSDP's throughput and measured peak (and whether it stayed under the budget), the best
baseline whose measured peak fits the budget, and the ratios to it and to FULL_SHARD. Every figure comes from
the same callback (wall time per training batch, CPU live-storage peak), see ``benchmarks/throughput.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from lightning_osdp import OSDPStrategy, minimum_budget, profile
from lightning_osdp.budget import format_bytes

from gpt import GPTModule
from throughput import RandomTokens, add_model_arguments, run_case


def smallest_budget(args: argparse.Namespace) -> int:
    """The solver's smallest feasible budget for this model, world size and batch."""
    module = GPTModule(
        width=args.width, depth=args.depth, heads=args.heads, context_length=args.context, lr_schedule="constant"
    )
    batch = torch.stack([RandomTokens(args.batch, args.context)[i] for i in range(args.batch)])
    prof = profile(module, batch)
    return minimum_budget(prof, int(os.environ.get("WORLD_SIZE", "1")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("--budgets", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    baselines = {case: run_case(case, args) for case in ("ddp", "fsdp_full", "fsdp_grad_op")}
    headroom = OSDPStrategy().memory_headroom
    low = int(smallest_budget(args) / (1 - headroom)) + 1
    high = int(baselines["ddp"]["peak_bytes"] / (1 - headroom)) + 1
    budgets = [int(low + (high - low) * i / (args.budgets - 1)) for i in range(args.budgets)]
    rows: list[dict[str, Any]] = []
    for budget in budgets:
        osdp = run_case(f"osdp@{budget}", args)
        fitting = {k: v for k, v in baselines.items() if v["peak_bytes"] <= budget}
        best_name = max(fitting, key=lambda k: fitting[k]["samples_per_s"]) if fitting else None
        rows.append(
            {
                "budget": budget,
                "osdp": osdp,
                "best_baseline": best_name,
                "vs_best": osdp["samples_per_s"] / fitting[best_name]["samples_per_s"] if best_name else None,
                "vs_full_shard": osdp["samples_per_s"] / baselines["fsdp_full"]["samples_per_s"],
            }
        )
    if dist.get_rank() != 0:
        return
    print(f"\nmodel: {baselines['ddp']['params'] / 1e6:.2f}M parameters, batch {args.batch} x {args.context} per rank")
    print(f"{'baseline':<14}{'samples/s':>10}{'peak':>12}")
    for name, row in baselines.items():
        print(f"{name:<14}{row['samples_per_s']:>10.1f}{format_bytes(row['peak_bytes']):>12}")
    print(
        f"budgets from the smallest feasible one ({format_bytes(low)}) to DDP's requirement ({format_bytes(high)}: "
        f"its measured peak over 1 - {headroom:.0%} planner headroom)\n"
    )
    print(
        f"{'budget':>11}{'OSDP/s':>9}{'OSDP peak':>12}{'fits':>6}{'best baseline':>15}{'vs best':>9}{'vs FULL':>9}"
        "  plan"
    )
    for r in rows:
        o = r["osdp"]
        vs_best = f"{r['vs_best']:.2f}" if r["vs_best"] is not None else "-"
        print(
            f"{format_bytes(r['budget']):>11}{o['samples_per_s']:>9.1f}{format_bytes(o['peak_bytes']):>12}"
            f"{'yes' if o['peak_bytes'] <= r['budget'] else 'NO':>6}{r['best_baseline'] or 'none fits':>15}"
            f"{vs_best:>9}{r['vs_full_shard']:>9.2f}  {o['plan']}"
        )
    if args.out:
        args.out.write_text(json.dumps({"baselines": baselines, "rows": rows, "smallest": low}, indent=1))


if __name__ == "__main__":
    main()
