"""Planning time of the OSDP solver on GPT-shaped profiles of 300 and 2,000 planning units.

Run ``python benchmarks/solver_speed.py [--units 300 2000] [--repeats 1]``. A planning unit is what the solver
decides for (``lightning_osdp.solver.Candidates.count``): a block, each of its large Linears (split candidates),
the tied embedding/head group and the root. The profile is synthetic (``tests/synthetic.py``'s ``gpt_profile``: 4
units per block). For each size, ``solve`` runs at budgets 10%, 30%, 50%, 70% and 90% of the way from the
smallest feasible peak to the all-``no_shard`` peak (default solver settings: gap 1e-3, time limit 10 s). Prints,
per budget, the time to build the problem (segment simulations, option pruning, timeline), the solver's time
(LP, rounding, branch and bound), the total and the solver's status. Targets (issue 4): under 1 s for 300 units,
under 10 s for 2,000.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the synthetic profiles are a test fixture

from lightning_osdp.cost_model import predict
from lightning_osdp.plan import Plan
from lightning_osdp.solver import PlanningProblem, minimum_budget, solve

from synthetic import gpt_profile


def depth_for(units: int) -> int:
    """Blocks giving about ``units`` planning units (4 per block, plus the tied group and the root)."""
    return max((units - 2) // 4, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--units", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    rows = []
    for target in args.units:
        prof = gpt_profile(depth=depth_for(target), width=args.width, tokens=256)
        problem = PlanningProblem(prof, 2, splits=(1, 2, 4, 8))
        count = problem.candidates.count
        blocks = [s.entry for s in problem.candidates.segments]
        started = time.perf_counter()
        low = minimum_budget(prof, 2)
        min_seconds = time.perf_counter() - started
        high = predict(prof, Plan({"": "no_shard", **{b: "no_shard" for b in blocks}})).peak_bytes
        rows.append((count, problem.option_count, "minimum", min_seconds, "", ""))
        for frac in args.budgets:
            budget = int(low + (high - low) * frac)
            started = time.perf_counter()
            plan = solve(prof, budget, 2)
            total = time.perf_counter() - started
            assert plan.report is not None
            rows.append((count, problem.option_count, f"{frac:.0%}", total, plan.report.status, plan.summary()))
        times = [r[3] for r in rows if r[0] == count and r[2] != "minimum"]
        print(f"{count} units: median {statistics.median(times):.2f} s, max {max(times):.2f} s", flush=True)
    print(f"\n{'units':>6}{'options':>9}{'budget':>9}{'seconds':>9}  status; plan")
    for count, options, budget_label, seconds, status, summary in rows:
        print(f"{count:>6}{options:>9}{budget_label:>9}{seconds:>9.2f}  {status}; {summary}")


if __name__ == "__main__":
    main()
