"""The CUDA path: the checks of ``scripts/gpu_check.py`` (one source of truth, run by ``scripts/gpu_check.sh`` on a GPU
machine) as tests, and what of them the CPU can test honestly.

On the CPU: the comparison logic, the parity check itself in 32-true (the same code the GPU runs, on the CPU), the
runner's time budget and its "no CUDA device" answer, and two defects of the CUDA path that the CPU reproduces
(torch's foreach kernels refuse a list mixing plain tensors and DTensors: the optimizer step and the 16-mixed
unscale), each shown failing without OSDP's fix and passing with it. With a GPU: every check, ``pytest -m cuda``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import ROOT, torchrun

_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up there
_spec.loader.exec_module(gpu_check)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MIXED = {"": "no_shard", "h.0": "full_shard", "h.1": "shard_grad_op"}


# ============================================================================================== on the CPU
def test_run_comparison_reports_the_largest_relative_gaps() -> None:
    want = {"losses": [4.0, 2.0], "state": {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([[0.5]])}}
    got = copy.deepcopy(want)
    assert gpu_check.compare_runs(got, want) == {"loss_rel": 0.0, "param_rel": 0.0, "worst_param": "a", "steps": 2}
    got["losses"][1] = 2.1
    got["state"]["a"] = torch.tensor([1.0, -2.5])  # 0.5 off, relative to the tensor's largest element (2)
    gaps = gpu_check.compare_runs(got, want)
    assert gaps["loss_rel"] == pytest.approx(0.05)
    assert (gaps["param_rel"], gaps["worst_param"]) == (0.25, "a")
    with pytest.raises(ValueError, match="state-dict keys differ"):
        gpu_check.compare_runs({**got, "state": {"a": got["state"]["a"]}}, want)
    with pytest.raises(ValueError, match="took 1 and 2 steps"):
        gpu_check.compare_runs({**got, "losses": [4.0]}, want)


@pytest.mark.slow
def test_parity_check_in_32_true_on_the_cpu(tmp_path: Path) -> None:
    """The GPU's parity check, run on the CPU: the single-device reference, OSDP under three plans, the comparison.
    The first attempt uses foreach=True, CUDA's default, which the strategy turns off for mixed parameter groups
    (see test_a_mixed_plan_steps_with_the_foreach_optimizer): no failure, and no second attempt."""
    outcome = gpu_check.check_parity(gpu_check.Context("cpu", tmp_path), precisions=["32-true"])
    runs = outcome.figures["runs"]
    assert set(runs) == {"32-true/mixed", "32-true/sharded", "32-true/split"}
    # No split: the same operators on the same numbers, bit for bit.
    assert runs["32-true/mixed"]["loss_rel"] == runs["32-true/mixed"]["param_rel"] == 0.0
    assert runs["32-true/sharded"]["loss_rel"] == runs["32-true/sharded"]["param_rel"] == 0.0
    assert runs["32-true/sharded"]["foreach"] is True  # all-sharded: the foreach path works
    # A split Linear changes the matmuls' shapes, so their rounding: within the tolerance, not bit for bit.
    assert runs["32-true/split"]["param_rel"] <= gpu_check.PARITY_RTOL["32-true"]
    assert outcome.failures == []
    assert runs["32-true/mixed"]["foreach"] is True


def test_the_runner_bounds_every_check_by_the_budget_and_records_it(tmp_path: Path) -> None:
    """A check that outlives its share of the budget is killed and recorded; a check with no time left is skipped;
    the JSON says so and the exit status is 1."""
    status = gpu_check.run_all(tmp_path, "cpu", ["parity", "env"], budget=3.0, min_seconds=1.0)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 1 and report["status"] == "fail" and report["dry_run"] is True
    parity, env = report["checks"]["parity"], report["checks"]["env"]
    assert parity["status"] == "timeout" and parity["failures"] == ["timed out after 3 s"]
    assert 3.0 <= parity["seconds"] < 10.0
    assert env == {"status": "skipped", "failures": ["out of time budget (3 s)"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_the_runner_says_so_and_checks_nothing(tmp_path: Path) -> None:
    assert gpu_check.run_all(tmp_path, "cuda", list(gpu_check.CHECKS), budget=60.0) == 3
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "no CUDA device" and report["checks"] == {}
    assert "sees no CUDA device" in report["message"]


def _mixed_tiny_gpt(mesh: Any) -> tuple[nn.Module, nn.Module, nn.Module]:
    from lightning_osdp import Plan
    from lightning_osdp.apply import apply_plan

    from models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    root = apply_plan(model, Plan(MIXED), mesh=mesh)
    return model, reference, root


def _loss(call: Any) -> torch.Tensor:
    tokens = torch.randint(0, 37, (4, 9), generator=torch.Generator().manual_seed(0))
    return nn.functional.cross_entropy(call(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def test_a_mixed_plan_steps_with_the_foreach_optimizer(world1: object) -> None:
    """AdamW's foreach path (its default when every parameter is on CUDA) gets plain (no_shard) tensors and DTensors
    in one list, which DTensor refuses; the strategy turns foreach off for such groups
    (``lightning_osdp/apply/optimizer.py``). Without it the step raises; with it, it matches the unsharded model."""
    from lightning_osdp.apply.optimizer import step_mixed_groups_per_tensor

    broken, _, broken_root = _mixed_tiny_gpt(world1)
    unfixed = torch.optim.AdamW(broken.parameters(), lr=1e-2, foreach=True)
    _loss(broken_root).backward()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        unfixed.step()
    model, reference, root = _mixed_tiny_gpt(world1)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (model, reference)]
    assert step_mixed_groups_per_tensor(optimizers[0]) == [0]
    assert step_mixed_groups_per_tensor(optimizers[1]) == []  # all plain: foreach stays
    for _ in range(2):
        for optimizer, call in zip(optimizers, (root, reference), strict=True):
            optimizer.zero_grad()
            _loss(call).backward()
            optimizer.step()
        # The group's own setting outside the step: what a checkpoint records, as DDP's optimizer does.
        assert optimizers[0].state_dict()["param_groups"][0]["foreach"] is True
        # A loaded state (which replaces every group's hyperparameters) does not bring the foreach step back.
        optimizers[0].load_state_dict(optimizers[0].state_dict())
    from torch.distributed.tensor import DTensor

    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        value = got.full_tensor() if isinstance(got, DTensor) else got
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)


def test_the_sharded_grad_scaler_unscales_a_mixed_plan(world1: object) -> None:
    """16-mixed's ``ShardedGradScaler`` unscales with one foreach kernel over plain (no_shard) and DTensor
    gradients, which DTensor refuses; ``OSDPGradScaler`` (what the strategy's 16-mixed plugin uses) unscales each
    kind apart, and the unscaled gradients are the unsharded model's."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor

    from lightning_osdp.precision import OSDPGradScaler

    broken, _, broken_root = _mixed_tiny_gpt(world1)
    raw = ShardedGradScaler(device="cpu", init_scale=1024.0)
    raw.scale(_loss(broken_root)).backward()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        raw.unscale_(torch.optim.SGD(broken.parameters(), lr=0.1))

    model, reference, root = _mixed_tiny_gpt(world1)
    scaler = OSDPGradScaler(device="cpu", init_scale=1024.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(_loss(root)).backward()
    _loss(reference).backward()
    scaler.unscale_(optimizer)
    checked = 0
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        if want.grad is None:
            continue
        grad = got.grad.full_tensor() if isinstance(got.grad, DTensor) else got.grad
        torch.testing.assert_close(grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
        checked += 1
    assert checked > 0
    assert {isinstance(p, DTensor) for p in model.parameters()} == {True, False}  # the plan is mixed


# ============================================================================================== with a GPU
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", [n for n in gpu_check.CHECKS if n != "env"])
def test_gpu_check(name: str, tmp_path: Path) -> None:
    """Each check of scripts/gpu_check.py on the GPU (figures in the failure message when one misses)."""
    outcome = gpu_check.CHECKS[name].run(gpu_check.Context("cuda", tmp_path))
    assert outcome.failures == [], "\n".join(outcome.failures)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
def test_precisions_on_nccl(precision: str, tmp_path: Path) -> None:
    """Two NCCL ranks (two GPUs: two NCCL ranks cannot share one device; gpu_check's gloo2 covers one GPU)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for a 2-rank NCCL run")
    out = str(tmp_path)
    torchrun(
        ROOT / "tests" / "distributed" / "runner.py",
        out,
        f"ddp@{precision}",
        f"mixed@{precision}",
        env={"OSDP_TEST_ACCELERATOR": "cuda"},
    )
    from test_parity import assert_matches

    runs = {
        c: [torch.load(f"{out}/{c}@{precision}.rank{r}.pt", weights_only=False) for r in range(2)]
        for c in ("ddp", "mixed")
    }
    for rank in range(2):
        assert_matches(runs["mixed"][rank], runs["ddp"][rank], gpu_check.PARITY_RTOL[precision])
