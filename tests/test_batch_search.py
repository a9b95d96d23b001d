"""The largest-batch search of ``osdp plan``: the answer a scan of every batch size gives, in fewer probes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from collections.abc import Callable

import pytest

from lightning_osdp.cli.batch_search import Probe, largest_batch
from lightning_osdp.cli.estimate import BatchScaledProfile
from lightning_osdp.cli.output import Output
from lightning_osdp.cli.parsers import add_plan_parser
from lightning_osdp.cli.plan import DryRun, _fits_osdp, _fits_plan, _profiles, resolve
from lightning_osdp.cost_model import predict
from lightning_osdp.cost_model.units import SHARDED_MODES
from lightning_osdp.plan import Plan
from lightning_osdp.profiling import ModelProfile
from lightning_osdp.solver import InfeasibleBudgetError, PlanningProblem
from lightning_osdp.solver.reuse import reusing_problems

from conftest import ROOT

GPT_FILE = ROOT / "examples" / "gpt" / "gpt.py"


def _doubling_then_halving(fits: list[bool], limit: int) -> int:
    """How many probes the plain search (doubling from 1, then halving the bracket) makes."""
    calls, low, high = 1, 1, 2
    if not fits[1]:
        return calls
    while high <= limit and (calls := calls + 1) and fits[high]:
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:
        calls += 1
        mid = (low + high) // 2
        low, high = (mid, high) if fits[mid] else (low, mid)
    return calls


def _probe(answer: int, limit: int, peak: Callable[[int], float], made: list[int]) -> Callable[[int], Probe]:
    """A probe that fits up to ``answer``, reports ``peak(b)`` and records the sizes it is asked about."""

    def probe(b: int) -> Probe:
        assert 1 <= b <= limit and b not in made
        made.append(b)
        return Probe(b <= answer, peak(b))

    return probe


@pytest.mark.parametrize("peaks", ["affine", "noisy", "adversarial", "unknown"])
def test_the_search_answers_what_a_scan_answers_whatever_the_peaks_say(peaks: str) -> None:
    """The peaks only choose the probes: with peaks that lie (random, or none) the answer is the scan's still, and
    no probe is made twice or outside [1, limit]. With affine peaks (a profile's figures are affine in the batch) the
    search needs at most five probes, and never more than doubling and halving would."""
    rng = random.Random(32)
    for _ in range(300):
        limit = rng.choice([1, 3, 100, 1 << 16])
        answer = min(rng.choice([0, 1, rng.randint(0, 60), rng.randint(0, 5000)]), limit)
        base, slope = rng.uniform(0, 100), rng.uniform(0.01, 10)
        budget = base + slope * (answer + 0.5)
        peak = {
            "affine": lambda b, base=base, slope=slope: base + slope * b,
            "noisy": lambda b, base=base, slope=slope: base + slope * (b + rng.uniform(-3, 3)),
            "adversarial": lambda b: rng.uniform(-1e3, 1e3),
            "unknown": lambda b: math.nan,
        }[peaks]
        made: list[int] = []
        assert largest_batch(_probe(answer, limit, peak, made), budget, limit=limit) == answer
        plain = _doubling_then_halving([b <= answer for b in range(limit + 2)], limit)
        assert len(made) <= 2 * plain + 4, (answer, made)
        if peaks == "affine":
            assert len(made) <= min(plain, 5), (answer, made)


@pytest.fixture(scope="module")
def small_gpt() -> tuple[DryRun, BatchScaledProfile]:
    """A small GPT's dry run on 4 ranks, under a budget that some plan meets up to batch 9 or so (the smallest one
    at batch 9, from the planner itself), and its profiles at any batch size."""
    init = {"width": 64, "depth": 4, "heads": 4, "context_length": 64, "vocab_size": 256}
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    argv = ["plan", "--model", f"{GPT_FILE}:GPTModule", "--init-args", json.dumps(init), "--world-size", "4"]
    argv += ["--hardware", "h100-sxm", "--memory", "1GiB", "--batch-size", "2"]
    out = Output(quiet=True)
    run = resolve(parser.parse_args(argv), out)
    scaled = _profiles(run, out)
    run.budget = run.planner.smallest_budget(scaled.at(9), run.topology)
    return run, scaled


def test_osdp_plans_search_equals_a_scan_of_every_batch_size(small_gpt: tuple[DryRun, BatchScaledProfile]) -> None:
    """On a small GPT, the largest batch OSDP fits (a minimum-memory solve per probe) and the largest a uniform plan
    fits (a prediction per probe) are the scan's, and OSDP's search probes fewer sizes than the scan."""
    run, scaled = small_gpt
    scan = [_fits_osdp(run, scaled)(b).fits for b in range(1, 25)]  # each size from scratch
    osdp_probe = _fits_osdp(run, scaled)
    assert scan[0] and not scan[-1]
    expected = max(b for b, fits in enumerate(scan, 1) if fits)
    assert all(scan[:expected]) and not any(scan[expected:]), scan  # what the search relies on
    made: list[int] = []

    def counted(b: int) -> Probe:
        made.append(b)
        return osdp_probe(b)

    assert largest_batch(counted, run.budget) == expected >= 9
    assert len(made) < expected
    fsdp = Plan.uniform(run.model, "full_shard")
    plan_probe = _fits_plan(run, scaled, fsdp, {})
    plan_scan = [plan_probe(b).fits for b in range(1, 41)]
    assert largest_batch(plan_probe, run.planned_budget) == sum(plan_scan) > 0


def test_a_probe_answered_by_a_plan_held_from_an_earlier_one_answers_as_a_solve_from_scratch(
    small_gpt: tuple[DryRun, BatchScaledProfile],
) -> None:
    """OSDP's probe predicts the plans that fitted earlier probes before it solves ([Note: what one probe tells the
    next]): at every size of a scan, up and down, its answer is that of a probe with nothing held, and held plans
    answered some of them."""
    run, scaled = small_gpt
    carried = _fits_osdp(run, scaled)
    sizes = [*range(1, 25), *range(24, 0, -3)]
    for b in sizes:
        fresh = _fits_osdp(run, scaled)(b)
        held = carried(b)
        assert held.fits == fresh.fits, b
        if held.fits:
            assert held.peak <= run.budget
        else:
            assert held.peak == fresh.peak  # solved, as from scratch
    assert carried.answered_by_held > 0 and carried.solved + carried.answered_by_held == len(sizes)
    assert all(d.mode in SHARDED_MODES for plan in carried.held for d in plan.decisions.values())


def test_a_problem_reused_within_the_scope_gives_the_plan_solved_from_scratch(
    small_gpt: tuple[DryRun, BatchScaledProfile],
) -> None:
    """Within ``reusing_problems`` a second problem of the same profile and options takes the first one's state, and
    the plans solved through it (at several batch sizes, budgets and for the least memory) are those solved from
    scratch; another batch size (another profile) is another problem."""
    run, scaled = small_gpt
    sizes, budgets = (1, 5, 9), (run.budget, int(run.budget * 0.9))
    scratch = {(b, m): _solved(run, scaled.at(b), m) for b in sizes for m in budgets}
    smallest = {b: run.planner.smallest_plan(scaled.at(b), run.topology) for b in sizes}
    with reusing_problems():
        first = PlanningProblem(scaled.at(1), run.topology)
        assert PlanningProblem(scaled.at(1), run.topology).spec is first.spec
        assert PlanningProblem(scaled.at(5), run.topology).spec is not first.spec
        for _ in range(2):
            for b in sizes:
                for m in budgets:
                    assert _solved(run, scaled.at(b), m) == scratch[(b, m)], (b, m)
                plan, budget = run.planner.smallest_plan(scaled.at(b), run.topology)
                assert (plan.decisions, budget) == (smallest[b][0].decisions, smallest[b][1])
    assert PlanningProblem(scaled.at(1), run.topology).spec is not first.spec  # nothing kept outside the scope


def _solved(run: DryRun, profile: ModelProfile, budget: int) -> tuple[object, ...]:
    """The plan for ``budget`` and what its report says (its solve's seconds apart)."""
    try:
        plan = run.planner.plan(profile, budget, run.topology)
    except InfeasibleBudgetError as err:
        return ("infeasible", err.minimum)
    assert plan.report is not None
    report = dataclasses.replace(plan.report, solve_seconds=0.0, solver_seconds=0.0)
    return plan.decisions, report


def test_on_a_gpu_osdp_s_largest_batch_is_where_a_plan_also_fits_the_card(
    small_gpt: tuple[DryRun, BatchScaledProfile],
) -> None:
    """With a card, OSDP's probe asks that a plan fit it as well (its device total: the allocator's fragmentation,
    NCCL's buffers, the CUDA context); the search finds the scan's largest batch, smaller than the budget alone
    allows, and the plan the run would take there fits the card."""
    from lightning_osdp.cli.batch_search import AnyPlanFits
    from lightning_osdp.cost_model.device_memory import plan_device_memory

    run, scaled = small_gpt

    def device_total(plan: Plan, b: int) -> int:
        return plan_device_memory(predict(scaled.at(b), plan, run.topology), plan, run.topology).device_total

    card = device_total(run.planner.plan(scaled.at(5), run.budget, run.topology), 5)
    scan = [AnyPlanFits(run.planner, run.topology, run.budget, scaled.at, card)(b).fits for b in range(1, 25)]
    expected = max(b for b, fits in enumerate(scan, 1) if fits)
    assert all(scan[:expected]) and not any(scan[expected:]), scan
    assert 5 <= expected < largest_batch(_fits_osdp(run, scaled), run.budget)
    assert largest_batch(AnyPlanFits(run.planner, run.topology, run.budget, scaled.at, card), run.budget) == expected
    plan = run.planner.plan(scaled.at(expected), run.budget, run.topology, card_bytes=card)
    assert device_total(plan, expected) <= card
