"""Files written by earlier releases still load, with their figures in the typed fields, and predict the same.

``data/profile_v1.json`` and ``data/plan_v1.json`` were written by lightning_osdp at commit 2300c91, before profiles
had typed fields and plans a report (``data/README.md`` has the script); the figures below are what that code
predicted for them, and what this release predicts where the cost model has changed since.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightning_osdp import ModelProfile, Plan, PlanError, SolveReport, predict
from lightning_osdp.cli.hardware import hardware_from_file
from lightning_osdp.plan import PLAN_VERSION
from lightning_osdp.profiling import DeviceRates
from lightning_osdp.profiling.model_profile import PROFILE_VERSION
from lightning_osdp.solve_report import REPORT_VERSION
from lightning_osdp.solver import format_plan

from models import TinyGPT

DATA = Path(__file__).parent / "data"
# What lightning_osdp at 2300c91 predicted on 2 ranks: (peak bytes, step seconds).
OLD_PREDICTION = {"solved": (518340, 0.03555989276176471), "full_shard": (483544, 0.05700547082559636)}
# The peaks this release predicts for the same files: the step times have not moved, the peaks moved with the memory
# model's corrections of issue 13, each checked against measured runs (docs/benchmarks.md, "Memory around the loss"):
# a container whose own forward never runs (the ModuleList `h`) is ordered with its first block, and FSDP2's backward
# prefetch reaches past a `no_shard` block to the sharded one before it.
PEAK = {"solved": 529420, "full_shard": 472280}
# The step times moved by two changes of the time model (issue 31): the training loop (12 ms then, for a profile
# without counted calls 1.9 ms now) and DDP's one all-reduce per step for a model with less than a bucket of gradients
# (the solved plan's no_shard units).
STEP = {"solved": 0.026361694596570957, "full_shard": 0.04690547082559636}


def _raw(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_a_version_1_profile_loads_with_its_figures_typed_and_predicts_the_same(tmp_path: Path) -> None:
    raw = _raw("profile_v1.json")
    assert raw["version"] == 1
    profile = ModelProfile.load(DATA / "profile_v1.json")
    assert profile.forward_order == raw["info"]["forward_order"]
    assert profile.forward_order[:3] == ["", "wte", "frozen"], "frozen runs early and is registered last"
    assert profile.rates == DeviceRates(**raw["info"]["rates"])
    assert profile.copy_bytes_per_second == raw["info"]["copy_bytes_per_second"] == 3e9
    assert profile.framework_seconds is None
    moved = {"forward_order", "rates", "copy_bytes_per_second"}
    assert profile.info == {k: v for k, v in raw["info"].items() if k not in moved}
    with torch.device("meta"):
        model = TinyGPT()
    plans = {"solved": Plan.load(DATA / "plan_v1.json"), "full_shard": Plan.uniform(model, "full_shard")}
    assert profile.loss is None and profile.measured_peak_correction == 0  # not measured then
    for name, plan in plans.items():
        prediction = predict(profile, plan, 2)
        assert prediction.peak_bytes == PEAK[name], name
        assert prediction.step_seconds == pytest.approx(STEP[name], rel=1e-12), name
    # Saved again, it is a current file with top-level fields, and reads back equal; measured on one group of ranks, it
    # is one node, with no across-node fits.
    path = profile.save(tmp_path / "profile.json")
    data = json.loads(path.read_text())
    assert data["version"] == PROFILE_VERSION == 7 and data["forward_order"] == profile.forward_order
    assert data["nodes"] == 1 and data["inter_node_collectives"] == {}
    assert data["rates"] == raw["info"]["rates"] and not moved & set(data["info"])
    assert data["loss"] is None and data["measured_peak_correction"] == 0
    again = ModelProfile.load(path)
    assert again == profile
    assert [predict(again, plan, 2).peak_bytes for plan in plans.values()] == list(PEAK.values())


def test_the_forward_order_of_a_version_1_profile_is_what_the_cost_model_follows() -> None:
    profile = ModelProfile.load(DATA / "profile_v1.json")
    with torch.device("meta"):
        plan = Plan.uniform(TinyGPT(), "full_shard")
    profile.forward_order = []  # registration order: `frozen` (registered last) would run last
    assert predict(profile, plan, 2).peak_bytes != OLD_PREDICTION["full_shard"][0]


def test_the_hardware_figures_of_a_version_1_profile_are_read(tmp_path: Path) -> None:
    raw = _raw("profile_v1.json")
    figures = hardware_from_file(DATA / "profile_v1.json", 2)
    assert figures.rates == DeviceRates(**raw["info"]["rates"]) and figures.copy_bytes_per_second == 3e9
    resaved = ModelProfile.load(DATA / "profile_v1.json").save(tmp_path / "v2.profile.json")
    again = hardware_from_file(resaved, 2)
    assert (again.rates, again.copy_bytes_per_second, again.collectives) == (
        figures.rates,
        figures.copy_bytes_per_second,
        figures.collectives,
    )


def test_a_version_1_plan_gets_its_report_from_info(tmp_path: Path) -> None:
    raw = _raw("plan_v1.json")
    assert "report" not in raw
    info = raw["info"]
    plan = Plan.load(DATA / "plan_v1.json")
    assert plan.info == info, "info reads exactly as it was written"
    report = plan.report
    assert isinstance(report, SolveReport)
    assert (report.status, report.bound, report.gap) == (info["status"], info["bound"], info["gap"])
    assert (report.budget_bytes, report.world_size) == (info["budget_bytes"], info["world_size"]) == (525730, 2)
    assert report.predicted_peak_bytes == info["predicted_peak_bytes"] == OLD_PREDICTION["solved"][0]
    assert report.predicted_step_seconds == info["predicted_step_seconds"] == OLD_PREDICTION["solved"][1]
    assert report.predicted_peak_at == info["predicted_peak_at"]
    assert report.prediction.to_dict() == info["prediction"]
    assert (report.ilp_peak_bytes, report.ilp_step_seconds) == (info["ilp_peak_bytes"], info["ilp_step_seconds"])
    assert (report.planning_units, report.options) == (info["planning_units"], info["options"])
    assert list(report.modes) == info["modes"] and list(report.splits) == info["splits"]
    # Saved again: the same info, and the report beside it; it reads back equal.
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["version"] == PLAN_VERSION == 3 and data["info"] == info
    assert data["report"]["version"] == REPORT_VERSION and data["report"]["status"] == info["status"]
    assert Plan.load(path) == plan


def test_a_version_1_plan_from_before_the_bound_was_recorded(tmp_path: Path) -> None:
    raw = _raw("plan_v1.json")
    del raw["info"]["bound"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    plan = Plan.load(path)
    assert plan.report is not None and plan.report.bound is None and plan.report.status == "optimal"
    assert plan.info == raw["info"]


def test_the_budget_the_user_gave_is_recorded_beside_the_one_the_ilp_was_given(tmp_path: Path) -> None:
    """The planning policy plans against the user's budget less a headroom; a plan file of that kind (its ``info``
    with ``memory_budget_bytes`` and ``memory_headroom``) reads back with both, and tables show the user's."""
    raw = _raw("plan_v1.json")
    raw["info"].update(memory_budget_bytes=553400, memory_headroom=0.05)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    plan = Plan.load(path)
    report = plan.report
    assert report is not None and (report.memory_budget_bytes, report.memory_headroom) == (553400, 0.05)
    assert report.budget_bytes == 525730 and report.requested_budget_bytes == 553400
    assert plan.info == raw["info"] and list(report.as_info())[-2:] == ["memory_budget_bytes", "memory_headroom"]
    assert Plan.load(plan.save(tmp_path / "again.json")).report == report
    profile = ModelProfile.load(DATA / "profile_v1.json")
    table = format_plan(plan, predict(profile, plan, 2), rich_markup=False)
    assert "of budget 540.43 KiB" in table and "solver: optimal" in table
    # Without the policy's figures, the budget is the one the ILP was given.
    assert Plan.load(DATA / "plan_v1.json").report.requested_budget_bytes == 525730


