"""The count master for runs of identical blocks (``lightning_osdp/solver/runs.py``): its rows are the ILP's, it is a
relaxation of the ILP, and every status a solve through it reports holds against the optimum found by enumeration,
near-ties included."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from lightning_osdp.cost_model.timeline import SegmentChoice
from lightning_osdp.solver import PlanningProblem, ilp, runs
from lightning_osdp.solver.linear import MIB, LinearBackend

from synthetic import gpt_profile


def _problem(depth: int, **kwargs) -> tuple[PlanningProblem, LinearBackend]:
    problem = PlanningProblem(gpt_profile(depth=depth, width=32), 2, **kwargs)
    return problem, problem.build()


def _value(cb: runs.CountBackend, found: list[runs.Run], e: runs.Expr, chosen) -> float:
    total = e.const + sum(v[cb.options[k].index(chosen[k])] for k, v in e.units.items())
    for r, pieces in e.runs.items():
        keys = found[r].keys
        total += sum(v[cb.options[keys[p]].index(chosen[keys[p]])] for s, t, v in pieces for p in range(s, t + 1))
    if e.maximum:
        total += max(_value(cb, found, m, chosen) for m in e.maximum)
    return total


def test_the_count_backend_walks_the_ilps_rows():
    _, be = _problem(8, splits=(1, 2), recompute="auto")
    found = runs.find_runs(be.source)
    assert [len(r.keys) for r in found] == [8]
    cb = runs.count_rows(be.source, be.options, found)
    assert [label for label, _ in cb.rows] == [label for label, _ in be.checkpoints]
    rng = random.Random(0)
    for _ in range(20):
        chosen = {k: rng.choice(v) for k, v in be.options.items()}
        evaluate = be.evaluator(chosen)
        for (_, mine), (_, theirs) in zip(cb.rows, be.checkpoints, strict=True):
            assert _value(cb, found, mine, chosen) == pytest.approx(evaluate(theirs), abs=1e-9)
        assert _value(cb, found, cb.objective, chosen) == pytest.approx(be.step_time(chosen), rel=1e-12)


def _scored(be: LinearBackend) -> list[tuple[float, float]]:
    keys = list(be.options)
    plans = (dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(be.options[k] for k in keys)))
    return [(be.peak(c), be.step_time(c)) for c in plans]


def _claimed(status: str, gap: float) -> float:
    if status == "optimal":
        return 0.0
    if status == f"within gap {gap:g}":
        return gap
    assert "(within gap " in status, status
    return float(status.rsplit("(within gap ", 1)[1][:-1])


def _near_tie(problem: PlanningProblem) -> None:
    """Every block's options 0.05 ms apart in added time, in the order of their memory: near-ties everywhere."""
    for item in problem.spec.items:
        if isinstance(item, SegmentChoice):
            options = item.options
            ordered = sorted(options, key=lambda o: options[o].seconds)
            for j, o in enumerate(ordered[1:], 1):
                options[o] = dataclasses.replace(options[o], seconds=options[ordered[0]].seconds + j * 5e-5)


@pytest.mark.parametrize("near_tie", [False, True])
def test_every_status_through_the_count_master_holds_against_the_enumerated_optimum(monkeypatch, near_tie):
    monkeypatch.setattr(runs, "MIN_RUN", 3)
    problem = PlanningProblem(gpt_profile(depth=5, width=32), 2, modes=("no_shard", "full_shard"), splits=(1,))
    if near_tie:
        _near_tie(problem)
    be = problem.build()
    assert [len(r.keys) for r in runs.find_runs(be.source)] == [5]
    scored = _scored(be)
    low, high = min(p for p, _ in scored), max(p for p, _ in scored)
    proofs = set()
    for gap in (0.0, 1e-3):
        for k in range(-1, 10):
            budget = round(low * MIB) - 1 if k < 0 else int((low + (high - low) * k / 9) * MIB)
            chosen, result = problem.solve_ilp(be, budget=budget, gap=gap, time_limit=60.0)
            fitting = [t for p, t in scored if p <= ilp._rhs(budget)]
            if not fitting:
                assert chosen is None and result.status == "infeasible"
                continue
            assert chosen is not None and be.peak(chosen) <= ilp._rhs(budget)
            value, optimum = be.step_time(chosen), min(fitting)
            assert (value - optimum) / value <= _claimed(result.status, gap) + 1e-9, (result, value, optimum)
            proofs.add(result.bound)
    assert "count master" in proofs  # the path under test proved some of them


@pytest.mark.parametrize(("head", "tail"), [(1, 2), (2, 1), (0, 0)])
def test_the_count_master_is_a_relaxation_of_the_ilp(monkeypatch, head, tail):
    # Its optimum is never above the ILP's (found by enumeration), whatever the ends it keeps as binaries, with the
    # step time or the peak as the objective.
    import pulp

    _, be = _problem(6, modes=("no_shard", "full_shard"), splits=(1,), recompute=False)
    found = runs.find_runs(be.source)
    cb = runs.count_rows(be.source, be.options, found)
    scored = _scored(be)
    low, high = min(p for p, _ in scored), max(p for p, _ in scored)
    master = runs.formulate_master(cb, found, None, head, tail)
    master.prob.solve(pulp.HiGHS(msg=False, gapRel=0))
    assert pulp.value(master.prob.objective) <= low + 1e-6
    for k in range(8):
        rhs = ilp._rhs(int((low + (high - low) * k / 7) * MIB))
        master = runs.formulate_master(cb, found, rhs, head, tail)
        master.prob.solve(ilp._HiGHS(msg=False, gapRel=0))
        assert pulp.value(master.prob.objective) <= min(t for p, t in scored if p <= rhs) + 1e-6
