"""Memory around the loss: what the profile measures of the loss region, where the cost model counts it, and a run
over its budget correcting the profile it plans from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_osdp import InfeasibleBudgetError, ModelProfile, OSDPStrategy, Plan, predict, profile
from lightning_osdp.cost_model import CostModelConfig
from lightning_osdp.profiling.model_profile import PROFILE_VERSION, CollectiveFit, LossMemory
from lightning_osdp.solver import minimum_budget, solve

from models import BackwardBuffer, TinyGPT, loaders, quiet_trainer, step_over_budget
from synthetic import one_linear

N, V = 16, 1000  # tokens and vocabulary of the head below: its logits are N * V * 4 = 64,000 bytes
LOGITS = N * V * 4


class Head(L.LightningModule):
    """``Linear(8, 8)`` then an LM head ``Linear(8, V)``; cross-entropy in ``training_step``."""

    def __init__(self, *, keep_logits: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, V, bias=False)
        self.keep_logits = keep_logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        x, y = batch
        logits = self.head(self.body(x))
        loss = F.cross_entropy(logits, y)
        return {"loss": loss, "logits": logits} if self.keep_logits else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 8, generator=g), torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize("mode", ["measured", "estimated"])
def test_the_loss_region_of_a_cross_entropy_head_by_hand(mode: str) -> None:
    measured = profile(Head(), _batch(), mode=mode).loss
    # The region starts with the logits in hand. Cross-entropy is log-softmax (saved for backward: a logits-sized
    # tensor) and nll_loss (the loss and its total weight, 4 bytes each); when training_step returns, nothing keeps
    # the logits. In backward the log-softmax's gradient and the logits' exist together; when the head's backward
    # starts, the logits' gradient has replaced the log-softmax.
    assert measured == LossMemory(
        output_bytes=LOGITS,
        forward_peak_bytes=LOGITS + 8,
        backward_start_bytes=LOGITS + 8 - LOGITS,
        backward_peak_bytes=2 * LOGITS,
        backward_end_bytes=LOGITS - LOGITS,
        outside_activation_bytes=0,
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_allocator_measures_the_same_region() -> None:
    """On CUDA the region is read from the caching allocator's statistics: the same figures as the CPU's storages,
    each tensor rounded up to 512 bytes (the scalars), for the 64,000-byte logits none."""
    x, y = _batch()
    measured = profile(Head().cuda(), (x.cuda(), y.cuda()), mode="measured").loss
    assert measured is not None and measured.output_bytes == LOGITS
    assert LOGITS <= measured.forward_peak_bytes <= LOGITS + 2 * 512
    assert 0 <= measured.backward_start_bytes <= 2 * 512
    assert measured.backward_peak_bytes == pytest.approx(2 * LOGITS, abs=2 * 512)


def test_a_returned_dict_keeps_the_logits_to_the_end_of_the_step() -> None:
    """Lightning keeps ``training_step``'s dict until the optimizer step: so does the profiled step."""
    loss = profile(Head(keep_logits=True), _batch()).loss
    assert loss is not None
    assert loss.backward_start_bytes == LOGITS + 8  # the logits are still alive when backward starts
    # ... and after the loss's backward: the timeline keeps them to the end of the step.
    assert loss.outside_activation_bytes + loss.backward_start_bytes + loss.backward_end_bytes == LOGITS + 8


def _linear_profile(**fields: Any) -> ModelProfile:
    """A root holding one Linear(4 -> 3), fp32 (60 bytes), AdamW, on 2 ranks: its figures are set by hand."""
    fits = {op: CollectiveFit(op, 2, 1e-3, 1e6) for op in ("all_gather", "reduce_scatter", "all_reduce")}
    return one_linear(root_output_bytes=60, collectives=fits, extra_activation_bytes=20, **fields)


CONFIG = CostModelConfig(copy_bytes_per_second=1e6, ddp_bucket_bytes=120)
LOSS = LossMemory(
    output_bytes=60,
    forward_peak_bytes=70,
    backward_start_bytes=-50,
    backward_peak_bytes=130,
    backward_end_bytes=60,
    outside_activation_bytes=10,
)


def test_the_timeline_counts_the_loss_region_at_its_instants() -> None:
    """Linear(4 -> 3) replicated (DDP) on 2 ranks, by hand: the persistent state is its parameters (60), their
    bucket (60) and AdamW's state (128): 248; its forward saves 100 bytes of activations."""
    plan = Plan({"": "no_shard", "a": "no_shard"})
    before = dict(predict(_linear_profile(), plan, config=CONFIG).instants)
    after = dict(predict(_linear_profile(loss=LOSS), plan, config=CONFIG).instants)
    level = 248 + 100
    # A profile without the region (version 2) counts activations saved outside modules and the last output.
    assert before["loss"] == before["loss backward"] == level + 20 + 60
    # The loss: the level, the activations saved outside modules before it, the logits and the forward peak.
    assert after["loss"] == level + 10 + 60 + 70
    # Backward starts with what the region kept (10 + 60 - 50), the loss's backward adds its peak.
    assert after["loss backward"] == level + 20 + 130
    # From the first module's backward on, it keeps 10 - 50 + 60 = 20 beyond its output gradient (which that module's
    # instant counts: autograd's gradient before DDP's copy, 60, and the output gradient, 60), to the step's end.
    assert after["backward a"] == level + 20 + 60 + 60 == before["backward a"] + 20
    assert after["optimizer step"] == before["optimizer step"] + 20
    assert after["step start"] == before["step start"] == 248
    # DDP rebuilds its buckets at the second step with the old ones alive: one more bucket at the start.
    assert after["second step: DDP rebuilds its buckets"] == 248 + 60


