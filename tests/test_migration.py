"""Coming from Lightning's other strategies: an argument of FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy or
DDPStrategy given to OSDP is a ``TypeError`` that names what OSDP does instead; a typo suggests the closest name. No
process group and no training: these are construction-time errors."""

from __future__ import annotations

import inspect
import re
from typing import Any

import lightning as L
import pytest
from lightning.fabric import strategies as fabric_strategies
from lightning.pytorch import strategies as trainer_strategies
from torch.distributed.fsdp import CPUOffload, ShardingStrategy

from lightning_osdp import MODES, OSDPStrategy, Plan
from lightning_osdp.migration import FOREIGN_ARGUMENTS, arguments_of, instead_of, refuse_foreign_arguments

from models import Block, TinyGPT

OSDP_ARGUMENTS = arguments_of(OSDPStrategy)


def message(**arguments: Any) -> str:
    with pytest.raises(TypeError) as error:
        refuse_foreign_arguments(arguments, "OSDPStrategy", accepted=OSDP_ARGUMENTS)
    return str(error.value)


@pytest.mark.parametrize(
    ("arguments", "replacement"),
    [
        ({"sharding_strategy": "FULL_SHARD"}, "`modes=('full_shard',)`"),
        ({"sharding_strategy": "full_shard"}, "`modes=('full_shard',)`"),  # Lightning reads it in any case
        ({"sharding_strategy": ShardingStrategy.FULL_SHARD}, "`modes=('full_shard',)`"),
        ({"sharding_strategy": "SHARD_GRAD_OP"}, "`modes=('shard_grad_op',)`"),
        ({"sharding_strategy": "NO_SHARD"}, "`modes=('no_shard',)`"),
        ({"sharding_strategy": "HYBRID_SHARD"}, "`modes=('hybrid_shard',)` gives every planning unit HYBRID_SHARD"),
        ({"sharding_strategy": "HYBRID_SHARD"}, "`shard_group_size=`"),
        ({"sharding_strategy": ShardingStrategy._HYBRID_SHARD_ZERO2}, "`modes=('hybrid_shard',)` is the nearest"),
        ({"auto_wrap_policy": {Block}}, "`plan=Plan.uniform(model, 'full_shard', units=[name for name, m in"),
        ({"auto_wrap_policy": lambda *a: True}, "the planner chooses the units itself"),
        ({"activation_checkpointing_policy": {Block}}, "`activation_checkpointing=` says how"),
        ({"activation_checkpointing_policy": {Block}}, "recompute='full')"),
        ({"cpu_offload": True}, "not supported yet"),
        ({"cpu_offload": CPUOffload(offload_params=True)}, "not supported yet"),
        ({"cpu_offload": False}, "OSDP does not offload (drop the argument)"),
        ({"device_mesh": (2, 4)}, "`modes=('hybrid_shard',), shard_group_size=4`"),
        ({"precision": "bf16-mixed"}, "`mixed_precision='bf16'`"),
        ({"limit_all_gathers": True}, "FSDP2 limits the all-gathers in flight itself"),
        ({"use_orig_params": True}, "always keeps the original parameters"),
        ({"parallelize_fn": print}, "pass `plan=`"),
        ({"tensor_parallel_size": 2}, "not supported yet"),
        ({"tensor_parallel_size": 1}, "nothing to set"),
        ({"data_parallel_size": 8}, "`modes=('hybrid_shard',)` with `shard_group_size=`"),
        ({"save_distributed_checkpoint": True}, "`state_dict_type='sharded'`"),
        ({"save_distributed_checkpoint": False}, "`state_dict_type='full'`"),
        ({"stage": 0}, "`modes=('no_shard',)` is ZeRO stage 0"),
        ({"stage": 1}, "`modes=('shard_grad_op',)` is ZeRO stage 1 (OSDP has no ZeRO-1"),
        ({"stage": 2}, "`modes=('shard_grad_op',)` is ZeRO stage 2"),
        ({"stage": 3}, "`modes=('full_shard',)` is ZeRO stage 3"),
        ({"zero_optimization": False}, "`modes=('no_shard',)`"),
        ({"offload_optimizer": True}, "not supported yet"),
        ({"offload_parameters": True}, "not supported yet"),
        ({"nvme_path": "/local_nvme"}, "not supported yet"),
        ({"load_full_weights": True}, "`pretrained=` the full checkpoint"),
        ({"remote_device": "cpu"}, "trainer.init_module(empty_init=True)"),
        ({"initial_scale_power": 16}, "GradScaler(init_scale=..., growth_interval=...)"),
        ({"ddp_comm_hook": print}, "not supported yet"),
        ({"static_graph": True}, "not supported yet"),
    ],
    ids=lambda x: str(x)[:40],
)
def test_each_carried_over_argument_names_what_osdp_does_instead(arguments: dict[str, Any], replacement: str) -> None:
    text = message(**arguments)
    (name,) = arguments
    assert f"  - {name}=" in text
    assert replacement in text


