"""Record the solver's plans and the cost model's figures on a fixed set of profiles, and compare two records.

A refactoring of the cost model or the solver must not change a plan or a predicted byte. Record on the old code,
record on the new, compare::

    python benchmarks/plan_fingerprint.py profile DIR          # once: profiles of the example GPT and Mixer
    python benchmarks/plan_fingerprint.py record OLD.json --profiles DIR [--big]
    ... change the code ...
    python benchmarks/plan_fingerprint.py record NEW.json --profiles DIR [--big]
    python benchmarks/plan_fingerprint.py compare OLD.json NEW.json

(To record the old code from another checkout: ``PYTHONPATH=/path/to/old/checkout python ...``.) A record holds,
per case (synthetic GPTs of ``tests/synthetic.py`` at several depths, widths, world sizes, tied and untied heads,
both all-gather release settings, restricted modes and splits; the saved example profiles at 2 and 4 ranks;
``--big``: 300 and 2,000 planning units): ``minimum_budget``, and for budgets from the minimum to the all-DDP peak
(and one byte under the minimum) the plan's decisions and ``plan.info`` (timings aside) or the infeasibility
message; for the solved plans and four hand plans, ``predict``'s summary, per-unit figures and every instant.
``compare`` prints the cases that differ and the seconds each took before and after, and exits 1 on a difference.
The example profiles are measured, hence noisy: make them once and record both sides on the same files.
Solves stop on node limits, so the plans do not depend on the machine's load; one that hits the wall-clock safety
net says "time limit" in its status, and may: compare on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_osdp.cost_model import CostModelConfig, predict
from lightning_osdp.plan import Decision, Plan
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.solver import InfeasibleBudgetError, PlanningProblem, SolverError, minimum_budget, solve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the synthetic profiles are a test fixture
from synthetic import gloo_like_collectives, gpt_profile

TIMINGS = {"solve_seconds", "cbc_seconds", "solver_seconds", "seconds", "minimum_seconds"}
EXAMPLES = ("gpt_d4_w64.json", "gpt_d8_w128.json", "mixer.json")


def prediction_record(profile: ModelProfile, plan: Plan, ws: int, config: CostModelConfig | None) -> dict[str, Any]:
    p = predict(profile, plan, ws, config=config)
    units = [
        [u.name, list(u.modules), u.mode, u.split, u.param_count, u.kept.as_dict(), u.gathered, repr(u.time)]
        for u in p.units
    ]
    return {"summary": p.to_dict(), "instants": [list(i) for i in p.instants], "units": units}


def hand_plans(problem: PlanningProblem) -> dict[str, Plan]:
    """Every mode everywhere, and a mix with splits (a plan the solver may never choose)."""
    segments = [s.entry for s in problem.candidates.segments]
    holders = [h for g in problem.candidates.tie_groups for h in g]
    plans = {f"uniform {m}": Plan({"": m, **dict.fromkeys(segments + holders, m)}) for m in ("no_shard", "full_shard")}
    plans["uniform shard_grad_op"] = Plan({"": "shard_grad_op", **dict.fromkeys(segments + holders, "shard_grad_op")})
    mixed: dict[str, Decision] = {"": Decision("full_shard")}
    for i, s in enumerate(segments):
        mixed[s] = Decision(("no_shard", "full_shard", "shard_grad_op")[i % 3])
    for candidate in problem.candidates.segments[::2]:
        inner = [n for n in candidate.inner if problem.info.splittable(n)]
        if inner:
            mixed[inner[0]] = Decision("full_shard", split=2)
    plans["mixed"] = Plan(mixed)
    return plans


def run_case(
    name: str,
    profile: ModelProfile,
    ws: int,
    *,
    config: CostModelConfig | None = None,
    modes: tuple[str, ...] | None = None,
    splits: tuple[int, ...] = (1, 2, 4, 8),
    detailed: bool = True,
    solver: str = "highs",
) -> dict[str, Any]:
    kw: dict[str, Any] = {"splits": splits, "config": config, **({"modes": modes} if modes else {})}
    # Only a solver other than the default is named, so that this script also records code that predates the choice.
    chosen = {} if solver == "highs" else {"solver": solver}
    started = time.perf_counter()
    low = minimum_budget(profile, ws, **kw, **chosen)
    record: dict[str, Any] = {"name": name, "minimum_budget": low, "minimum_seconds": time.perf_counter() - started}
    problem = PlanningProblem(profile, ws, **kw)
    plans = hand_plans(problem)
    high = predict(profile, plans["uniform no_shard"], ws, config=config).peak_bytes
    budgets = [int(low + (high - low) * f) for f in (0.1, 0.3, 0.5, 0.7, 0.9)]
    if detailed:
        budgets += [low, high, low - 1]
    record["solves"] = [solve_record(profile, ws, b, {**kw, **chosen}, detailed) for b in budgets]
    if detailed:
        record["hand"] = {k: prediction_record(profile, p, ws, config) for k, p in plans.items()}
    return record


def solve_record(profile: ModelProfile, ws: int, budget: int, kw: dict[str, Any], detailed: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"budget": budget}
    started = time.perf_counter()
    try:
        plan = solve(profile, budget, ws, **kw)
    except InfeasibleBudgetError as e:
        entry["infeasible"] = [str(e), e.minimum, e.consumers]
    except SolverError as e:  # no plan within the limits: recorded, and the record goes on
        entry["solver_error"] = str(e).split(" within ")[0]
    else:
        entry["decisions"] = plan.to_dict()["decisions"]
        entry["info"] = {k: v for k, v in plan.info.items() if k not in TIMINGS}
        if detailed:
            entry["prediction"] = prediction_record(profile, plan, ws, kw["config"])
    entry["seconds"] = time.perf_counter() - started
    return entry


def cases(profiles: Path | None, big: bool, solver: str = "highs") -> Iterator[dict[str, Any]]:
    for case in _cases(profiles, big):
        name, profile, ws, kw = case
        yield run_case(name, profile, ws, solver=solver, **kw)


def _cases(profiles: Path | None, big: bool) -> Iterator[tuple[str, ModelProfile, int, dict[str, Any]]]:
    shapes = ((2, 64, 2, True), (4, 128, 2, False), (10, 64, 2, True), (6, 64, 4, True), (24, 128, 8, True))
    for depth, width, ws, tied in (*shapes, (12, 256, 2, False)):
        profile = gpt_profile(depth=depth, width=width, world_size=ws, tied=tied, tokens=256)
        for release in (None, False, True):
            config = None if release is None else CostModelConfig(release_all_gather_after_forward=release)
            yield f"gpt d{depth} w{width} ws{ws} tied={tied} release={release}", profile, ws, {"config": config}
    profile = gpt_profile(depth=6, width=64)
    yield "gpt d6 full_shard/no_shard", profile, 2, {"modes": ("full_shard", "no_shard")}
    yield "gpt d6 shard_grad_op/no_shard", profile, 2, {"modes": ("shard_grad_op", "no_shard"), "splits": (1, 2)}
    yield "gpt d6 no split", profile, 2, {"splits": (1,)}
    for name in EXAMPLES if profiles else ():
        assert profiles is not None
        for ws in (2, 4):
            yield f"{name} ws{ws}", ModelProfile.load(profiles / name), ws, {}
    for units in (300, 2000) if big else ():
        profile = gpt_profile(depth=max((units - 2) // 4, 1), width=256, tokens=256)
        yield f"{units} planning units", profile, 2, {"detailed": False}


def make_profiles(out: Path) -> None:
    """Profile the example GPT (two sizes) and MLP-Mixer once, on this machine (measured figures)."""
    import torch

    root = Path(__file__).resolve().parents[1] / "examples"
    sys.path[:0] = [str(root / "gpt"), str(root / "mixer")]
    from lightning_osdp import profile

    from gpt import GPTModule
    from mixer import MixerModule

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    fits = gloo_like_collectives(2)
    batches: list[tuple[str, Any, Any]] = [
        (EXAMPLES[0], GPTModule(depth=4, width=64), torch.randint(0, 256, (2, 65))),
        (EXAMPLES[1], GPTModule(depth=8, width=128, heads=4), torch.randint(0, 256, (2, 65))),
        (EXAMPLES[2], MixerModule(), (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))),
    ]
    for name, module, batch in batches:
        profile(module, batch, optimizer=torch.optim.AdamW, collectives=fits, repeats=1).save(out / name)
        print(f"wrote {out / name}")


def strip_timings(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: strip_timings(v) for k, v in x.items() if k not in TIMINGS}
    if isinstance(x, list):
        return [strip_timings(v) for v in x]
    return x


def compare(old_path: Path, new_path: Path) -> int:
    old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
    if [r["name"] for r in old] != [r["name"] for r in new]:
        print("the records hold different cases")
        return 1
    differ = 0
    for a, b in zip(old, new, strict=True):
        same = strip_timings(a) == strip_timings(b)
        differ += not same
        seconds = [r["minimum_seconds"] + sum(s["seconds"] for s in r["solves"]) for r in (a, b)]
        print(f"{'same   ' if same else 'DIFFERS'} {a['name']}: {seconds[0]:.2f} s -> {seconds[1]:.2f} s")
        if not same:
            _print_changes(a, b)
    solves = sum(len(r["solves"]) for r in old)
    hand = sum(len(r.get("hand", {})) for r in old)
    print(f"{len(old)} cases, {solves} solves, {hand} hand-plan predictions: {differ} cases differ")
    return 1 if differ else 0


def _print_changes(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Per solve of a case that differs: the plan's predicted step time before and after (a different plan of the
    same step time within the gap is an equally good optimum), or what else changed."""
    if a["minimum_budget"] != b["minimum_budget"]:
        print(f"    minimum budget {a['minimum_budget']} -> {b['minimum_budget']}")
    for x, y in zip(a["solves"], b["solves"], strict=True):
        if strip_timings(x) == strip_timings(y):
            continue
        if "info" in x and "info" in y:
            t0, t1 = x["info"]["predicted_step_seconds"], y["info"]["predicted_step_seconds"]
            what = "same plan, other report" if x["decisions"] == y["decisions"] else "other plan"
            print(
                f"    budget {x['budget']}: {what}: step {t0 * 1e3:.4f} -> {t1 * 1e3:.4f} ms ({(t1 / t0 - 1):+.2e}), "
                f"{x['info']['status']} -> {y['info']['status']}"
            )
        else:
            print(f"    budget {x['budget']}: {_outcome(x)} -> {_outcome(y)}")


def _outcome(entry: dict[str, Any]) -> str:
    return next((k for k in ("infeasible", "solver_error") if k in entry), "solved")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("profile").add_argument("dir", type=Path)
    record = sub.add_parser("record")
    record.add_argument("out", type=Path)
    record.add_argument("--profiles", type=Path, help="directory written by the `profile` command")
    record.add_argument("--big", action="store_true", help="add 300 and 2,000 planning units")
    record.add_argument("--solver", default="highs", choices=("highs",), help="the ILP's solver")
    diff = sub.add_parser("compare")
    diff.add_argument("old", type=Path)
    diff.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.command == "profile":
        make_profiles(args.dir)
    elif args.command == "record":
        records = []
        for r in cases(args.profiles, args.big, args.solver):
            print(f"{r['name']}: {r['minimum_seconds'] + sum(s['seconds'] for s in r['solves']):.2f} s", flush=True)
            records.append(r)
        args.out.write_text(json.dumps(records, indent=1))
    else:
        sys.exit(compare(args.old, args.new))


if __name__ == "__main__":
    main()
