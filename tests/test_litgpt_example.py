"""The litgpt example (``examples/litgpt/finetune.py``): litgpt's fine-tuning loop under ``Fabric(strategy="osdp")``.

One run on 2 CPU processes, as ``docs/fabric.md`` says to run it, under a budget small enough that the planner shards
part of the model: a litgpt ``GPT`` built on the meta device, planned at its first forward (litgpt's sanity-check
validation), its weights read from the ``lit_model.pth`` the example wrote into the shards, fine-tuned with
accumulation under ``no_backward_sync``, clipping and a scheduler, and saved.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_osdp.checkpoint import saved_plan

from conftest import ROOT, child_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_litgpt_finetuning_trains_under_a_budget_that_makes_the_planner_shard(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "examples/litgpt/finetune.py",
        "--out-dir",
        str(tmp_path),
        "--max-steps",
        "10",
        "--memory-budget",
        "2MiB",
    ]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    plan = re.search(r"OSDP: (Plan\(.*\)) on 2 ranks, memory budget 2\.00 MiB per device", output)
    assert plan is not None, output[-4000:]
    assert "full_shard" in plan.group(1) or "shard_grad_op" in plan.group(1)
    assert "loaded 28 tensors from" in output  # the pretrained weights, into the shards
    losses = [float(x) for x in re.findall(r"Step \d+ \| loss train: ([\d.]+)", output)]
    assert len(losses) == 2
    val_loss = float(re.search(r"Final evaluation \| val loss: ([\d.]+)", output).group(1))  # type: ignore[union-attr]
    # From about ln(96) = 4.56 at random weights: the next-token rule is being learned.
    assert losses[1] < losses[0] < 4.0 and val_loss < 2.5
    saved = saved_plan(tmp_path / "final" / "lit_model.pth")  # a sharded checkpoint with its plan
    assert saved is not None and saved.plan is not None and saved.plan.summary() in plan.group(1)
    assert "transformer.wte.weight" in (saved.shapes or {})  # litgpt's own keys
