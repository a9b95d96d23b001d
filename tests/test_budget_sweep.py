"""A plan that fits the budget is never exceeded at run time: real 2-rank runs from the smallest feasible budget
to DDP's requirement (tests/distributed/budget_runner.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import ROOT, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_measured_peak_stays_under_every_budget(tmp_path: Path) -> None:
    torchrun(ROOT / "tests" / "distributed" / "budget_runner.py", str(tmp_path))
    sweep = torch.load(tmp_path / "budgets.pt", weights_only=False)
    results = sweep["results"]
    assert sweep["low"] < sweep["ddp"]
    for r in results:
        assert 0 < r["peak"] <= r["budget"], f"measured {r['peak']} over the budget {r['budget']}: {r['plan']}"
    modes = [{d["mode"] for d in r["plan"]["decisions"].values()} for r in results]
    assert modes[-1] == {"no_shard"}  # DDP's requirement: the plan is DDP
    assert "full_shard" in modes[0]  # the smallest budget: sharded as far as it goes
    # Tighter budgets trade speed for memory: the measured peaks follow the budgets.
    assert results[0]["peak"] < results[-1]["peak"]
