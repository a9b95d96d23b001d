"""Parity on the device: ``OSDPStrategy(plan=...)`` at world size 1 against Lightning's single-device strategy, same
seed and data, per precision and plan; and two NCCL ranks against DDP where there are two GPUs.

TinyGPT trains 8 steps under a plan mixing every mode and an all-sharded one, in 32-true, bf16-mixed, bf16-true and
16-mixed (the grad scaler path), and in 32-true one with split Linears and the tied embedding/head as a sharded group:
losses per step and final parameters within :data:`~gpu_helpers.PARITY_RTOL` of the precision, and for 16-mixed the
same loss scale at the end. A split changes the matmuls' shapes and so their rounding, which in half precision is more
than the strategy's own effect: split plans run in 32-true only (docs/gpu.md, "Tolerances").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import (
    CUDA,
    NEEDS_CUDA,
    PARITY_RTOL,
    compare_runs,
    deterministic_cuda,
    fit_tiny,
    run_with_default_optimizer,
    tiny_run,
)

from conftest import ROOT, torchrun
from distributed.runner import PLANS

#: The plans, by the name the test ids use: every mode in one model (a replicated root, full_shard, shard_grad_op, a
#: sharded Linear inside a replicated block, a sharded frozen module), all sharded, and split Linears.
CASES = {"mixed": PLANS["mixed"], "sharded": PLANS["full_shard"], "split": PLANS["tied_split"]}
PARAMS = [
    *(
        pytest.param("cuda", precision, plan, marks=CUDA, id=f"cuda-{precision}-{plan}")
        for precision in PARITY_RTOL
        for plan in (CASES if precision == "32-true" else ("mixed", "sharded"))
    ),
    *(pytest.param("cpu", "32-true", plan, marks=pytest.mark.slow, id=f"cpu-32-true-{plan}") for plan in CASES),
]


@pytest.fixture(scope="module", autouse=True)
def _deterministic() -> Iterator[None]:
    with deterministic_cuda():
        yield


@pytest.fixture(scope="module")
def reference() -> Callable[[str, str, bool | None, Path], dict[str, Any]]:
    """The single-device run of a device, precision and optimizer path (foreach and per-tensor AdamW round
    differently), made when first asked for and kept for the module's other plans."""
    runs: dict[tuple[str, str, bool | None], dict[str, Any]] = {}

    def get(device: str, precision: str, foreach: bool | None, scratch: Path) -> dict[str, Any]:
        key = (device, precision, foreach)
        if key not in runs:
            runs[key] = tiny_run(*fit_tiny(device, scratch, precision, "auto", foreach=foreach))
        return runs[key]

    return get


@pytest.mark.parametrize(("device", "precision", "plan"), PARAMS)
def test_a_plan_trains_as_the_single_device_run(
    device: str,
    precision: str,
    plan: str,
    reference: Callable[[str, str, bool | None, Path], dict[str, Any]],
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    from lightning_osdp import OSDPStrategy, Plan

    got, foreach, default_error = run_with_default_optimizer(
        device,
        lambda fe: tiny_run(*fit_tiny(device, tmp_path, precision, OSDPStrategy(plan=Plan(CASES[plan])), foreach=fe)),
    )
    want = reference(device, precision, foreach, tmp_path / "reference")
    gaps = compare_runs(got, want)
    rtol = PARITY_RTOL[precision]
    record_property("plan", Plan(CASES[plan]).summary())
    record_property("parity", {**gaps, "rtol": rtol, "foreach": foreach, "scale": got["scale"], "ref": want["scale"]})
    assert gaps["loss_rel"] <= rtol, f"losses {gaps['loss_rel']:.2e} from the single-device run; tolerance {rtol:.0e}"
    assert gaps["param_rel"] <= rtol, (
        f"parameters {gaps['param_rel']:.2e} ({gaps['worst_param']}) from the single-device run; tolerance {rtol:.0e}"
    )
    if precision == "16-mixed":
        assert got["scale"] == want["scale"], f"loss scale {got['scale']} at the end, {want['scale']} single-device"
    assert default_error is None, default_error


def test_the_comparison_reports_the_largest_relative_gaps() -> None:
    want = {"losses": [4.0, 2.0], "state": {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([[0.5]])}}
    got = copy.deepcopy(want)
    assert compare_runs(got, want) == {"loss_rel": 0.0, "param_rel": 0.0, "worst_param": "a", "steps": 2}
    got["losses"][1] = 2.1
    got["state"]["a"] = torch.tensor([1.0, -2.5])  # 0.5 off, relative to the tensor's largest element (2)
    gaps = compare_runs(got, want)
    assert gaps["loss_rel"] == pytest.approx(0.05)
    assert (gaps["param_rel"], gaps["worst_param"]) == (0.25, "a")
    with pytest.raises(ValueError, match="state-dict keys differ"):
        compare_runs({**got, "state": {"a": got["state"]["a"]}}, want)
    with pytest.raises(ValueError, match="took 1 and 2 steps"):
        compare_runs({**got, "losses": [4.0]}, want)


@pytest.mark.cuda
@NEEDS_CUDA
@pytest.mark.parametrize("precision", list(PARITY_RTOL))
def test_two_nccl_ranks_train_as_ddp(precision: str, tmp_path: Path) -> None:
    """Two NCCL ranks, a mixed plan against Lightning's DDP (two GPUs: two NCCL ranks cannot share one device;
    ``test_gpu_gloo2.py`` runs two ranks on one GPU over gloo)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for a 2-rank NCCL run")
    from test_parity import assert_matches

    out = str(tmp_path)
    env = {"OSDP_TEST_ACCELERATOR": "cuda"}
    torchrun(ROOT / "tests" / "distributed" / "runner.py", out, f"ddp@{precision}", f"mixed@{precision}", env=env)
    runs = {
        case: [torch.load(f"{out}/{case}@{precision}.rank{r}.pt", weights_only=False) for r in range(2)]
        for case in ("ddp", "mixed")
    }
    for rank in range(2):
        assert_matches(runs["mixed"][rank], runs["ddp"][rank], PARITY_RTOL[precision])
