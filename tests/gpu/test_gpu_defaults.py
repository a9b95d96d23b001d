"""CUDA's defaults on a mixed plan, reproduced on the CPU: torch's foreach kernels refuse a list mixing plain tensors
and DTensors, which the optimizer step (AdamW's default on CUDA) and the 16-mixed unscale meet. Each is shown failing
without OSDP's fix and passing with it (see ``gpu_helpers`` [Note: the default optimizer on CUDA]); the GPU tests run
the device's default optimizer first, so they test the fixes there.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

MIXED = {"": "no_shard", "h.0": "full_shard", "h.1": "shard_grad_op"}


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