@pytest.mark.parametrize("name", sorted(FOREIGN_ARGUMENTS))
def test_every_replacement_named_is_an_argument_the_strategy_takes(name: str) -> None:
    """Every `name=` a message tells the user to write is OSDPStrategy's (or the Trainer's `precision=`, or an
    argument of the code it spells out), and every mode it names is one of MODES, whatever the value given."""
    spelled_out = {"units", "recompute", "init_scale", "growth_interval", "scaler", "empty_init"}
    for value in (True, False, None, 0, 1, 2, 3, "FULL_SHARD", (2, 4), {Block}, set()):
        hint = instead_of(name, value)
        assert hint is not None
        named = set(re.findall(r"`(\w+)=", hint)) | set(re.findall(r"[(,] ?(\w+)=", hint))
        assert named <= {*OSDP_ARGUMENTS, "precision", *spelled_out}, (value, named)
        for modes in re.findall(r"modes=\(([^)]*)\)", hint):
            assert set(re.findall(r"'(\w+)'", modes)) <= set(MODES), (value, modes)


def test_the_plan_an_auto_wrap_policy_message_spells_out_wraps_those_modules() -> None:
    """The expression the message gives builds FSDP's plan for the policy: each Block a full_shard unit."""
    text = message(auto_wrap_policy={Block})
    expression = re.search(r"`plan=(Plan\.uniform\(.*?\))`", text)
    assert expression is not None
    model = TinyGPT()
    plan = eval(expression.group(1), {"Plan": Plan, "model": model, "Block": Block})
    assert sorted(plan.decisions) == ["", "h.0", "h.1", "h.2"]
    assert {d.mode for d in plan.decisions.values()} == {"full_shard"}

    text = message(activation_checkpointing_policy={Block})
    expression = re.search(r"`plan=(Plan\.uniform\(.*?recompute='full'\))`", text)
    assert expression is not None
    plan = eval(expression.group(1), {"Plan": Plan, "model": model, "Block": Block})
    assert [plan.decisions[f"h.{i}"].recompute for i in range(3)] == ["full"] * 3


STRATEGIES = [
    trainer_strategies.FSDPStrategy,
    fabric_strategies.FSDPStrategy,
    trainer_strategies.ModelParallelStrategy,
    fabric_strategies.ModelParallelStrategy,
    trainer_strategies.DeepSpeedStrategy,
    fabric_strategies.DeepSpeedStrategy,
    trainer_strategies.DDPStrategy,
    fabric_strategies.DDPStrategy,
]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: f"{s.__module__.split('.')[1]}.{s.__name__}")
def test_every_argument_of_lightning_s_strategies_is_osdp_s_or_mapped(strategy: type) -> None:
    """Fails by name when Lightning adds an argument to one of the strategies users come from."""
    parameters = inspect.signature(strategy.__init__).parameters.values()
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    assert len(names) >= 5
    assert names - {*OSDP_ARGUMENTS, *FOREIGN_ARGUMENTS} == set()


