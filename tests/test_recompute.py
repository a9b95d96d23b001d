"""Recomputation (activation checkpointing) as the executor applies it and the cost model counts it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_osdp.apply import is_recomputed, recomputation_of, recompute_modules
from lightning_osdp.errors import PlanError

from conftest import ROOT, torchrun
from models import Block, TinyGPT


def test_recomputation_keeps_module_names_and_computes_the_same_gradients_with_dropout() -> None:
    torch.manual_seed(0)
    plain = Block(21, 85, dropout=0.3)
    recomputed = copy.deepcopy(plain)
    names = [n for n, _ in plain.named_modules()]
    recompute_modules(recomputed, [""])
    assert is_recomputed(recomputed) and not is_recomputed(plain)
    assert [n for n, _ in recomputed.named_modules()] == names  # plans and state-dict keys unchanged
    x = torch.randn(4, 16, 21)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    torch.manual_seed(1)
    y1 = plain(x1)
    torch.manual_seed(1)
    y2 = recomputed(x2)
    # The recomputation in backward runs dropout again: torch restores the RNG state, so the masks are the forward's
    # and every gradient is the plain module's, bit for bit.
    torch.manual_seed(99)  # what runs between forward and backward draws numbers too
    y1.square().sum().backward()
    torch.manual_seed(99)
    y2.square().sum().backward()
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    for (name, p1), p2 in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        assert torch.equal(p1.grad, p2.grad), name


class _Counting(nn.Module):
    """A forward that reads a buffer and then updates it in place: its output depends on how often it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * (1 + self.calls)
        self.calls.add_(1)
        return y


@pytest.mark.parametrize("how", ["full", "selective"])
@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), _Counting])
def test_recomputation_leaves_buffers_and_gradients_as_without_it(make: Any, how: str) -> None:
    # BatchNorm updates its running statistics in its forward: replayed as is, they would move twice per step.
    torch.manual_seed(0)
    plain = make()
    recomputed = copy.deepcopy(plain)
    recompute_modules(recomputed, [""], how)
    assert recomputation_of(recomputed) == how
    for step in range(3):
        x = torch.randn(2, 3, 6, 6) if isinstance(plain, nn.Sequential) else torch.randn(2, 4)
        for model in (plain, recomputed):
            model.zero_grad()
            model(x).square().sum().backward()
        for (name, a), b in zip(plain.named_buffers(), recomputed.buffers(), strict=True):
            assert torch.equal(a, b), (step, name)
        for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (step, name)
    # Evaluation does not checkpoint: it updates nothing, as without recomputation.
    plain.eval(), recomputed.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), recomputed(x))


