"""The README's demo: a real 2-process CPU run with strategy="osdp" through Lightning's subprocess launcher."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_demo_prints_the_plan_and_its_throughput(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "examples/demo.py", "--steps", "8", "--out", str(tmp_path)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "OSDP plan: Plan(" in out and "predicted peak" in out  # the solver's table, printed at setup
    run_line = r"run        : step 8: .*train_loss=[\d.]+.* \| Plan\((\d+) decisions: (.*)\) on 2 ranks"
    plan_line = re.search(run_line, out)
    assert plan_line and int(plan_line.group(1)) >= 1
    # The default budget is below what FULL_SHARD alone needs: the plan recomputes some blocks' activations.
    assert re.search(r"\d+ S?AC\b", plan_line.group(2)), plan_line.group(2)
    need_line = r"would need : DDP ([\d.]+) MiB, FSDP ([\d.]+) MiB per device \(predicted\); budget ([\d.]+) MiB"
    needs = re.search(need_line, out)
    assert needs and float(needs.group(3)) < float(needs.group(2)) < float(needs.group(1))
    throughput = re.search(r"throughput : ([\d.]+) steps/s, ([\d.]+) samples/s", out)
    assert throughput and float(throughput.group(1)) > 0
    # 2 processes x 16 samples per step
    assert float(throughput.group(2)) == pytest.approx(32 * float(throughput.group(1)), rel=1e-2)
    measured = r"rank 0 measured: step [\d.]+ ms \([^)]*; predicted [\d.]+ ms\), peak memory ([\d.]+) MiB \(predicted"
    peak = re.search(measured, out)
    assert peak and 0 < float(peak.group(1)) <= float(needs.group(3))  # the plan held the budget
    assert list(tmp_path.rglob("osdp_plan.json")), "the chosen plan is saved beside the logs"
