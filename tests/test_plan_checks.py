"""A plan is checked against the model before anything is changed: a split only where it computes what the module
computed, DDP only where it has something to synchronise."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_osdp import OSDPStrategy, Plan, PlanError, SplitLinear, apply_plan

from models import TinyGPT, loaders


class ScaledLinear(nn.Linear):
    """An ``nn.Linear`` subclass with a forward of its own (a LoRA-style or scaled layer)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(super().forward(x)) * 2


class TaggedLinear(nn.Linear):
    """A subclass that keeps ``nn.Linear.forward``: splitting it is exact."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scaled = ScaledLinear(16, 12)
        self.tagged = TaggedLinear(12, 12)
        self.attn = nn.MultiheadAttention(12, num_heads=2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tagged(self.scaled(x))
        return self.attn(h, h, h, need_weights=False)[0]


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_linear_subclass_with_its_own_forward_is_not_split() -> None:
    model = Net()
    x = torch.randn(3, 5, 16)
    # What a split would compute: nn.Linear's forward on the slices, not the subclass's: outputs change.
    sliced = torch.cat(
        [
            nn.functional.linear(x, w, b)
            for w, b in zip(model.scaled.weight.chunk(2), model.scaled.bias.chunk(2), strict=True)
        ],
        -1,
    )
    assert (sliced - model.scaled(x)).abs().max() > 0.1
    with pytest.raises(
        PlanError, match="module 'scaled': split=2 needs nn.Linear's own forward, and ScaledLinear defines"
    ):
        Plan({"scaled": ("full_shard", 2)}).validate(model)
    with pytest.raises(ValueError, match="ScaledLinear defines its own forward"):
        SplitLinear(model.scaled, 2)


def test_a_linear_subclass_that_keeps_linear_s_forward_is_split_exactly() -> None:
    model = Net()
    x = torch.randn(3, 5, 12)
    Plan({"tagged": ("full_shard", 3)}).validate(model)
    split = SplitLinear(model.tagged, 3)
    torch.testing.assert_close(split(x), model.tagged(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(split.merged().weight, model.tagged.weight, rtol=0, atol=0)


def test_multihead_attention_s_output_projection_is_not_split() -> None:
    """MultiheadAttention reads ``out_proj.weight`` itself; before, a split failed inside torch at the first forward."""
    with pytest.raises(
        PlanError, match="module 'attn.out_proj': split=2 needs a module that is called: MultiheadAttention"
    ):
        Plan({"attn.out_proj": ("full_shard", 2)}).validate(Net())


@pytest.mark.parametrize(
    ("prepare", "message"),
    [
        (
            lambda m: m.tagged.register_forward_hook(lambda *_: None),
            "needs a module without hooks: it has forward hooks",
        ),
        (
            lambda m: m.tagged.register_buffer("scale", torch.ones(1)),
            "needs a Linear with no state besides its weight and bias (TaggedLinear has scale)",
        ),
        (lambda m: nn.utils.parametrizations.weight_norm(m.tagged), "needs a Linear without submodules"),
    ],
)
def test_a_linear_with_more_than_weight_and_bias_is_not_split(prepare: object, message: str) -> None:
    model = Net()
    assert callable(prepare)
    prepare(model)
    with pytest.raises(PlanError) as info:
        Plan({"tagged": ("full_shard", 2)}).validate(model)
    assert f"module 'tagged': split=2 {message}" in str(info.value)


def test_an_unsplittable_module_in_a_hand_plan_fails_before_training() -> None:
    model = TinyGPT()
    before = _state(model)
    with pytest.raises(PlanError, match="module 'h.1.attn.out_proj': split=3"):
        L.Trainer(
            strategy=OSDPStrategy(plan=Plan({"": "no_shard", "h.1.attn.out_proj": ("full_shard", 3)})),
            accelerator="cpu",
            devices=1,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(model, loaders()[0])
    assert model.losses == []
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_replicating_a_model_with_no_trainable_parameters_is_a_plan_error(world1: object) -> None:
    """DDP refuses such a model in its constructor; the plan check says why first, and changes nothing."""
    model = TinyGPT().requires_grad_(False)
    before = _state(model)
    with pytest.raises(PlanError, match="no trainable parameters .* nothing for DDP to synchronise"):
        apply_plan(model, Plan({"": "no_shard", "h.0.fc": ("no_shard", 5)}), mesh=world1)  # type: ignore[arg-type]
    assert isinstance(model.h[0].fc, nn.Linear)  # not split
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # As the message says, a frozen model with a sharded unit runs (evaluation on several ranks).
    frozen = TinyGPT().requires_grad_(False)
    tokens = torch.randint(0, 37, (2, 8))
    expected = frozen(tokens)
    root = apply_plan(frozen, Plan({"": "no_shard", "h.0": "full_shard"}), mesh=world1)  # type: ignore[arg-type]
    torch.testing.assert_close(root(tokens), expected, rtol=0, atol=0)


def test_a_decision_on_a_module_without_parameters_is_a_plan_error_naming_it() -> None:
    """A torchmetrics metric (``val_loss``) holds no parameters: before, FSDP2 failed in setup with a raw
    ``AssertionError: No FSDP state found on FSDPMeanMetric()``."""
    model = TinyGPT()
    with pytest.raises(PlanError, match=r"module 'val_loss' \(MeanMetric\), which holds no parameters"):
        Plan({"": "no_shard", "val_loss": "full_shard"}).validate(model)
    with pytest.raises(PlanError, match=r"'val_loss' \(MeanMetric\), which holds no parameters"):
        _fit(model, Plan({"": "no_shard", "val_loss": "full_shard"}))
    assert model.losses == []


def test_sharding_multihead_attention_s_output_projection_on_its_own_is_a_plan_error() -> None:
    """FSDP2's hooks on ``attn.out_proj`` never fire (MultiheadAttention reads the weight itself): before, the first
    forward failed with "got mixed torch.Tensor and DTensor"."""
    with pytest.raises(PlanError, match=r"module 'h.0.attn.out_proj': full_shard needs a module that is called"):
        Plan({"": "no_shard", "h.0.attn.out_proj": "full_shard"}).validate(TinyGPT())
    Plan({"": "no_shard", "h.0.attn.out_proj": "no_shard", "h.0.attn": "full_shard"}).validate(TinyGPT())


@pytest.mark.parametrize(
    ("decisions", "message"),
    [
        ({"": "no_shard", "h.7": "full_shard"}, r"plan names module 'h.7', which the model does not have"),
        ({"": "no_shard", "h.0.fc": ("full_shard", 86)}, r"module 'h.0.fc': split=86 exceeds out_features=85"),
    ],
)
def test_a_given_plan_that_does_not_fit_fails_before_the_model_is_touched(decisions: dict, message: str) -> None:
    """Validation is the first thing setup does: under ``bf16-true`` the model is still float32 afterwards (before,
    it had been cast, and moved, when the plan was found wrong)."""
    model = TinyGPT()
    with pytest.raises(PlanError, match=message):
        _fit(model, Plan(decisions), precision="bf16-true")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _fit(model: L.LightningModule, plan: Plan, **trainer: object) -> None:
    L.Trainer(
        strategy=OSDPStrategy(plan=plan),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer,  # type: ignore[arg-type]
    ).fit(model, loaders()[0])
