"""Bad input fails when it is given: every argument of ``OSDPStrategy`` at construction, every plan file when read,
naming the argument (or file) and what is accepted; every valid value still passes, from Python and from YAML."""

from __future__ import annotations

import json
import math
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_osdp import OSDPStrategy, Plan, PlanError, parse_memory_budget

from models import TinyGPT


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        # Each of these used to pass construction and fail later (some after profiling), or turn into 0 bytes.
        ({"timeout": timedelta(0)}, ValueError, "timeout=...) must be a positive timedelta or number of seconds"),
        ({"timeout": -5}, ValueError, "timeout=...) takes a positive timedelta or number of seconds, got -5"),
        ({"timeout": "30"}, TypeError, "timeout=...) takes a positive timedelta or number of seconds, got '30'"),
        ({"timeout": math.nan}, ValueError, "timeout=...) takes a positive"),
        ({"solver_time_limit": "abc"}, TypeError, "solver_time_limit=...) takes a positive number of seconds"),
        ({"solver_time_limit": -1}, ValueError, "solver_time_limit=...) takes a positive number of seconds, got -1"),
        ({"solver_time_limit": math.inf}, ValueError, "solver_time_limit=...) takes a positive number of seconds"),
        ({"memory_steps": "3"}, TypeError, "memory_steps=...) takes an integer >= 0, got '3'"),
        ({"memory_steps": -1}, ValueError, "memory_steps=...) must be an integer >= 0, got -1"),
        ({"plan_out": ""}, ValueError, "plan_out=...) is an empty path"),
        ({"plan_out": 123}, TypeError, "plan_out=...) takes a file path (str or os.PathLike), got 123"),
        ({"process_group_backend": "bogus"}, ValueError, "process_group_backend=...) takes None, one of ['gloo'"),
        (
            {"process_group_backend": "cpu:gloo,"},
            ValueError,
            "process_group_backend=...): cannot read 'cpu:gloo,' as per-device backends",
        ),
        ({"process_group_backend": 7}, TypeError, "process_group_backend=...) takes None"),
        ({"memory_budget": "0.1B"}, ValueError, "memory_budget=...): memory budget '0.1B' is a fraction of a byte"),
        ({"memory_budget": 0.5}, ValueError, "memory_budget=...): memory budget 0.5 is a fraction of a byte"),
        (
            {"memory_budget": "0.0001KiB"},
            ValueError,
            "memory_budget=...): memory budget '0.0001KiB' is less than one byte",
        ),
        ({"memory_budget": math.nan}, ValueError, "memory_budget=...): memory budget must be a positive, finite"),
        ({"memory_budget": math.inf}, ValueError, "memory_budget=...): memory budget must be a positive, finite"),
        ({"memory_budget": -(2**30)}, ValueError, "memory_budget=...): memory budget must be positive"),
        ({"memory_budget": "-1GiB"}, ValueError, "memory_budget=...): memory budget must be positive"),
        ({"memory_budget": True}, ValueError, "memory_budget=...): memory budget must be bytes"),
        ({"memory_budget": "6 gigs"}, ValueError, "memory_budget=...): cannot parse memory budget '6 gigs'"),
        ({"memory_headroom": "0.1"}, TypeError, "memory_headroom=...) takes a number in [0, 0.5)"),
        ({"memory_headroom": math.nan}, ValueError, "memory_headroom=...) must be in [0, 0.5), got nan"),
        ({"modes": "full_shard"}, TypeError, "modes=...) takes a list of modes such as ['full_shard']"),
        ({"modes": ["zero3"]}, ValueError, "modes=...) must be a non-empty subset of"),
        ({"modes": []}, ValueError, "modes=...) must be a non-empty subset of"),
        ({"max_split": 0}, ValueError, "max_split=...) must be an integer >= 1, got 0"),
        ({"max_split": 2.0}, TypeError, "max_split=...) takes an integer >= 1, got 2.0"),
        ({"start_method": "thread"}, ValueError, "start_method=...) must be one of ('popen', 'spawn'"),
        ({"state_dict_type": "dcp"}, ValueError, "state_dict_type=...) must be 'sharded' or 'full', got 'dcp'"),
        ({"plan": 3}, TypeError, "plan=...) takes a lightning_osdp.Plan or a plan file path"),
        ({"plan": ""}, PlanError, "plan=...): the plan file path is empty"),
        (
            {"solver": "glpk"},
            ValueError,
            "solver=...): solver must be 'highs' (the only one; 'cbc' was removed), got 'glpk'",
        ),
        ({"solver_gap": "0.01"}, TypeError, "solver_gap=...): gap must be a number in [0, 1)"),
        ({"solver_gap": -1e-3}, ValueError, "solver_gap=...): gap must be in [0, 1) (a relative optimality gap"),
        ({"solver_gap": 1.0}, ValueError, "solver_gap=...): gap must be in [0, 1)"),
        ({"solver_gap": math.nan}, ValueError, "solver_gap=...): gap must be in [0, 1)"),
    ],
)
def test_each_bad_argument_fails_at_construction_naming_it(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        OSDPStrategy(**arguments)
    assert str(info.value).startswith("OSDPStrategy(" + message), str(info.value)


def test_a_backend_this_torch_lacks_is_named() -> None:
    import torch.distributed as dist

    missing = [b for b in ("nccl", "mpi", "ucc") if not dist.is_backend_available(b)]
    if not missing:
        pytest.skip("this torch build has every backend")
    with pytest.raises(ValueError, match=f"backend '{missing[0]}' is not available in this build of torch"):
        OSDPStrategy(process_group_backend=missing[0])


def test_plan_out_must_be_a_file_that_can_be_created(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"plan_out=...\) must name a file, got the directory"):
        OSDPStrategy(plan_out=tmp_path)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"cannot be created: .*a_file is a file"):
        OSDPStrategy(plan_out=tmp_path / "a_file" / "plan.json")
    assert OSDPStrategy(plan_out=str(tmp_path / "new" / "plan.json"))._plan_out == tmp_path / "new" / "plan.json"