def test_a_measured_correction_is_held_all_step_and_planned_with() -> None:
    plain = _linear_profile(loss=LOSS)
    corrected = plain.with_correction(1000)
    assert corrected.measured_peak_correction == 1000 and corrected.with_correction(0) == corrected
    with pytest.raises(ValueError, match="only grows"):
        corrected.with_correction(-1)
    for mode in ("no_shard", "full_shard"):
        plan = Plan({"": "no_shard", "a": mode})
        old, new = (predict(p, plan, config=CONFIG).instants for p in (plain, corrected))
        assert [label for label, _ in new] == [label for label, _ in old]
        assert [b for _, b in new] == [b + 1000 for _, b in old], mode
    # The solver adds it to every instant too: the smallest feasible budget grows by it, and a budget that fitted the
    # plan before no longer does.
    low = minimum_budget(plain, 2, config=CONFIG)
    assert minimum_budget(corrected, 2, config=CONFIG) == low + 1000
    assert solve(plain, low, 2, config=CONFIG).report is not None
    with pytest.raises(InfeasibleBudgetError):
        solve(corrected, low, 2, config=CONFIG)


def test_profiles_of_version_2_load_without_a_loss_region(tmp_path: Path) -> None:
    measured = profile(Head(), _batch())
    path = measured.save(tmp_path / "v3.profile.json")
    data = json.loads(path.read_text())
    assert data["version"] == PROFILE_VERSION and data["loss"]["output_bytes"] == LOGITS
    assert ModelProfile.load(path) == measured
    del data["loss"], data["measured_peak_correction"]
    data["version"] = 2
    (tmp_path / "v2.profile.json").write_text(json.dumps(data))
    old = ModelProfile.load(tmp_path / "v2.profile.json")
    assert old.loss is None and old.measured_peak_correction == 0
    assert old == dataclasses.replace(measured, loss=None)


def _fit(strategy: OSDPStrategy, callback: Callback, steps: int, **kwargs: Any) -> L.Trainer:
    trainer = quiet_trainer(
        strategy,
        devices=1,
        max_steps=steps,
        callbacks=[callback],
    )
    trainer.fit(TinyGPT(), loaders()[0], **kwargs)
    return trainer


def test_a_run_over_its_budget_warns_and_the_next_run_plans_with_the_correction(tmp_path: Path) -> None:
    train, _ = loaders()
    needed = predict(profile(TinyGPT(), next(iter(train))), Plan.uniform(TinyGPT(), "no_shard"), 1).peak_bytes
    budget = needed + 1  # DDP (the only plan on one rank) fits with no headroom to spare
    strategy = OSDPStrategy(memory_budget=budget, memory_headroom=0.0, plan_out=tmp_path / "plan.json")
    with pytest.warns(UserWarning, match="over the memory budget") as caught:
        trainer = _fit(strategy, BackwardBuffer(needed), steps=5)
    measured, profiled = strategy.peak_memory_bytes, strategy.profile
    assert measured is not None and measured > budget and profiled is not None
    predicted = predict(dataclasses.replace(profiled, measured_peak_correction=0), strategy.plan, 1).peak_bytes
    assert predicted <= budget
    (message,) = [str(w.message) for w in caught if step_over_budget(str(w.message))]
    assert f"({measured} bytes)" in message and f"({budget} bytes)" in message and f"({predicted} bytes)" in message
    # Recorded in the profile in force, in the file beside the plan, and in the checkpoint saved after.
    assert profiled.measured_peak_correction == measured - predicted > 0
    assert ModelProfile.load(tmp_path / "plan.profile.json").measured_peak_correction == measured - predicted
    assert predict(profiled, strategy.plan, 1).peak_bytes == measured
    trainer.save_checkpoint(tmp_path / "over.ckpt")
    # The next run resumes from it at the same budget: it plans from the saved profile with the correction, which no
    # plan fits on one rank, and says how much budget it would take: the smallest peak grown by the correction.
    again = OSDPStrategy(memory_budget=budget, memory_headroom=0.0)
    with pytest.raises(InfeasibleBudgetError) as error:
        _fit(again, BackwardBuffer(needed), steps=6, ckpt_path=tmp_path / "over.ckpt")
    uncorrected = minimum_budget(dataclasses.replace(profiled, measured_peak_correction=0), 1)
    assert error.value.minimum == uncorrected + profiled.measured_peak_correction > budget
