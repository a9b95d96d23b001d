"""OSDP's precision plugins: Lightning's own for every precision, clipping by global norm over a mixed plan's plain
and sharded gradients, a scaler that unscales both, and checkpoints that keep Lightning's keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_osdp import OSDPStrategy, Plan
from lightning_osdp.precision import (
    OSDPDoublePrecision,
    OSDPGradScaler,
    OSDPHalfPrecision,
    OSDPMixedPrecision,
    OSDPPrecision,
    osdp_precision,
)

from models import TinyGPT, TokenDataset

MIXED_PLAN = {"": "no_shard", "h.0": "full_shard", "h.1": "shard_grad_op"}


def _precision_args(precision: str) -> dict[str, Any]:
    # On CPU Lightning turns precision="16-mixed" into bf16-mixed; the plugin itself runs fp16 autocast on CPU.
    return {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}


@pytest.mark.parametrize(
    ("precision", "lightning", "osdp"),
    [
        ("32-true", Precision, OSDPPrecision),
        ("bf16-mixed", MixedPrecision, OSDPMixedPrecision),
        ("16-mixed", MixedPrecision, OSDPMixedPrecision),
        ("bf16-true", HalfPrecision, OSDPHalfPrecision),
        ("16-true", HalfPrecision, OSDPHalfPrecision),
        ("64-true", DoublePrecision, OSDPDoublePrecision),
    ],
)
def test_the_trainers_plugin_becomes_its_osdp_subclass(precision: str, lightning: type, osdp: type) -> None:
    trainer = L.Trainer(
        strategy=OSDPStrategy(), accelerator="cpu", devices=1, logger=False, **_precision_args(precision)
    )
    plugin = trainer.precision_plugin
    assert type(plugin) is osdp and isinstance(plugin, lightning)
    assert trainer.precision == precision
    if precision == "16-mixed":
        assert isinstance(plugin.scaler, OSDPGradScaler)


def test_a_given_scaler_keeps_its_settings() -> None:
    plugin = osdp_precision(
        MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7))
    )
    assert isinstance(plugin, OSDPMixedPrecision) and isinstance(plugin.scaler, OSDPGradScaler)
    assert plugin.scaler.get_scale() == 1024.0 and plugin.scaler.get_growth_interval() == 7
    ours = OSDPGradScaler("cpu", init_scale=8.0)
    assert osdp_precision(OSDPMixedPrecision("16-mixed", "cpu", ours)).scaler is ours


def test_other_plugins_are_refused_with_what_is_accepted() -> None:
    class Custom(Precision):
        pass

    with pytest.raises(
        TypeError, match="cannot use the precision plugin .*Custom: it works with Lightning's Precision"
    ):
        L.Trainer(strategy=OSDPStrategy(), plugins=[Custom()], accelerator="cpu", devices=1, logger=False)
    with pytest.raises(TypeError, match="subclass the OSDP plugin"):
        OSDPStrategy(precision_plugin=Custom())

    class Ours(OSDPMixedPrecision):
        pass

    custom = Ours("bf16-mixed", "cpu")
    assert OSDPStrategy(precision_plugin=custom).precision_plugin is custom


def _fit(strategy: Any, precision: str, clip: float | None, algorithm: str = "norm") -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    model = TinyGPT()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=3,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **_precision_args(precision),
    )
    trainer.fit(model, DataLoader(TokenDataset(16), batch_size=4))
    if isinstance(strategy, OSDPStrategy):
        return {k: v.float() for k, v in strategy.full_model_state_dict().items()}
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true"])
def test_clipping_by_norm_on_a_mixed_plan_matches_ddp(precision: str) -> None:
    # 16-true is left out: this model's fp16 weights overflow to NaN in three steps under DDP too.
    osdp = _fit(OSDPStrategy(plan=Plan(MIXED_PLAN)), precision, clip=0.05)
    ddp = _fit("ddp", precision, clip=0.05)
    unclipped = _fit("ddp", precision, clip=None)
    for key, value in ddp.items():
        torch.testing.assert_close(osdp[key], value, rtol=1e-6, atol=1e-6, msg=key)
    # The clip bound: without it the parameters end elsewhere.
    assert max((unclipped[k] - ddp[k]).abs().max().item() for k in ddp) > 1e-3


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_clipping_by_value_on_a_mixed_plan_matches_ddp(precision: str) -> None:
    osdp = _fit(OSDPStrategy(plan=Plan(MIXED_PLAN)), precision, clip=1e-3, algorithm="value")
    ddp = _fit("ddp", precision, clip=1e-3, algorithm="value")
    unclipped = _fit("ddp", precision, clip=None)
    for key, value in ddp.items():
        torch.testing.assert_close(osdp[key], value, rtol=1e-6, atol=1e-6, msg=key)
    assert max((unclipped[k] - ddp[k]).abs().max().item() for k in ddp) > 1e-3


def test_the_scaler_unscales_plain_and_sharded_gradients_and_finds_an_inf_in_either(world1: object) -> None:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    fully_shard(model[1], mesh=world1)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = OSDPGradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(5, 4)).sum()).backward()
    assert isinstance(model[1].weight.grad, DTensor) and not isinstance(model[0].weight.grad, DTensor)
    expected = {name: _full(p.grad) / 4 for name, p in model.named_parameters()}
    # Torch's own scaler refuses the mix.
    theirs = ShardedGradScaler("cpu", init_scale=4.0)
    theirs.scale(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        theirs.unscale_(optimizer)
    scaler.unscale_(optimizer)
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.grad), expected[name], msg=name)
    before = {name: _full(p).clone() for name, p in model.named_parameters()}
    scaler.step(optimizer)  # all finite: the step is taken with the unscaled gradients
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p), before[name] - 0.1 * expected[name], msg=name)

    for param in (model[0].bias, model[1].bias):  # an inf in a plain, then in a sharded gradient
        skipping = OSDPGradScaler("cpu", init_scale=4.0)
        skipping.scale(torch.tensor(1.0))
        before = {name: _full(p).clone() for name, p in model.named_parameters()}
        assert param.grad is not None
        param.grad.fill_(float("inf"))
        skipping.step(optimizer)
        skipping.update()
        assert skipping.get_scale() == 2.0  # backed off: the step was skipped
        for name, p in model.named_parameters():
            torch.testing.assert_close(_full(p), before[name], msg=name)
        param.grad.fill_(0.0)


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _trainer(strategy: Any, path: Path | None, max_steps: int, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=50))]
        if path is None
        else [MixedPrecision("16-mixed", "cpu")],
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.parametrize(("saver", "loader"), [("osdp", "ddp"), ("ddp", "osdp")])
def test_the_scaler_state_resumes_across_ddp_and_osdp(tmp_path: Path, saver: str, loader: str) -> None:
    def strategy(name: str) -> Any:
        return OSDPStrategy(plan=Plan(MIXED_PLAN), state_dict_type="full") if name == "osdp" else "ddp"

    data = DataLoader(TokenDataset(16), batch_size=4)
    first = _trainer(strategy(saver), None, max_steps=2)
    first.fit(TinyGPT(), data)
    scale = first.precision_plugin.scaler.get_scale()  # type: ignore[attr-defined]
    assert scale == 1024.0  # not the default 65536: what the resume must restore
    first.save_checkpoint(tmp_path / "step2.ckpt")
    saved = torch.load(tmp_path / "step2.ckpt", weights_only=False)
    assert saved["MixedPrecision"]["scale"] == 1024.0  # Lightning's key, whoever saved it

    second = _trainer(strategy(loader), tmp_path / "step2.ckpt", max_steps=2)
    second.fit(TinyGPT(), data, ckpt_path=tmp_path / "step2.ckpt")
    assert second.precision_plugin.scaler.get_scale() == 1024.0  # type: ignore[attr-defined]