def test_valid_values_are_kept_in_the_strategy_s_units() -> None:
    strategy = OSDPStrategy(
        memory_budget=4e9,
        timeout=90,
        solver_time_limit=3,
        memory_steps=0,
        process_group_backend="GLOO",
        modes=["full_shard", "no_shard", "full_shard"],
        max_split=2,
        memory_headroom=0,
        solver_gap=0.01,
    )
    assert strategy.memory_budget == 4_000_000_000
    assert strategy.planner_options.gap == 0.01 and OSDPStrategy().planner_options.gap == 1e-3
    assert strategy.timeout == timedelta(seconds=90)
    assert strategy.planner_options.time_limit == 3.0 and strategy._memory_steps == 0
    assert strategy.process_group_backend == "gloo"
    assert strategy.planner_options.modes == ("full_shard", "no_shard")
    assert OSDPStrategy(memory_budget="1.5 GiB").memory_budget == 3 * 2**29
    assert OSDPStrategy(process_group_backend="cpu:gloo").process_group_backend == "cpu:gloo"
    assert OSDPStrategy(timeout=timedelta(minutes=2)).timeout == timedelta(minutes=2)


def test_a_timeout_shorter_than_the_solve_may_take_warns_only_when_planning() -> None:
    with pytest.warns(UserWarning, match=r"timeout=30 s\).*solve may take up to about 120 s"):
        OSDPStrategy(timeout=30)
    with pytest.warns(UserWarning, match=r"solver_time_limit=60 s the solve may take up to about 420 s"):
        OSDPStrategy(timeout=timedelta(minutes=4), solver_time_limit=60)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OSDPStrategy(timeout=30, plan=Plan({"": "no_shard"}))  # nothing is solved


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4e9, 4_000_000_000),
        ("4e9", 4_000_000_000),
        ("+2GiB", 2 * 2**30),
        (".5GiB", 2**29),
        ("1.0001 KiB", 1024),
        ("3 B", 3),
        (2**50, 2**50),
    ],
)
def test_budgets_in_any_form_that_names_whole_bytes(value: Any, expected: int) -> None:
    assert parse_memory_budget(value) == expected


@pytest.mark.parametrize("value", ["0.1B", 0.5, "1.5B", 1e-3, "0", 0.0, math.nan, -math.inf, None, [512]])
def test_budgets_that_are_not_a_whole_positive_number_of_bytes_are_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="memory budget"):
        parse_memory_budget(value)


