"""Which plan a run trains under, and what its monitor makes of the measured steps: every branch without a Trainer.

``resolve_plan`` takes what the strategy knows in ``setup`` (the given plan, the resumed checkpoint's decision, the
topology) and two callables (profile, solve); ``OSDPMonitor`` holds the measurements and the prediction check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_osdp import Plan, predict
from lightning_osdp.checkpoint import PlanChoice
from lightning_osdp.monitor import OSDPMonitor
from lightning_osdp.profiling import ModelProfile
from lightning_osdp.solver import planned_budget, solve
from lightning_osdp.solver.resolve import planned_for, resolve_plan
from lightning_osdp.step_monitor import TIMED_STEPS, StepMeasurement, StepMonitor
from lightning_osdp.topology import Topology

from synthetic import gpt_profile

BUDGET = 1 << 30
HERE = Topology.flat(2)


class Calls:
    """Counts the profiling and solving a resolution asked for."""

    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        self.profiled = 0
        self.solved: list[ModelProfile] = []

    def profile_model(self) -> ModelProfile:
        self.profiled += 1
        return self.profile

    def solve(self, profile: ModelProfile) -> Plan:
        self.solved.append(profile)
        return solve(profile, planned_budget(BUDGET), HERE)

    def fits(self, profile: ModelProfile, plan: Plan) -> bool:
        return predict(profile, plan, HERE).peak_bytes <= planned_budget(BUDGET)

    def resolve(
        self, given: Plan | None = None, resumed: Any = None, topology: Topology = HERE, accumulation: int | None = None
    ) -> Any:
        return resolve_plan(
            given=given,
            resumed=resumed,
            topology=topology,
            fits=self.fits,
            solve=self.solve,
            profile=self.profile_model,
            accumulation=accumulation,
        )


@pytest.fixture
def calls() -> Calls:
    return Calls(gpt_profile())


def _saved_plan(calls: Calls, topology: dict[str, int] | None = None) -> Plan:
    plan = calls.solve(calls.profile)
    calls.solved.clear()
    if topology is not None:
        plan = Plan(plan.decisions, info={**plan.info, "topology": topology})
    return plan


def test_a_given_plan_is_applied_without_profiling_or_solving(calls: Calls) -> None:
    given = Plan({"": "full_shard"})
    resolution = calls.resolve(given=given)
    assert resolution.plan is given and resolution.source == "given" and resolution.profile is None
    assert (calls.profiled, calls.solved) == (0, [])


def test_without_a_checkpoint_the_model_is_profiled_and_solved(calls: Calls) -> None:
    resolution = calls.resolve()
    assert resolution.source == "solved" and resolution.solved_here
    assert calls.profiled == 1 and calls.solved == [calls.profile] and resolution.profile is calls.profile
    assert resolution.messages == []


def test_a_checkpoint_plan_made_for_this_run_is_reused_with_its_profile(calls: Calls) -> None:
    plan = _saved_plan(calls)
    reason = "reusing the plan saved in x.ckpt (same 2 ranks and 1.0 GiB budget per device): no profiling or solving"
    resolution = calls.resolve(resumed=PlanChoice(plan, calls.profile.to_dict(), reason))
    assert resolution.plan is plan and resolution.source == "checkpoint" and not resolution.solved_here
    assert resolution.profile is not None and resolution.profile.to_dict() == calls.profile.to_dict()
    assert resolution.messages == [reason]
    assert (calls.profiled, calls.solved) == (0, [])


def test_a_checkpoint_that_decided_to_replan_is_profiled_and_solved_with_its_reason_logged(calls: Calls) -> None:
    reason = "re-planning: the memory budget changed from 2.0 GiB (checkpoint x.ckpt) to 1.0 GiB per device"
    resolution = calls.resolve(resumed=PlanChoice(None, None, reason))
    assert resolution.source == "solved" and resolution.messages == [reason] and calls.profiled == 1


def test_a_checkpoint_plan_made_for_other_nodes_is_planned_again(calls: Calls) -> None:
    plan = _saved_plan(calls, topology={"nodes": 2, "ranks_per_node": 1})
    resolution = calls.resolve(resumed=PlanChoice(plan, calls.profile.to_dict(), "reusing ..."))
    assert resolution.source == "solved" and calls.profiled == 1
    assert "was made for 2 nodes" in resolution.messages[0] and "planning again" in resolution.messages[0]
    assert planned_for(plan, 2) == Topology(2, 1, 1)  # its shard group size spelled out


def test_a_corrected_profile_under_which_the_saved_plan_fits_keeps_the_plan(calls: Calls) -> None:
    plan = _saved_plan(calls)
    corrected = calls.profile.with_correction(1000)
    resolution = calls.resolve(resumed=PlanChoice(plan, corrected.to_dict(), "reusing ..."))
    assert resolution.plan is plan and resolution.source == "checkpoint" and calls.solved == []


def test_a_corrected_profile_under_which_the_saved_plan_no_longer_fits_is_solved_again_without_profiling(
    calls: Calls,
) -> None:
    plan = _saved_plan(calls)
    peak = predict(calls.profile, plan, HERE).peak_bytes
    corrected = calls.profile.with_correction(planned_budget(BUDGET) - peak + 1)
    resolution = calls.resolve(resumed=PlanChoice(plan, corrected.to_dict(), "reusing ..."))
    assert resolution.source == "corrected" and calls.profiled == 0
    assert [p.measured_peak_correction for p in calls.solved] == [corrected.measured_peak_correction]
    assert "went over its budget when it ran" in resolution.messages[-1]


def test_a_checkpoint_plan_made_for_other_micro_batches_is_solved_again_from_its_profile(calls: Calls) -> None:
    plan = _saved_plan(calls)
    saved = calls.profile.to_dict()
    same = calls.resolve(resumed=PlanChoice(plan, saved, "reusing ..."), accumulation=1)
    assert same.plan is plan and same.source == "checkpoint"
    resolution = calls.resolve(resumed=PlanChoice(plan, saved, "reusing ..."), accumulation=4)
    assert resolution.source == "corrected" and calls.profiled == 0
    assert [p.gradient_accumulation for p in calls.solved] == [4]
    assert resolution.profile is not None and resolution.profile.gradient_accumulation == 4
    assert "made for 1 micro-batch(es) per optimizer step and this run accumulates 4" in resolution.messages[-1]


# ---------------------------------------------------------------------------------------------- the monitor
def _monitor(tmp_path: Path, budget: int, peaks: list[int], seconds: float = 0.01, tracked: int = 0) -> OSDPMonitor:
    profile = gpt_profile()
    plan = solve(profile, "1GiB", HERE)
    monitor = OSDPMonitor(
        torch.device("cpu"),
        plan=plan,
        profile=profile,
        topology=HERE,
        memory_budget=budget,
        profile_file=profile.save(tmp_path / "plan.profile.json"),
    )
    monitor.steps.measurements = [StepMeasurement(i, seconds, peak, i < tracked) for i, peak in enumerate(peaks)]
    return monitor


def test_the_monitor_checks_the_prediction_against_the_measured_steps(tmp_path: Path) -> None:
    steps = StepMonitor(torch.device("cpu")).check_after
    probe = _monitor(tmp_path, BUDGET, [1] * steps)
    predicted = probe.prediction()
    assert predicted is not None
    monitor = _monitor(tmp_path, BUDGET, [predicted.peak_bytes] * steps, predicted.step_seconds)
    check = monitor.check_prediction()
    assert check is not None and check.ok and check.memory_ratio == pytest.approx(1.0)
    assert monitor.prediction_check is check
    assert monitor.profile is not None and monitor.profile.measured_peak_correction == 0
    assert monitor.peak_memory_bytes == predicted.peak_bytes and monitor.step_time == predicted.step_seconds


def test_steps_run_under_the_memory_tracker_are_not_timed(tmp_path: Path) -> None:
    # The CPU's tracker runs every operator through Python: a tracked step's time is not a training step's, and the
    # check waits for untracked ones (see step_monitor.py [Note: timed steps]).
    steps = StepMonitor(torch.device("cpu"), memory_steps=3)
    assert steps.check_after == 3 + TIMED_STEPS
    assert StepMonitor(torch.device("cpu"), memory_steps=0).check_after == 1 + TIMED_STEPS
    monitor = _monitor(tmp_path, BUDGET, [1, 1, 1], seconds=5.0, tracked=3)
    assert monitor.step_time is None  # only tracked steps so far
    monitor.steps.measurements += [StepMeasurement(3, 0.25, None), StepMeasurement(4, 0.75, None)]
    assert monitor.step_time == pytest.approx(0.5)
    check = monitor.check_prediction()
    prediction = monitor.prediction()
    assert check is not None and prediction is not None
    assert check.time_ratio == pytest.approx(prediction.step_seconds / 0.5)


def test_a_measured_peak_over_the_budget_is_recorded_as_a_correction_in_the_profile_file(tmp_path: Path) -> None:
    probe = _monitor(tmp_path, BUDGET, [1])
    predicted = probe.prediction()
    assert predicted is not None
    over = predicted.peak_bytes + 5000
    monitor = _monitor(tmp_path, predicted.peak_bytes, [over - 100, over, over - 200, over])
    with pytest.warns(UserWarning, match="is over the memory budget"):
        check = monitor.check_prediction()
    assert check is not None
    assert monitor.profile is not None and monitor.profile.measured_peak_correction == 5000
    saved = ModelProfile.load(tmp_path / "plan.profile.json")
    assert saved.measured_peak_correction == 5000


def test_the_monitor_keeps_its_measurements_in_lightnings_callback_state_apart_from_the_resumed_runs(
    tmp_path: Path,
) -> None:
    monitor = _monitor(tmp_path, BUDGET, [10, 20, 30])
    again = _monitor(tmp_path, BUDGET, [])
    again.load_state_dict(monitor.state_dict())
    # The resumed run's own figures are its own steps' (it may run another plan); the earlier run's are its history.
    assert again.peak_memory_bytes is None and again.steps.measurements == []
    (earlier,) = again.history
    assert [m["peak_memory_bytes"] for m in earlier["measurements"]] == [10, 20, 30]
    assert earlier["plan"] == monitor.plan.to_dict()
    assert len(again.state_dict()["history"]) == 2


def test_a_plan_given_by_hand_has_no_prediction_to_check(tmp_path: Path) -> None:
    monitor = _monitor(tmp_path, BUDGET, [1, 2, 3, 4])
    monitor.profile = None
    assert monitor.check_prediction() is None and monitor.prediction() is None
