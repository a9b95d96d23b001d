"""The plan file is a documented, versioned format; every bad entry is named in the error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from lightning_osdp import Decision, Plan, PlanError, default_units
from lightning_osdp.plan import MAX_PLAN_FILE_BYTES, PLAN_FORMAT, PLAN_VERSION

from conftest import ROOT, child_env
from models import TinyGPT


def test_save_load_round_trip(tmp_path: Path) -> None:
    plan = Plan({"": "no_shard", "h.0": ("full_shard", 1), "h.0.fc": {"mode": "full_shard", "split": 4}}, info={"a": 1})
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["format"] == PLAN_FORMAT and data["version"] == PLAN_VERSION
    assert data["decisions"]["h.0.fc"] == {"mode": "full_shard", "split": 4}
    loaded = Plan.load(path)
    assert loaded.decisions == plan.decisions
    assert loaded.decisions["h.0.fc"] == Decision("full_shard", 4)
    assert loaded.info == {"a": 1}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"format": "other", "version": 1, "decisions": {}}, "field 'format'"),
        ({"format": PLAN_FORMAT, "version": 99, "decisions": {}}, "version 99 is not supported"),
        ({"format": PLAN_FORMAT, "version": 1}, "field 'decisions'"),
        ({"format": PLAN_FORMAT, "version": 1, "decisions": {"h.0": {"mode": "zero3"}}}, "module 'h.0': field 'mode'"),
        (
            {"format": PLAN_FORMAT, "version": 1, "decisions": {"h.1": {"split": 2}}},
            "module 'h.1': field 'mode' is missing",
        ),
        (
            {"format": PLAN_FORMAT, "version": 1, "decisions": {"h.2": {"mode": "full_shard", "split": 0}}},
            "module 'h.2': field 'split'",
        ),
        (
            {"format": PLAN_FORMAT, "version": 1, "decisions": {"h.2": {"mode": "full_shard", "splt": 2}}},
            "module 'h.2': unknown field(s) ['splt']",
        ),
    ],
)
def test_malformed_plan_files_name_the_module_and_field(tmp_path: Path, document: dict, message: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Plan.load(path)


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(path)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")


# Loads each path (``strategy:PATH``: ``OSDPStrategy(plan=PATH)``) in an address space bounded to 512 MiB past what the
# imports took: a reader that ignored a file's size or kind fails here with MemoryError instead of exhausting the
# machine, and one that blocks on a FIFO is ended by the test's timeout.
_LOAD_BOUNDED = """
import json, resource, sys
from lightning_osdp import OSDPStrategy, Plan
with open("/proc/self/status") as f:
    used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (used + 512 * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
for path in sys.argv[1:]:
    try:
        if path.startswith("strategy:"):
            OSDPStrategy(plan=path.removeprefix("strategy:"))
        else:
            Plan.load(path)
        outcome = ["loaded", ""]
    except Exception as err:
        outcome = [type(err).__name__, str(err)]
    print(json.dumps([path, *outcome]), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/zero, FIFOs and /proc/self/status")
def test_a_plan_path_that_is_no_regular_file_or_too_large_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """Before: ``/dev/zero`` was read until the kernel killed the process, a FIFO without a writer blocked forever,
    a 400 MB file was read whole before its JSON was refused."""
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(4 * 2**30)  # sparse: 4 GiB of zeros that take no disk
    paths = ["/dev/zero", str(fifo), str(huge), "strategy:/dev/zero", f"strategy:{huge}"]
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_BOUNDED, *paths],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = {path: (kind, message) for path, kind, message in map(json.loads, proc.stdout.splitlines())}
    assert set(outcomes) == set(paths), proc.stdout
    for path, (kind, message) in outcomes.items():
        shown = path.removeprefix("strategy:")
        assert kind == "PlanError" and repr(shown) in message, (path, kind, message)
        assert "give the path of a plan's JSON file" in message, message
    assert "it is a character device, not a regular file" in outcomes["/dev/zero"][1]
    assert "it is a FIFO (named pipe), not a regular file" in outcomes[str(fifo)][1]
    assert "larger than 64 MiB, the most a plan file may be" in outcomes[str(huge)][1]


def test_a_plan_file_over_the_bound_is_refused_by_its_size_and_a_large_plan_is_far_below_it(tmp_path: Path) -> None:
    over = tmp_path / "over.json"
    with open(over, "wb") as f:
        f.truncate(MAX_PLAN_FILE_BYTES + 1)
    with pytest.raises(PlanError, match=rf"refusing to read plan file '{over}': it is larger than 64 MiB"):
        Plan.load(over)
    # 100,000 modules with long names, splits and recomputation: what a plan file can hold is well inside the bound.
    decisions = {
        f"model.layers.{i // 10}.mlp.{i % 10}.proj": Decision("full_shard", 4, "selective") for i in range(10**5)
    }
    large = Plan({"": "no_shard", **decisions}).save(tmp_path / "large.json")
    assert large.stat().st_size < MAX_PLAN_FILE_BYTES / 4
    assert len(Plan.load(large).decisions) == 10**5 + 1


def test_validate_against_the_model() -> None:
    model = TinyGPT()
    Plan({"": "no_shard", "h.0": "full_shard", "h.0.fc": ("full_shard", 4)}).validate(model)
    with pytest.raises(PlanError, match=r"module 'h.9'.*does not have.*did you mean 'h\.\d'"):
        Plan({"h.9": "full_shard"}).validate(model)
    with pytest.raises(PlanError, match="module 'h.0': split=2 needs an nn.Linear, got Block"):
        Plan({"h.0": ("full_shard", 2)}).validate(model)
    with pytest.raises(PlanError, match="module 'h.0.fc': split=128 exceeds out_features=85"):
        Plan({"h.0.fc": ("full_shard", 128)}).validate(model)


def test_unknown_mode_in_code() -> None:
    with pytest.raises(PlanError, match="module 'h.0': unknown mode 'zero3'"):
        Plan({"h.0": "zero3"})


def test_unit_of_is_the_nearest_decided_ancestor() -> None:
    plan = Plan({"": "no_shard", "h.0": "full_shard", "h.0.fc": ("full_shard", 2)})
    assert plan.unit_of("h.0.fc") == "h.0.fc"
    assert plan.unit_of("h.0.ln_1") == "h.0"
    assert plan.unit_of("h.1.fc") == ""
    assert plan.mode_of("h.0.attn.out_proj") == "full_shard"


def test_default_units_are_blocks() -> None:
    model = TinyGPT(layers=3)
    assert default_units(model) == ["h.0", "h.1", "h.2"]
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
    assert default_units(seq) == ["0", "2"]
    plan = Plan.uniform(model, "full_shard")
    assert set(plan.decisions) == {"", "h.0", "h.1", "h.2"}
    assert {d.mode for d in plan.decisions.values()} == {"full_shard"}


def test_recompute_is_spelled_in_python_and_json_and_older_files_load_unchanged(tmp_path: Path) -> None:
    plan = Plan(
        {
            "": "no_shard",
            "h.0": Decision("full_shard", recompute=True),
            "h.1": ("shard_grad_op", 1, "selective"),
            "h.2": {"mode": "no_shard", "recompute": "full"},
            "wte": Decision("full_shard", recompute=False),
        }
    )
    # True is "full", False is "none": the attribute always holds the string.
    assert [plan.decisions[f"h.{i}"].recompute for i in range(3)] == ["full", "selective", "full"]
    assert plan.decisions["wte"].recompute == "none" and not plan.decisions["wte"].recomputes
    assert Decision("full_shard", recompute=True) == Decision("full_shard", recompute="full")
    assert plan.summary() == "Plan(5 decisions: 2 no_shard, 1 shard_grad_op, 2 full_shard, 2 AC, 1 SAC)"
    data = json.loads(plan.save(tmp_path / "plan.json").read_text())
    assert data["version"] == 3
    assert data["decisions"]["h.0"] == {"mode": "full_shard", "split": 1, "recompute": "full"}
    assert data["decisions"]["h.1"] == {"mode": "shard_grad_op", "split": 1, "recompute": "selective"}
    assert data["decisions"][""] == {"mode": "no_shard", "split": 1}  # recompute only written when not "none"
    assert Plan.load(tmp_path / "plan.json").decisions == plan.decisions
    # A version-2 file (recompute true/false) loads unchanged: true is full recomputation, false none.
    v2 = {
        "format": "lightning_osdp.plan",
        "version": 2,
        "decisions": {
            "h.0": {"mode": "full_shard", "split": 1, "recompute": True},
            "h.1": {"mode": "no_shard", "recompute": False},
        },
    }
    assert Plan.from_dict(v2).decisions == {"h.0": Decision("full_shard", 1, "full"), "h.1": Decision("no_shard")}
    with pytest.raises(PlanError, match="must be true or false in a version-2 plan file, got 'selective'"):
        Plan.from_dict({**v2, "decisions": {"h.0": {"mode": "full_shard", "recompute": "selective"}}})
    # A version-1 file (before recompute existed) loads with recompute "none"; it never had the field.
    old = {"format": "lightning_osdp.plan", "version": 1, "decisions": {"h.0": {"mode": "full_shard", "split": 2}}}
    assert Plan.from_dict(old).decisions == {"h.0": Decision("full_shard", 2, "none")}
    old["decisions"]["h.0"]["recompute"] = True
    with pytest.raises(PlanError, match=r"unknown field\(s\) \['recompute'\]"):
        Plan.from_dict(old)
    with pytest.raises(
        PlanError,
        match="field 'recompute': recompute must be one of 'none', 'selective', 'full' .or true/false., got 'yes'",
    ):
        Plan.from_dict({**data, "decisions": {"h.0": {"mode": "full_shard", "recompute": "yes"}}})
    # The uniform plans take the strings too.
    model = TinyGPT()
    assert {
        d.recompute for n, d in Plan.uniform(model, "full_shard", recompute="selective").decisions.items() if n
    } == {"selective"}
    assert Plan.uniform(model, "no_shard", recompute=True).info["source"] == "uniform:no_shard+recompute"
    assert Plan.uniform(model, "no_shard", recompute="selective").info["source"] == "uniform:no_shard+selective"


def test_the_root_cannot_recompute() -> None:
    with pytest.raises(PlanError, match="the root decision '' cannot recompute"):
        Plan({"": Decision("no_shard", recompute=True)}).validate(TinyGPT())