def test_lightning_cli_yaml_accepts_every_valid_value(tmp_path: Path) -> None:
    """jsonargparse converts YAML by the annotations: numbers for ``timeout`` and ``memory_budget``, ``"h:m:s"``
    strings for ``timeout``, lists for ``modes``."""
    from lightning.pytorch.cli import LightningCLI

    plan_path = Plan.uniform(TinyGPT(), "full_shard").save(tmp_path / "plan.json")
    configs = {
        "numbers": (
            "memory_budget: 4e9\ntimeout: 300\nsolver_time_limit: 5\nmemory_steps: 0\nmax_split: 2\n"
            "memory_headroom: 0.1\nmodes: [no_shard, full_shard]\nprocess_group_backend: gloo\nsolver: highs\n"
            "solver_gap: 0.01\n"
            f"plan_out: {tmp_path / 'out' / 'plan.json'}\nstart_method: spawn\nstate_dict_type: full\n"
        ),
        "strings": f'memory_budget: "512MiB"\ntimeout: "0:02:30"\nplan: {plan_path}\n',
    }
    strategies = {}
    for name, init_args in configs.items():
        config = tmp_path / f"{name}.yaml"
        indented = "".join(f"      {line}\n" for line in init_args.splitlines())
        config.write_text(
            "trainer:\n  accelerator: cpu\n  devices: 2\n  strategy:\n"
            f"    class_path: lightning_osdp.OSDPStrategy\n    init_args:\n{indented}"
        )
        cli = LightningCLI(TinyGPT, run=False, args=["--config", str(config)], save_config_callback=None)
        assert isinstance(cli.trainer.strategy, OSDPStrategy)
        strategies[name] = cli.trainer.strategy
    numbers, strings = strategies["numbers"], strategies["strings"]
    assert numbers.memory_budget == 4_000_000_000 and numbers.timeout == timedelta(seconds=300)
    assert numbers.planner_options.modes == ("no_shard", "full_shard") and numbers._memory_steps == 0
    assert numbers.planner_options.solver == "highs" and numbers.planner_options.gap == 0.01
    assert numbers._plan_out == tmp_path / "out" / "plan.json" and numbers.state_dict_type == "full"
    assert strings.memory_budget == 512 * 2**20 and strings.timeout == timedelta(minutes=2, seconds=30)
    assert strings.plan is not None and strings.plan.decisions == Plan.load(plan_path).decisions


def test_lightning_cli_yaml_reports_a_bad_value_by_argument(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  strategy:\n    class_path: lightning_osdp.OSDPStrategy\n"
        "    init_args:\n      memory_budget: 0.5\n"
    )
    # jsonargparse instantiates the strategy while parsing, and lists the constructor's message among its errors.
    with pytest.raises(ValueError, match=re.escape("OSDPStrategy(memory_budget=...): memory budget 0.5 is a fraction")):
        LightningCLI(TinyGPT, run=False, args=["--config", str(config)], save_config_callback=None)


# ================================================================================================ plan files
def test_a_deeply_nested_plan_file_is_a_plan_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)  # used to raise RecursionError
    with pytest.raises(PlanError, match="nested too deeply"):
        Plan.load(path)
    with pytest.raises(PlanError, match="nested too deeply"):
        OSDPStrategy(plan=path)


def test_a_plan_info_nested_beyond_what_can_be_saved_again_is_refused(tmp_path: Path) -> None:
    info: dict[str, Any] = {}
    leaf = info
    for _ in range(200):  # loads, but `Plan.save` beside a checkpoint would recurse out
        leaf["a"] = {}
        leaf = leaf["a"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "lightning_osdp.plan", "version": 1, "decisions": {}, "info": info}))
    with pytest.raises(PlanError, match="field 'info' is nested more than 64 levels deep"):
        Plan.load(path)


def test_a_directory_or_a_binary_file_as_plan_is_a_plan_error(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=re.escape(f"plan file {str(tmp_path)!r} is a directory")):
        OSDPStrategy(plan=tmp_path)  # used to raise IsADirectoryError
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(PlanError, match="not a plan file \\(not UTF-8 text"):
        Plan.load(binary)