@pytest.mark.parametrize(
    "info",
    [{"source": "hand-written"}, {"status": "optimal"}, {"status": "optimal", "prediction": "about 1 GiB"}],
    ids=["no figures", "a status only", "a prediction that is not one"],
)
def test_an_info_without_a_solver_s_figures_is_no_report(tmp_path: Path, info: dict) -> None:
    raw = {**_raw("plan_v1.json"), "info": info}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    plan = Plan.load(path)
    assert plan.report is None and plan.info == info


def test_the_report_wins_over_info_entries_of_the_same_name(tmp_path: Path) -> None:
    plan = Plan.load(DATA / "plan_v1.json")
    data = plan.to_dict()
    data["info"]["predicted_peak_bytes"] = 1  # edited by hand; the report is the record
    assert Plan.from_dict(data).info["predicted_peak_bytes"] == OLD_PREDICTION["solved"][0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(version=99), "field 'report': version 99 is not supported"),
        (lambda r: r.pop("prediction"), "field 'report': field 'prediction' is missing"),
        (lambda r: r.update(budget_bytes="1GiB"), "field 'report': field 'budget_bytes' must be int, got '1GiB'"),
        (
            lambda r: r["prediction"].update(peak_at=3),
            "field 'report': field 'prediction': field 'peak_at' must be str",
        ),
        (lambda r: r.update(splits=[1, 2.5]), "field 'report': field 'splits' must hold int values, got 2.5"),
    ],
    ids=["version", "missing", "wrong type", "nested", "list item"],
)
def test_a_malformed_report_is_refused_naming_the_field(tmp_path: Path, change, message: str) -> None:
    data = Plan.load(DATA / "plan_v1.json").to_dict()
    change(data["report"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=f"^{path}: " + message.replace("(", r"\(").replace(")", r"\)")):
        Plan.load(path)


def test_a_profile_of_an_unknown_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    shutil.copy(DATA / "profile_v1.json", path)
    path.write_text(path.read_text().replace('"version": 1', '"version": 9', 1))
    with pytest.raises(ValueError, match="not a lightning_osdp profile of version 1, 2, 3, 4, 5, 6, 7 .*version=9"):
        ModelProfile.load(path)
