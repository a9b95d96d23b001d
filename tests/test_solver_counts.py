"""The count master for runs of identical blocks (``lightning_osdp/solver/runs.py``): its rows are the ILP's, it is a
relaxation of the ILP, and every status a solve through it reports holds against the optimum found by enumeration,
near-ties included."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from lightning_osdp.cost_model.timeline import SegmentChoice
from lightning_osdp.solver import PlanningProblem, highs, ilp, runs
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


def _solve(master: runs.Master) -> float:
    import pulp

    master.prob.solve(highs.HiGHS(msg=False, gapRel=0))
    return pulp.value(master.prob.objective)


@pytest.mark.parametrize("cuts", [{1, 4, 5}, {2, 5}, set(), set(range(6))])
@pytest.mark.parametrize("with_families", [False, True])
def test_the_count_master_is_a_relaxation_of_the_ilp(cuts, with_families):
    # Its optimum is never above the ILP's (found by enumeration), whatever the gaps it cuts the run into and the
    # families of rows it bounds, with the step time or the peak as the objective; with every block a gap of its own
    # it is the ILP (every row exact).
    _, be = _problem(6, modes=("no_shard", "full_shard"), splits=(1,), recompute=False)
    found = runs.find_runs(be.source)
    cb = runs.count_rows(be.source, be.options, found)
    families = runs.families(cb, found) if with_families else ()
    scored = _scored(be)
    low, high = min(p for p, _ in scored), max(p for p, _ in scored)
    exact = len(cuts) == 6
    value = _solve(runs.formulate_master(cb, found, None, [cuts], families))
    assert value == pytest.approx(low, abs=1e-6) if exact else value <= low + 1e-6
    for k in range(8):
        rhs = ilp._rhs(int((low + (high - low) * k / 7) * MIB))
        optimum = min(t for p, t in scored if p <= rhs)
        value = _solve(runs.formulate_master(cb, found, rhs, [cuts], families))
        assert value == pytest.approx(optimum, abs=1e-6) if exact else value <= optimum + 1e-6


def test_counts_that_fit_in_no_order_still_give_a_true_status():
    # A budget where the master (the ends and a gap of three blocks) returns counts that no order of the gap meets
    # (every order tried here, not only the solver's): the solve goes on past them, and its status holds against
    # the optimum found by enumeration.
    problem, be = _problem(6, modes=("no_shard", "shard_grad_op"), splits=(1,), recompute="full")
    found = runs.find_runs(be.source, 3)
    cb = runs.count_rows(be.source, be.options, found)
    scored = _scored(be)
    low, high = min(p for p, _ in scored), max(p for p, _ in scored)
    budget = int((low + (high - low) * 6 / 19) * MIB)
    rhs = ilp._rhs(budget)
    master = runs.formulate_master(cb, found, rhs, [{1, 4, 5}])
    _solve(master)
    chosen, counts = master.read(cb)
    run = found[0]
    ends = {
        run.keys[g[0]]: run.options[next(iter(c))]
        for g, c in zip(master.gaps[0], counts[0], strict=True)
        if len(g) == 1
    }
    (inside,) = [(g, c) for g, c in zip(master.gaps[0], counts[0], strict=True) if len(g) > 1]
    blocks = [run.options[i] for i, n in inside[1].items() for _ in range(n)]
    for order in set(itertools.permutations(blocks)):
        plan = {**chosen, **ends, **dict(zip((run.keys[p] for p in inside[0]), order, strict=True))}
        assert be.peak(plan) > rhs
    picked, result = problem.solve_ilp(be, budget=budget, gap=0.0, time_limit=60.0)
    assert picked is not None and be.peak(picked) <= rhs
    assert result.status == "optimal"
    assert be.step_time(picked) == pytest.approx(min(t for p, t in scored if p <= rhs), rel=1e-12)


def test_families_raise_the_count_masters_bound_where_counts_fill_the_end_of_a_run():
    # The 297-unit problem of benchmarks/solver_speed.py at the 10% budget: without the rows of the last block of
    # each option the master's counts put the blocks that keep activations last, where no order fits them; with
    # them its bound rises, and stays under the step time of a plan that fits.
    problem = PlanningProblem(gpt_profile(depth=74, width=256, tokens=256), 2, splits=(1, 2, 4, 8), recompute="auto")
    be = problem.build()
    found = runs.find_runs(be.source)
    cb = runs.count_rows(be.source, be.options, found)
    size = len(found[0].keys)
    low = ilp._minimum(problem, gap=1e-6, time_limit=60.0, solver="highs")[1]
    high = problem.peak_bytes(ilp._all_no_shard(problem, be))
    budget = int(low + (high - low) * 0.1)
    cuts = [{1, size - 2, size - 1}]
    plain = _solve(runs.formulate_master(cb, found, ilp._rhs(budget), cuts))
    raised = _solve(runs.formulate_master(cb, found, ilp._rhs(budget), cuts, runs.families(cb, found)))
    chosen, _ = problem.solve_ilp(be, budget=budget, gap=1e-3, time_limit=60.0)
    assert chosen is not None
    assert plain < raised <= be.step_time(chosen) + 1e-6


@pytest.mark.parametrize("gap", [0.0, 1e-2])
@pytest.mark.parametrize("where", [0, -1])
def test_the_repair_of_an_arrangement_offers_only_plans_that_fit_and_its_status_holds(monkeypatch, gap, where):
    # The repair of the count master's arrangement (``_search_neighbourhood`` with the blocks near the run's ends
    # free) first looks only under the value the bound held proves, and stops at the first plan there; finding none
    # (a gap of 0: the optimum itself is the cutoff), it searches the whole neighbourhood. Started from the optimum
    # (enumerated) with one end block on its hungriest option (a row broken), the optimum as the bound: the plan it
    # offers fits every row of the ILP, and the status it proves holds.
    monkeypatch.setattr(ilp, "_NEIGHBOURHOOD", 2)  # a neighbourhood on a problem small enough to enumerate
    problem, be = _problem(6, modes=("no_shard", "full_shard"), splits=(1,), recompute=False)
    (run,) = runs.find_runs(be.source)
    keys = list(be.options)
    plans = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(be.options[k] for k in keys))]
    scored = [(be.peak(c), be.step_time(c)) for c in plans]
    low, high = min(p for p, _ in scored), max(p for p, _ in scored)
    budget = int((low + (high - low) * 0.1) * MIB)
    rhs = ilp._rhs(budget)
    optimum, best = min((t, i) for i, (p, t) in enumerate(scored) if p <= rhs)
    block = run.keys[where]
    start = {**plans[best], block: max(be.options[block], key=lambda o: be.peak({**plans[best], block: o}))}
    assert be.peak(start) > rhs
    runs_seen = []

    def recorded(*args, **kwargs):
        out = highs.run_mip(*args, **kwargs)
        runs_seen.append((kwargs.get("cutoff"), out[0]))
        return out

    monkeypatch.setattr(ilp, "run_mip", recorded)
    incumbent = ilp.Incumbent(be, budget=budget, gap=gap, started=0.0)
    incumbent.raise_bound(optimum, "count master")
    formulated = problem._formulate(be, budget)
    assert formulated is not None
    problem._search_neighbourhood(ilp._Formulation(*formulated, be=be), incumbent, {}, start, {block, run.keys[0]})
    chosen, result = incumbent.result()
    assert chosen is not None and be.peak(chosen) <= rhs
    value = be.step_time(chosen)
    assert (value - optimum) / value <= _claimed(result.status, gap) + 1e-9, (result, value, optimum)
    assert runs_seen[0][0] == pytest.approx(optimum / (1 - gap))  # the first run looks only under what is proved
    if gap:
        assert len(runs_seen) == 1 and runs_seen[0][1] == chosen  # the plan is the first run's
    else:
        assert len(runs_seen) == 2  # nothing under the optimum itself: the whole neighbourhood searched