def test_several_arguments_are_one_error_naming_each() -> None:
    text = message(
        auto_wrap_policy={Block},
        activation_checkpointing_policy={Block},
        sharding_strategy="HYBRID_SHARD",
        cpu_offload=True,
    )
    assert text.startswith("OSDPStrategy got 4 arguments it does not take:\n")
    for name in (
        "auto_wrap_policy={Block}",
        "activation_checkpointing_policy={Block}",
        "sharding_strategy='HYBRID_SHARD'",
    ):
        assert f"  - {name} (FSDPStrategy): " in text
    assert "  - sharding_strategy='HYBRID_SHARD' (FSDPStrategy): `modes=('hybrid_shard',)`" in text
    assert "  - cpu_offload=True (FSDPStrategy): not supported yet" in text
    assert "docs/migrating.md" in text
    assert "takes:" not in text  # no typo among them: the accepted list would be noise


def test_an_unknown_argument_suggests_the_closest_and_lists_the_accepted() -> None:
    text = message(memory_budjet="6GiB")
    assert "  - memory_budjet: not an argument of OSDPStrategy; did you mean memory_budget?" in text
    assert f"OSDPStrategy takes: {', '.join(OSDP_ARGUMENTS)}." in text

    text = message(completely_unrelated=1)
    assert "  - completely_unrelated: not an argument of OSDPStrategy\n" in text

    # A misspelt foreign argument: what OSDP does instead of the one meant.
    text = message(auto_wrap_polcy={Block})
    assert "auto_wrap_polcy: not an argument; did you mean auto_wrap_policy? auto_wrap_policy={Block}" in text
    assert "`plan=Plan.uniform(" in text


def test_a_strategy_passes_its_own_accepted_arguments() -> None:
    """The Fabric strategy's arguments differ from the Trainer's: the suggestion and the list are the caller's."""
    with pytest.raises(TypeError, match=r"did you mean precision\?\nMyStrategy takes: precision, plan\.") as error:
        refuse_foreign_arguments({"precison": "bf16-mixed"}, "MyStrategy", accepted=["precision", "plan"])
    assert str(error.value).startswith("MyStrategy got an argument it does not take:")


def test_nothing_unrecognised_is_no_error() -> None:
    assert OSDP_ARGUMENTS[:2] == ["memory_budget", "plan"] and "kwargs" not in OSDP_ARGUMENTS
    refuse_foreign_arguments({}, "OSDPStrategy", accepted=OSDP_ARGUMENTS)


def test_the_strategy_refuses_them_at_construction_before_any_check() -> None:
    # memory_budget=0.5 alone is a ValueError: the foreign arguments are reported first, as the user's first fix.
    with pytest.raises(TypeError, match=r"got 2 arguments it does not take") as error:
        OSDPStrategy(memory_budget=0.5, sharding_strategy="FULL_SHARD", stage=3)
    assert "`modes=('full_shard',)`" in str(error.value)
    with pytest.raises(TypeError, match=r"auto_wrap_policy=\{Block\} \(FSDPStrategy\)"):
        L.Trainer(strategy=OSDPStrategy(auto_wrap_policy={Block}), accelerator="cpu", devices=2, logger=False)
    # OSDP's own arguments of the same name as FSDPStrategy's still pass.
    strategy = OSDPStrategy(state_dict_type="full", activation_checkpointing="full", mixed_precision="bf16")
    assert strategy.planner_options.activation_checkpointing == "full"


def test_the_error_docs_migrating_md_shows_is_the_one_raised() -> None:
    from conftest import ROOT

    page = (ROOT / "docs" / "migrating.md").read_text()
    shown = re.search(r"^```text\n(.*?)^```", page, re.S | re.M)
    assert shown is not None
    text = message(auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD", cpu_offload=True)
    assert shown.group(1) == text + "\n"
