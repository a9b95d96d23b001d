"""Checkpoints on the device: a sharded checkpoint saved at the end of an epoch resumes to the uninterrupted run, and
``python -m lightning_osdp.checkpoint.consolidate`` turns it into one file that loads without OSDP.

TinyGPT under a mixed plan with a tied sharded group and split Linears, 20 samples 4 per batch: 5 steps an epoch, 2
epochs. The checkpoint is the end of epoch 0 (step 5): resumed mid-epoch, Lightning would read the epoch's data from
its start again (the loader keeps no state), and so would a run stopped by max_steps rather than max_epochs (seen
with Lightning 2.6.6 on CPU: after one batch the resumed run starts a new epoch).
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import (
    DEVICES,
    PARITY_RTOL,
    ROOT,
    deterministic_cuda,
    fit_tiny,
    relative_gap,
    run_with_default_optimizer,
    tensor_gap,
    with_foreach,
)

from distributed.checkpoint_runner import PLANS, Recorder

Record = Callable[[str, object], None]


@pytest.fixture(scope="module", autouse=True)
def _deterministic() -> Iterator[None]:
    with deterministic_cuda():
        yield


def save_and_resume(device: str, scratch: Path, foreach: bool | None) -> dict[str, Any]:
    """The whole run saving at each epoch's end, and a run resumed from the end of epoch 0."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_osdp import OSDPStrategy, Plan

    folder = scratch / f"foreach{foreach}"
    saver = ModelCheckpoint(folder, filename="{epoch}", save_on_train_epoch_end=True, save_top_k=-1)
    whole = Recorder((5,))
    _, model = fit_tiny(
        device,
        scratch,
        "32-true",
        OSDPStrategy(plan=Plan(PLANS["tied_split"])),
        foreach=foreach,
        max_epochs=2,
        callbacks=[saver, whole],
        samples=20,
    )
    path = folder / "epoch=0.ckpt"
    resumed = Recorder()
    _, resumed_model = fit_tiny(
        device,
        scratch,
        "32-true",
        OSDPStrategy(plan=Plan(PLANS["tied_split"])),
        foreach=foreach,
        max_epochs=2,
        callbacks=[resumed],
        ckpt_path=path,
        samples=20,
    )
    return {
        "path": path,
        "whole": {"losses": model.losses, "states": whole.states},
        "resumed": {"losses": resumed_model.losses, "states": resumed.states},
    }


@pytest.mark.parametrize("device", DEVICES)
def test_a_sharded_checkpoint_resumes_the_run_and_consolidates(
    device: str, tmp_path: Path, record_property: Record
) -> None:
    from lightning_osdp import checkpoint as ckpt

    from models import TinyGPT

    result, foreach, default_error = run_with_default_optimizer(
        device, lambda fe: save_and_resume(device, tmp_path, fe)
    )
    path: Path = result["path"]
    whole, resumed = result["whole"], result["resumed"]
    tail = whole["losses"][5:]
    gaps = {
        "steps_after_resume": len(resumed["losses"]),
        "loss_rel": max((relative_gap(a, b) for a, b in zip(resumed["losses"], tail, strict=False)), default=math.inf),
        "start_param_rel": max(
            tensor_gap(resumed["states"]["start"]["model"][k], v) for k, v in whole["states"][5]["model"].items()
        ),
        "end_param_rel": max(
            tensor_gap(resumed["states"]["end"]["model"][k], v) for k, v in whole["states"]["end"]["model"].items()
        ),
    }
    record_property("files", sorted(p.name for p in path.iterdir()) if path.is_dir() else None)
    record_property("resume", {**gaps, "foreach": foreach})
    # Consolidate in a fresh process without a process group, then load with plain Lightning.
    single = tmp_path / "consolidated.ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_osdp.checkpoint.consolidate", str(path), str(single)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    record_property("consolidate", {"returncode": proc.returncode, "stdout": proc.stdout.strip()[-300:]})

    assert ckpt.is_sharded_checkpoint(path), f"{path} is not a sharded checkpoint directory"
    assert len(resumed["losses"]) == len(tail), f"the resumed run took {len(resumed['losses'])} steps, not {len(tail)}"
    assert gaps["start_param_rel"] == 0.0, f"the restored parameters differ by {gaps['start_param_rel']:.2e}"
    rtol = PARITY_RTOL["32-true"]
    assert gaps["loss_rel"] <= rtol and gaps["end_param_rel"] <= rtol, (
        f"the resumed run ends {gaps['end_param_rel']:.2e} (parameters) and {gaps['loss_rel']:.2e} (losses) from the "
        f"uninterrupted one; tolerance {rtol:.0e}"
    )
    assert proc.returncode == 0, f"consolidate failed: {proc.stderr.strip()[-1000:]}"
    state = with_foreach(TinyGPT, foreach).load_from_checkpoint(single, map_location="cpu").state_dict()
    saved = whole["states"][5]["model"]
    assert set(state) == set(saved), "the consolidated file's keys are not the model's own"
    gap = max(tensor_gap(state[k], v) for k, v in saved.items())
    record_property("consolidated_param_rel", gap)
    assert gap == 0.0, f"the consolidated parameters differ from the saved ones by {gap:.2e}"
    assert default_error is None, default_error
