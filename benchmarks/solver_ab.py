"""Planning time of two versions of the solver (or two gaps) on the planning benchmark's profiles, interleaved.

Run ``python benchmarks/solver_ab.py --trees OLD_TREE . [--gaps 1e-3 1e-2] [--rounds 2]``, where each tree is a
checkout of this repository (``git worktree add /tmp/base <commit>`` gives the old one). For each size of
``benchmarks/solver_speed.py`` (297 and 1,997 planning units) and each of its five budgets (10-90% of the way from
the smallest feasible peak to the all-``no_shard`` peak, the smallest taken from the first tree), every case (tree x
gap) solves once per round in a fresh process, the cases in turn within a round, so that all of them see the same load.
Prints, per budget and case, the fastest and the median wall time of the solve, their spread (the case against
itself across rounds), the plan's predicted step time and the solver's status.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_ONE = """
import json, sys, time
sys.path.insert(0, {tests!r}); sys.path.insert(0, {benchmarks!r})
from lightning_osdp.cost_model import predict
from lightning_osdp.plan import Plan
from lightning_osdp.solver import PlanningProblem, minimum_budget, solve
from synthetic import gpt_profile
from solver_speed import depth_for
units, fraction, gap, low = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
profile = gpt_profile(depth=depth_for(units), width=256, tokens=256)
if low < 0:
    print(json.dumps({{"low": minimum_budget(profile, 2)}}))
    raise SystemExit
blocks = [s.entry for s in PlanningProblem(profile, 2).candidates.segments]
high = predict(profile, Plan({{"": "no_shard", **{{b: "no_shard" for b in blocks}}}})).peak_bytes
started = time.perf_counter()
plan = solve(profile, int(low + (high - low) * fraction), 2, gap=gap)
wall = time.perf_counter() - started
print(json.dumps({{"wall": wall, "step": plan.report.predicted_step_seconds * 1e3, "status": plan.report.status}}))
"""


def _run(tree: Path, *args: object) -> dict[str, object]:
    here = Path(__file__).resolve().parents[1]
    code = _ONE.format(tests=str(here / "tests"), benchmarks=str(here / "benchmarks"))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True, cwd=tree, check=True
    )
    return dict(json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    parser.add_argument("--gaps", type=float, nargs="+", default=[1e-3])
    parser.add_argument("--units", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cases = [(tree.resolve(), gap) for tree in args.trees for gap in args.gaps]
    header = f"{'units':>6}{'budget':>8}  {'case':<40}{'fastest s':>10}{'median s':>10}{'spread s':>10}{'step ms':>12}"
    print(header + "  status")
    for units in args.units:
        low = int(_run(cases[0][0], units, 0, 0, -1)["low"])  # type: ignore[call-overload]
        for fraction in args.budgets:
            results: dict[tuple[Path, float], list[dict[str, object]]] = {case: [] for case in cases}
            for _ in range(args.rounds):
                for tree, gap in cases:
                    results[(tree, gap)].append(_run(tree, units, fraction, gap, low))
            for (tree, gap), runs in results.items():
                walls = [float(r["wall"]) for r in runs]  # type: ignore[arg-type]
                steps = sorted({round(float(r["step"]), 3) for r in runs})  # type: ignore[arg-type]
                label = f"{tree.name} gap {gap:g}"
                print(
                    f"{units:>6}{fraction:>8.0%}  {label:<40}{min(walls):>10.2f}{statistics.median(walls):>10.2f}"
                    # a space before the step times: a case whose rounds found plans of different step times lists
                    # them all, wider than the column
                    f"{max(walls) - min(walls):>10.2f} {'/'.join(f'{s:.3f}' for s in steps):>11}  {runs[0]['status']}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
