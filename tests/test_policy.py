"""One budget gives one plan wherever it is planned: the strategy and ``osdp plan`` share the planning policy."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lightning_osdp import OSDPStrategy, Plan, predict
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.output import Output
from lightning_osdp.cli.parsers import DEFAULT_GAP, DEFAULT_MEMORY_HEADROOM_TEXT, SOLVERS, add_plan_parser
from lightning_osdp.cli.plan import _solve, resolve
from lightning_osdp.solver import (
    InfeasibleBudgetError,
    ilp,
    minimum_budget,
    plan_model,
    planned_budget,
    smallest_memory_budget,
    solve,
)
from lightning_osdp.solver.policy import DEFAULT_MEMORY_HEADROOM

from conftest import ROOT
from synthetic import gpt_profile

GPT_CONFIG = ROOT / "examples" / "gpt" / "configs" / "osdp_budget.yaml"


def _dry_run_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    return parser.parse_args(["plan", "--config", str(GPT_CONFIG), "--hardware", "l4-pcie", *argv])


@pytest.fixture(scope="module")
def profile_and_budget() -> tuple[object, int]:
    prof = gpt_profile(depth=4, width=128, tokens=256, world_size=2)
    blocks = {f"model.blocks.{i}": "no_shard" for i in range(4)}
    ddp = predict(prof, Plan({"": "no_shard", **blocks}), 2).peak_bytes
    low = minimum_budget(prof, 2)
    return prof, (low + ddp) // 2


def test_the_cli_and_the_strategy_choose_the_same_plan_for_one_profile_and_budget(
    profile_and_budget: tuple[object, int],
) -> None:
    prof, budget = profile_and_budget
    strategy = OSDPStrategy(memory_budget=budget, memory_headroom=0.1, max_split=2)
    run = resolve(
        _dry_run_args("--memory", str(budget), "--headroom", "0.1", "--max-split", "2", "--world-size", "2"),
        Output(quiet=True),
    )
    chosen = strategy.plan_for(prof, 2)  # type: ignore[arg-type]
    assert _solve(run, prof).decisions == chosen.decisions  # type: ignore[arg-type]
    # The headroom is part of the policy: at the full budget the solver keeps more replicated.
    assert solve(prof, budget, 2, max_split=2).decisions != chosen.decisions  # type: ignore[arg-type]
    assert chosen.info["predicted_peak_bytes"] <= planned_budget(budget, 0.1) < budget
    assert chosen.report is not None
    assert chosen.report.memory_budget_bytes == budget and chosen.report.memory_headroom == 0.1


def test_the_cli_reads_the_headroom_of_the_strategy_in_a_config(tmp_path: Path) -> None:
    config = tmp_path / "osdp.yaml"
    budget = "      memory_budget: 80MiB"
    config.write_text(GPT_CONFIG.read_text().replace(budget, budget + "\n      memory_headroom: 0.2"))
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    model = str(ROOT / "examples" / "gpt" / "gpt.py") + ":GPTModule"
    argv = ["plan", "--config", str(config), "--model", model, "--hardware", "l4-pcie"]
    run = resolve(parser.parse_args(argv), Output(quiet=True))
    assert run.planner.memory_headroom == 0.2 and run.planned_budget == int(80 * 2**20 * 0.8)


def test_an_infeasible_budget_names_the_smallest_memory_budget_that_passes_with_the_headroom(
    profile_and_budget: tuple[object, int],
) -> None:
    prof, _ = profile_and_budget
    smallest = smallest_memory_budget(prof, 2, headroom=0.1)  # type: ignore[arg-type]
    assert planned_budget(smallest, 0.1) >= minimum_budget(prof, 2) > planned_budget(smallest - 1, 0.1)  # type: ignore[arg-type]
    with pytest.raises(InfeasibleBudgetError, match="the smallest memory_budget to pass is") as caught:
        plan_model(prof, smallest - 1, 2, headroom=0.1)  # type: ignore[arg-type]
    assert caught.value.minimum == smallest
    plan_model(prof, smallest, 2, headroom=0.1)  # type: ignore[arg-type]


@pytest.mark.parametrize("solver", ["highs"])
def test_the_fits_question_answers_as_the_smallest_budget_does_around_it(
    profile_and_budget: tuple[object, int], solver: str
) -> None:
    """``osdp plan``'s batch search asks ``smallest_memory_budget(settle_at=budget) <= budget``, which stops early;
    its answer is the proven minimum's on either side of it (a budget one byte under, at, far above and far below)."""
    prof, _ = profile_and_budget
    smallest = smallest_memory_budget(prof, 2, headroom=0.1, solver=solver)  # type: ignore[arg-type]
    for budget, fits in ((smallest - 1, False), (smallest, True), (3 * smallest, True), (smallest // 2, False)):
        settled = smallest_memory_budget(prof, 2, headroom=0.1, solver=solver, settle_at=budget)  # type: ignore[arg-type]
        assert (settled <= budget) is fits, (budget, settled)


def test_the_parsers_default_headroom_is_the_policys() -> None:
    assert float(DEFAULT_MEMORY_HEADROOM_TEXT) == DEFAULT_MEMORY_HEADROOM
    assert SOLVERS == ilp.SOLVERS  # and its solvers, default first
    assert DEFAULT_GAP == ilp.DEFAULT_GAP  # and its gap


def test_the_gap_reaches_the_solve_from_the_strategy_and_the_cli(profile_and_budget: tuple[object, int]) -> None:
    prof, budget = profile_and_budget
    strategy = OSDPStrategy(memory_budget=budget, solver_gap=0.05)
    run = resolve(_dry_run_args("--memory", str(budget), "--world-size", "2", "--gap", "0.05"), Output(quiet=True))
    for plan in (strategy.plan_for(prof, 2), _solve(run, prof)):  # type: ignore[arg-type]
        assert plan.report is not None and plan.report.gap == 0.05
        assert plan.report.status in ("optimal", "within gap 0.05")
    default = resolve(_dry_run_args("--memory", str(budget), "--world-size", "2"), Output(quiet=True))
    assert default.planner.solver_gap == 1e-3 == OSDPStrategy().planner_options.solver_gap
    with pytest.raises(CLIError, match=r"--solver-gap: gap must be in \[0, 1\)"):
        resolve(_dry_run_args("--memory", str(budget), "--world-size", "2", "--gap", "1"), Output(quiet=True))
    with pytest.raises(CLIError, match=r"--memory-headroom must be in \[0, 0.5\), got 0.5"):
        resolve(_dry_run_args("--memory", str(budget), "--world-size", "2", "--headroom", "0.5"), Output(quiet=True))
    with pytest.raises(CLIError, match=r"--max-split must be an integer >= 1, got 0"):
        resolve(_dry_run_args("--memory", str(budget), "--world-size", "2", "--max-split", "0"), Output(quiet=True))
    with pytest.raises(ValueError, match=r"gap must be in \[0, 1\)"):
        solve(prof, budget, 2, gap=-0.1)  # type: ignore[arg-type]


def test_the_solver_choice_reaches_the_ilp_from_the_strategy_and_the_cli(
    profile_and_budget: tuple[object, int],
) -> None:
    prof, budget = profile_and_budget
    strategy = OSDPStrategy(memory_budget=budget, solver="highs")
    run = resolve(_dry_run_args("--memory", str(budget), "--world-size", "2", "--solver", "highs"), Output(quiet=True))
    chosen = strategy.plan_for(prof, 2)  # type: ignore[arg-type]
    assert run.planner.solver == strategy.planner_options.solver == "highs"
    assert _solve(run, prof).decisions == chosen.decisions  # type: ignore[arg-type]
    # "cbc" (removed) plans on HiGHS, with a warning from either side.
    with pytest.warns(FutureWarning, match="solver='cbc' is deprecated"):
        cbc = OSDPStrategy(memory_budget=budget, solver="cbc")
    assert cbc.planner_options.solver == "highs"
    with pytest.warns(FutureWarning, match="solver='cbc' is deprecated"):
        resolve(_dry_run_args("--memory", str(budget), "--world-size", "2", "--solver", "cbc"), Output(quiet=True))
    with pytest.raises(ValueError, match=r"OSDPStrategy\(solver=...\): solver must be 'highs'"):
        OSDPStrategy(solver="glpk")


def test_the_options_are_spelled_once_from_the_strategy_and_the_cli(profile_and_budget: tuple[object, int]) -> None:
    # osdp plan's flags fill the same PlannerOptions the strategy holds, under the strategy's names; the first
    # spellings of the flags (--time-limit, --gap, --headroom) and of the fields (time_limit, gap, headroom) stay.
    _, budget = profile_and_budget
    flags = ("--solver-time-limit", "3", "--solver-gap", "0.01", "--memory-headroom", "0.1", "--max-split", "2")
    old = ("--time-limit", "3", "--gap", "0.01", "--headroom", "0.1", "--max-split", "2")
    strategy = OSDPStrategy(solver_time_limit=3, solver_gap=0.01, memory_headroom=0.1, max_split=2)
    for args in (flags, old):
        run = resolve(_dry_run_args("--memory", str(budget), "--world-size", "2", *args), Output(quiet=True))
        assert run.planner == strategy.planner_options
    options = strategy.planner_options
    assert (options.time_limit, options.gap, options.headroom) == (3, 0.01, 0.1)


def test_with_a_card_the_plan_is_solved_again_until_its_device_total_fits(
    profile_and_budget: tuple[object, int],
) -> None:
    from lightning_osdp.cost_model.device_memory import plan_device_memory
    from lightning_osdp.solver.policy import PlannerOptions
    from lightning_osdp.topology import Topology

    prof, budget = profile_and_budget
    options, flat = PlannerOptions(), Topology.flat(2)

    def device_total(plan: Plan) -> int:
        return plan_device_memory(predict(prof, plan, flat), plan, flat).device_total  # type: ignore[arg-type]

    plain = options.plan(prof, budget, 2)  # type: ignore[arg-type]
    low = minimum_budget(prof, 2)  # type: ignore[arg-type]
    # A card the budget's plan exceeds (by half of what its allocated peak is above the smallest plan's): what a GPU's
    # default budget, the card less a fixed reserve, can give where fragmentation is large.
    card = device_total(plain) - (plain.info["predicted_peak_bytes"] - low) // 2
    fitted = options.plan(prof, budget, 2, card_bytes=card)  # type: ignore[arg-type]
    assert device_total(fitted) <= card < device_total(plain)
    assert fitted.info["predicted_peak_bytes"] < plain.info["predicted_peak_bytes"]
    assert "solved again" in fitted.info["card"]
    # A card the plan fits leaves it as it is; so does no card (on CPU, the strategy passes none).
    kept = options.plan(prof, budget, 2, card_bytes=device_total(plain))  # type: ignore[arg-type]
    assert kept.decisions == plain.decisions and "card" not in kept.info
