"""Which parameters communicate together is decided once: the executor and the cost model see the same units."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_osdp import Plan, PlanError, profile
from lightning_osdp.apply import plan_units
from lightning_osdp.cost_model.config import CostModelConfig
from lightning_osdp.cost_model.structure import ModelInfo, Segment, build_structure
from lightning_osdp.grouping import ROOT, Tie, communication_units, covering_decision, merged_ties, tied_holders

from distributed.runner import PLANS
from models import TinyGPT, loaders


def _covers_parameters(model: torch.nn.Module, plan: Plan, names: tuple[str, ...]) -> bool:
    """Whether a unit covers at least one parameter of the model (the cost model leaves out empty units)."""
    if any(".slices." in n for n in names):
        return True
    holders = {m for m, mod in model.named_modules() for _ in mod.parameters(recurse=False)}
    return any(covering_decision(plan.decisions, m) in names for m in holders)


@pytest.fixture(scope="module")
def tiny_profile() -> Any:
    torch.manual_seed(0)
    train, _ = loaders(batch_size=4)
    return profile(TinyGPT(), next(iter(train)))


def test_the_profile_records_the_live_models_tied_holders(tiny_profile: Any) -> None:
    assert [list(t.holders) for t in tied_holders(TinyGPT())] == tiny_profile.tied == [["wte", "lm_head"]]
    assert tied_holders(TinyGPT())[0].parameter == "wte.weight"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_executor_and_cost_model_form_the_same_units_for_every_parity_plan(name: str, tiny_profile: Any) -> None:
    plan = Plan(PLANS[name])
    model = TinyGPT()
    applied = {u.names: u.mode for u in plan_units(model, plan)}
    root = plan.decisions[ROOT].mode if ROOT in plan.decisions else "no_shard"
    applied[(ROOT,)] = root
    from_profile = {u.names: u.mode for u in communication_units(plan.decisions, tiny_profile.tied)}
    assert from_profile == {k: v for k, v in applied.items() if k != (ROOT,) or ROOT in plan.decisions}

    info = ModelInfo(tiny_profile, 2, CostModelConfig().resolve(tiny_profile))
    structure = build_structure(info, plan)
    # (The cost model orders a list group's holders as they run forward, the executor by name.)
    modelled = {frozenset(u.names): u.mode for u in structure.globals}
    for item in structure.items:
        if isinstance(item, Segment):
            modelled.update({frozenset(u.names): u.mode for u in item.units})
    # The cost model keeps the root's unit whatever it covers, and leaves out units that cover no parameter.
    expected = {frozenset(k): v for k, v in applied.items() if k == (ROOT,) or _covers_parameters(model, plan, k)}
    assert modelled == expected


def test_tied_decisions_form_one_list_group_in_name_order() -> None:
    decisions = Plan({"": "no_shard", "wte": "full_shard", "lm_head": "full_shard", "h.0": "no_shard"}).decisions
    units = communication_units(decisions, [("wte", "lm_head")])
    assert [u.names for u in units] == [("",), ("h.0",), ("lm_head", "wte")]
    assert units[2].is_list_group and units[2].decision == "lm_head" and units[2].mode == "full_shard"


def test_a_split_decision_is_one_unit_per_slice() -> None:
    units = communication_units(Plan({"h.0.fc": ("full_shard", 3)}).decisions)
    assert [(u.names, u.decision, u.split) for u in units] == [
        (("h.0.fc.slices.0",), "h.0.fc", 3),
        (("h.0.fc.slices.1",), "h.0.fc", 3),
        (("h.0.fc.slices.2",), "h.0.fc", 3),
    ]


def test_a_tie_with_the_covering_ancestor_is_refused_naming_both_holders() -> None:
    expected = r"between 'wte', 'lm_head' is used by 'wte' \(decision 'wte'\).*'lm_head' \(decision ''"
    with pytest.raises(PlanError, match=expected):
        communication_units(Plan({"": "no_shard", "wte": "full_shard"}).decisions, [("wte", "lm_head")])


def test_ties_sharing_a_holder_merge_transitively() -> None:
    assert merged_ties([("a", "b"), ("c", "d"), Tie(("b", "c"))]) == [("a", "b", "c", "d")]
    decisions = Plan({"a": "full_shard", "b": "full_shard", "c": "full_shard", "d": "full_shard"}).decisions
    units = communication_units(decisions, [("a", "b"), ("c", "d"), ("b", "c")])
    assert [u.names for u in units] == [("a", "b", "c", "d")]