def test_recomputation_saves_only_the_modules_inputs() -> None:
    torch.manual_seed(0)
    block = Block(63, 252)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    x = torch.randn(8, 32, 63, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    plain = sum(saved)
    saved.clear()
    recompute_modules(block, [""])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    assert sum(saved) < plain / 10  # the checkpoint's own records, not the block's activations


def _live_after_forward(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward leaves alive for backward beyond its input and output (what autograd or a checkpoint keeps)."""
    from lightning_osdp.memory import LiveStorageTracker

    tracker = LiveStorageTracker().start(block)
    start = tracker.mark()[1]
    y = block(x)
    kept = tracker.mark()[1] - start - y.untyped_storage().nbytes()
    tracker.stop()
    return kept


def test_selective_recomputation_keeps_the_matrix_products_and_attention_and_recomputes_the_rest() -> None:
    torch.manual_seed(0)
    plain = Block(63, 252, dropout=0.2)
    kept = {}
    for how in ("none", "selective", "full"):
        block = copy.deepcopy(plain)
        if how != "none":
            recompute_modules(block, [""], how)
        kept[how] = _live_after_forward(block, torch.randn(8, 32, 63, requires_grad=True))
    # What the policy keeps: the qkv and output projections (mm), fc and proj (addmm) and the attention's output and
    # log-sum-exp (the CPU's flash kernel), all fp32 over 8 x 32 tokens; not the norms, GELU, dropout or residuals.
    tokens, f = 8 * 32, 4
    matmuls = tokens * (3 * 63 + 63 + 252 + 63) * f
    attention = tokens * 63 * f + 8 * 3 * 32 * f
    assert kept["selective"] == matmuls + attention
    assert kept["full"] < kept["selective"] < kept["none"]
    # Gradients are the plain module's with dropout on: the replay restores the RNG state for the masks.
    x = torch.randn(4, 16, 63)
    selective = copy.deepcopy(plain)
    recompute_modules(selective, [""], "selective")
    results = []
    for block in (plain, selective):
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        y = block(xi)
        torch.manual_seed(2)
        y.square().sum().backward()
        results.append((y, xi.grad, [p.grad for p in block.parameters()]))
    (y1, g1, p1), (y2, g2, p2) = results
    assert torch.equal(y1, y2) and torch.equal(g1, g2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))


def test_a_kept_output_changed_in_place_is_refused_with_the_module_named() -> None:
    # nn.ReLU(inplace=True) right after a Linear overwrites the addmm output selective recomputation keeps: the
    # recomputation would be served the ReLU's result. Refused at the end of the forward, not silently wrong.
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)))
    recompute_modules(model, ["0"], "selective")
    with pytest.raises(
        PlanError, match=r"module '0': selective recomputation keeps the output of aten.addmm.*recompute='full'"
    ):
        model(torch.randn(3, 4, requires_grad=True))
    recompute_modules(model, ["0"], "full")  # full recomputation replays it as it ran
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()


@pytest.mark.distributed
def test_a_recomputed_sharded_unit_is_gathered_no_more_often_and_its_peak_is_predicted(tmp_path: Path) -> None:
    torchrun(ROOT / "tests" / "distributed" / "recompute_runner.py", str(tmp_path))
    results = json.loads((tmp_path / "recompute.json").read_text())
    # Checkpointing inside the FSDP2 unit: backward's own gather serves the recomputation. 3 full_shard blocks: 2
    # all-gathers each per step, with or without recomputation.
    assert results["full_shard"]["all_gathers"] == results["full_shard+recompute"]["all_gathers"] == 6
    # A full_shard unit nested in a recomputed block is gathered by its own pre-forward in the recomputation, and its
    # pre-backward finds it gathered: still 2 per step (the shard_grad_op block: 1).
    assert results["nested"]["all_gathers"] == results["nested+recompute"]["all_gathers"] == 3
    # Selective recomputation replays the same forward code: the same all-gathers.
    assert results["full_shard+selective"]["all_gathers"] == 6 and results["nested+selective"]["all_gathers"] == 3
    for name, r in results.items():
        assert r["predicted"] == pytest.approx(r["peak"], rel=0.10), name
    assert (
        results["full_shard+recompute"]["peak"]
        < results["full_shard+selective"]["peak"]
        < results["full_shard"]["peak"]
    )


def test_a_model_of_recomputed_blocks_trains_under_the_strategy_and_the_plan_says_so(tmp_path: Path) -> None:
    import lightning as L

    from lightning_osdp import Decision, OSDPStrategy, Plan

    from models import loaders

    train, _ = loaders()
    plan = Plan({"": "no_shard", **{f"h.{i}": Decision("no_shard", recompute=True) for i in range(3)}})
    model = TinyGPT()
    trainer = L.Trainer(
        strategy=OSDPStrategy(plan=plan),
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train)
    assert all(is_recomputed(model.h[i]) for i in range(3)) and not is_recomputed(model.ln_f)
    assert len(model.losses) == 3 and all(torch.isfinite(torch.tensor(model.losses)))
    assert "3 AC" in trainer.strategy.plan.summary()
    assert isinstance(model.h[0], nn.Module)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", "auto"), ("true", True), ("false", False), ("selective", "selective"), ("full", "full")],
)
def test_lightning_cli_yaml_accepts_every_activation_checkpointing_setting(
    tmp_path: Path, value: str, expected: object
) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_osdp import OSDPStrategy

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  strategy:\n"
        "    class_path: lightning_osdp.OSDPStrategy\n"
        "    init_args:\n"
        f"      activation_checkpointing: {value}\n"
    )
    cli = LightningCLI(TinyGPT, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OSDPStrategy) and strategy.activation_checkpointing == expected


def test_activation_checkpointing_rules_the_planners_choice() -> None:
    from lightning_osdp import OSDPStrategy, minimum_budget

    from synthetic import gpt_profile

    profile = gpt_profile(depth=4, width=128, tokens=256)
    budget = int(minimum_budget(profile, 2, recompute=False) / 0.95) + 1  # fits without recomputation, barely

    def recomputed(setting: object, memory_budget: int) -> set[str]:
        plan = OSDPStrategy(memory_budget=memory_budget, activation_checkpointing=setting).plan_for(profile, 2)
        assert plan.report is not None and plan.report.recompute == setting
        return {name for name, d in plan.decisions.items() if d.recomputes}

    def how(setting: object, memory_budget: int) -> set[str]:
        plan = OSDPStrategy(memory_budget=memory_budget, activation_checkpointing=setting).plan_for(profile, 2)
        return {d.recompute for name, d in plan.decisions.items() if name.startswith("model.blocks.")}

    blocks = {f"model.blocks.{i}" for i in range(4)}
    assert recomputed(False, budget) == set()  # the planner of releases before recomputation
    assert recomputed(True, budget) == blocks  # every unit that saves activations
    assert how(True, budget) == how("full", budget) == {"full"}
    assert recomputed("selective", budget) == blocks and how("selective", budget) == {"selective"}
    # Where recomputing is the cheaper way to fit, "auto" takes it.
    assert recomputed("auto", budget)
    # "auto" chooses among the three per unit: at the budget full recomputation alone fits (selective keeps too
    # much), it takes full; where selective fits, selective (a fraction of the replay).
    assert how("auto", budget) - {"none"}
    with pytest.raises(ValueError, match=r"activation_checkpointing='yes'.*expected 'auto'"):
        OSDPStrategy(activation_checkpointing="yes")


def test_a_budget_only_full_recomputation_meets_says_so_when_selective_is_forced() -> None:
    from lightning_osdp import minimum_budget
    from lightning_osdp.solver import InfeasibleBudgetError, solve

    from synthetic import gpt_profile

    profile = gpt_profile(depth=4, width=128, tokens=256)
    full, selective = minimum_budget(profile, 2, recompute="full"), minimum_budget(profile, 2, recompute="selective")
    none = minimum_budget(profile, 2, recompute=False)
    # Selective recomputation keeps the matrix products' outputs: its minimum lies between the other two.
    assert full < selective < none
    with pytest.raises(InfeasibleBudgetError, match=r"recompute fully .*activation_checkpointing='auto' or 'full'"):
        solve(profile, (full + selective) // 2, 2, recompute="selective")
    assert solve(profile, (full + selective) // 2, 2).report.predicted_peak_bytes <= (full + selective) // 2
