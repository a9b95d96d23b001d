"""The strategy as users reach it: by name, through LightningCLI, with launchers, and with bad input."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_osdp
from lightning_osdp import OSDPStrategy, Plan, PlanError

from models import TinyGPT, loaders


def _trainer(strategy: object, **kwargs: object) -> L.Trainer:
    defaults: dict[str, object] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, **defaults)  # type: ignore[arg-type]


def test_import_registers_the_strategy_name() -> None:
    assert "osdp" in StrategyRegistry
    trainer = L.Trainer(strategy="osdp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, OSDPStrategy)
    assert trainer.strategy.num_processes == 2
    assert trainer._accelerator_connector.is_distributed


def test_lightning_cli_yaml(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    plan_path = Plan.uniform(TinyGPT(), "full_shard").save(tmp_path / "plan.json")
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  strategy:\n"
        "    class_path: lightning_osdp.OSDPStrategy\n"
        "    init_args:\n"
        '      memory_budget: "512MiB"\n'
        f"      plan: {plan_path}\n"
    )
    cli = LightningCLI(TinyGPT, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OSDPStrategy)
    assert strategy.memory_budget == 512 * 2**20
    assert strategy.plan is not None and strategy.plan.decisions == Plan.load(plan_path).decisions


def test_malformed_plan_file_fails_at_construction(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "lightning_osdp.plan", "version": 1, "decisions": {"h.0": {"mode": "zero"}}}))
    with pytest.raises(PlanError, match="module 'h.0': field 'mode'"):
        OSDPStrategy(plan=path)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (Plan({"h.5": "full_shard"}), "plan names module 'h.5'"),
        (Plan({"h.0": ("full_shard", 2)}), "module 'h.0': split=2 needs an nn.Linear"),
        (Plan({"": "no_shard", "wte": "full_shard"}), "tied parameter 'wte.weight'"),
    ],
)
def test_bad_plans_fail_before_training(plan: Plan, message: str) -> None:
    model = TinyGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train, _ = loaders()
    with pytest.raises(PlanError, match=message):
        _trainer(OSDPStrategy(plan=plan)).fit(model, train)
    assert model.losses == []  # not one step ran
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


class _DestroyGlooGroupAtExit(L.Callback):
    """Lightning's ``ddp_spawn`` leaves its gloo group to the interpreter's finalization, where a rank can abort after
    a run that succeeded (see [Note: gloo groups at exit] in ``lightning_osdp/_compat.py``). The reference run's ranks
    register the exit handler OSDP's register, so that Lightning's DDP ranks are no more exposed than OSDP's."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import atexit

        from lightning.fabric.utilities.distributed import _destroy_dist_connection

        atexit.register(_destroy_dist_connection)


class _MarkAtExit(L.Callback):
    """Registers an exit handler in each rank that writes ``rank<N>`` into ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import atexit

        atexit.register((self.folder / f"rank{trainer.global_rank}").write_text, "ran")


@pytest.mark.distributed
@pytest.mark.slow
def test_spawn_launcher_returns_trained_weights_to_the_main_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The main process gets the full trained weights back, equal to Lightning's ``ddp_spawn``; the ranks end without
    the interpreter's finalization and still run their exit handlers (``lightning_osdp/launcher.py``)."""
    from conftest import free_port

    train, _ = loaders(n=16)
    results = {}
    for name, strategy in (
        ("ddp", "ddp_spawn"),
        (
            "osdp",
            OSDPStrategy(
                plan=Plan({"": "no_shard", "h.0": "full_shard", "h.1": "shard_grad_op"}), start_method="spawn"
            ),
        ),
    ):
        # A fresh port: an earlier single-process fit in this pytest process still holds its store's port.
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        L.seed_everything(0)
        model = TinyGPT()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        callbacks = [_DestroyGlooGroupAtExit()] if name == "ddp" else [_MarkAtExit(tmp_path)]
        _trainer(strategy, devices=2, max_steps=3, callbacks=callbacks).fit(model, train)
        results[name] = (initial, {k: v.clone() for k, v in model.state_dict().items()})
    for key, trained in results["osdp"][1].items():
        torch.testing.assert_close(trained, results["ddp"][1][key], rtol=1e-5, atol=1e-7, msg=key)
    assert any(not torch.equal(results["osdp"][0][k], v) for k, v in results["osdp"][1].items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_version_and_public_names() -> None:
    for name in lightning_osdp.__all__:
        assert getattr(lightning_osdp, name).__doc__, f"{name} has no docstring"


def test_measured_step_time_and_peak_memory_reach_the_logger(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    model = TinyGPT()
    train, _ = loaders()
    plan = Plan({"": "no_shard", "h.0": "full_shard"})
    strategy = OSDPStrategy(plan=plan)
    trainer = _trainer(strategy, max_steps=6, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1)
    trainer.fit(model, train)
    import csv

    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    peaks = [float(r["osdp/peak_memory_bytes"]) for r in rows if r.get("osdp/peak_memory_bytes")]
    times = [float(r["osdp/step_time_s"]) for r in rows if r.get("osdp/step_time_s")]
    assert len(times) == 6 and all(t > 0 for t in times)
    # Steps 0-2 ran under the memory tracker (3 memory steps), so only steps 3-5 are timed.
    assert len(peaks) == 3 and strategy.step_time == pytest.approx(sorted(times[3:])[1])
    # One rank: everything is local. The peak holds at least the parameters, their gradients and AdamW's two
    # states (4 x parameter bytes) plus the activations of a step.
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert peaks and strategy.peak_memory_bytes == max(peaks)
    assert strategy.peak_memory_bytes > 4 * param_bytes


def test_a_sharded_module_can_be_fitted_again_by_any_trainer(tmp_path: Path) -> None:
    """Notebook flow: fit, save, fit again (same or new Trainer, with the checkpoint); another plan is refused."""
    model = TinyGPT()
    train, _ = loaders()
    plan = Plan({"": "no_shard", "h.0": "full_shard"})
    first = _trainer(OSDPStrategy(plan=plan))
    first.fit(model, train)
    first.save_checkpoint(tmp_path / "step2.ckpt")
    first.fit(model, train, ckpt_path=tmp_path / "step2.ckpt")  # stale gradients must not confuse the resume
    second = _trainer(OSDPStrategy(plan=plan), max_steps=3)
    second.fit(model, train, ckpt_path=tmp_path / "step2.ckpt")
    assert second.global_step == 3 and len(model.losses) == 3
    assert second.strategy.plan is first.strategy.plan
    with pytest.raises(PlanError, match="already sharded under another plan"):
        _trainer(OSDPStrategy(plan=Plan({"": "full_shard"}))).fit(model, train)


def test_automatic_plan_is_checked_against_the_measured_step(tmp_path: Path) -> None:
    """No plan given: profile, solve, apply, train; after the first steps the prediction meets the measurement."""
    model = TinyGPT()
    train, _ = loaders()
    strategy = OSDPStrategy(memory_budget="1GiB", plan_out=tmp_path / "plan.json")
    _trainer(strategy, max_steps=5).fit(model, train)
    assert strategy.profile is not None and strategy.plan is not None
    assert strategy.plan.report is not None and strategy.plan.report.status == "optimal"
    # An ample budget on one rank: nothing to shard for, and every unit replicated.
    assert {d.mode for d in strategy.plan.decisions.values()} == {"no_shard"}
    assert Plan.load(tmp_path / "plan.json").decisions == strategy.plan.decisions
    assert (tmp_path / "plan.profile.json").exists()
    check = strategy.prediction_check
    assert check is not None and check.memory_ratio is not None and check.time_ratio is not None
    # Memory is predicted within the 10% (time depends on the machine's load; see the benchmark).
    assert abs(check.memory_ratio - 1) <= 0.10, check.message


@pytest.mark.slow
def test_one_rank_sharded_plans_are_predicted_without_an_all_gather_buffer() -> None:
    """On one rank FSDP2 fills the unsharded parameters from the shards directly, with no flat all-gather buffer;
    counting one would overstate a parameter-dominated model's peak by a block (~7% here)."""
    from lightning_osdp import predict, profile

    def model() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(width=255, hidden=1020, layers=3)

    train, _ = loaders(batch_size=2, n=16)
    prof = profile(model(), next(iter(train)))
    blocks = [f"h.{i}" for i in range(3)]
    for mode in ("full_shard", "shard_grad_op"):
        plan = Plan({"": mode, **{b: mode for b in blocks}})
        strategy = OSDPStrategy(plan=plan, memory_steps=3)
        _trainer(strategy, max_steps=3).fit(model(), train)
        measured = strategy.peak_memory_bytes
        assert measured is not None
        assert predict(prof, plan, 1).peak_bytes == pytest.approx(measured, rel=0.02), mode


def test_resume_reuses_the_saved_plan_and_profile_unless_the_budget_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train, _ = loaders()
    first = OSDPStrategy(memory_budget="1GiB", plan_out=tmp_path / "plan.json")
    trainer = _trainer(first)
    trainer.fit(TinyGPT(), train)
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    assert first.profile is not None and first.plan is not None

    same = OSDPStrategy(memory_budget="1GiB", plan_out=tmp_path / "plan2.json")
    with caplog.at_level("INFO"):
        _trainer(same, max_steps=3).fit(TinyGPT(), train, ckpt_path=tmp_path / "step2.ckpt")
    assert "reusing the plan saved in" in caplog.text
    assert same.plan is not None and same.plan.decisions == first.plan.decisions
    # No profiling: the profile is the saved one, figure for figure (a new profile would have re-measured times).
    assert same.profile is not None and same.profile.to_dict() == first.profile.to_dict()
    assert not (tmp_path / "plan2.json").exists()

    caplog.clear()
    changed = OSDPStrategy(memory_budget="2GiB", plan_out=tmp_path / "plan3.json")
    with caplog.at_level("INFO"):
        _trainer(changed, max_steps=3).fit(TinyGPT(), train, ckpt_path=tmp_path / "step2.ckpt")
    assert "re-planning: the memory budget changed" in caplog.text
    assert (tmp_path / "plan3.json").exists()


def test_setup_says_each_stage_as_it_starts_and_ends_with_its_seconds(caplog: pytest.LogCaptureFixture) -> None:
    train, _ = loaders()
    trainer, model = _trainer(OSDPStrategy(memory_budget="1GiB")), TinyGPT()
    with caplog.at_level("INFO"):
        trainer.fit(model, train)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("OSDP:")]
    stages = ["profiling the model", "solving the plan", "applying the plan"]
    for stage in stages:
        assert f"OSDP: {stage}..." in lines, stage
        assert any(line.startswith(f"OSDP: {stage}: ") and line.endswith(" s") for line in lines), stage
    # In order, each ended before the next started, and the last line sums them up.
    started = [lines.index(f"OSDP: {stage}...") for stage in stages]
    assert started == sorted(started)
    assert "measured" in next(line for line in lines if line.startswith("OSDP: profiling the model: "))
    assert "under 1.00 GiB per device" in next(line for line in lines if line.startswith("OSDP: solving the plan: "))
    assert any(line.startswith("OSDP: setup took ") for line in lines[started[-1] :])
    # Validating after fit sets up again with the plan applied: no stage runs, and no "setup took 0.0 s" is logged.
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer.validate(model, train, verbose=False)
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("OSDP: setup took")]


def test_an_accumulating_step_is_planned_with_the_gradients_held_between_its_micro_batches() -> None:
    import dataclasses

    from lightning_osdp import predict

    train, _ = loaders()
    strategy = OSDPStrategy(memory_budget="1GiB", memory_steps=4)
    _trainer(strategy, max_steps=4, accumulate_grad_batches=2).fit(TinyGPT(), train)
    assert strategy.profile is not None and strategy.plan is not None
    assert strategy.profile.gradient_accumulation == 2
    measured = strategy.peak_memory_bytes
    assert measured is not None
    predicted = predict(strategy.profile, strategy.plan, 1).peak_bytes
    # Micro-batch 2 runs its forward beside micro-batch 1's whole gradients: a walk of one micro-batch misses them.
    one_pass = predict(dataclasses.replace(strategy.profile, gradient_accumulation=1), strategy.plan, 1).peak_bytes
    assert one_pass < measured
    assert predicted == pytest.approx(measured, rel=0.01)  # as a plain step's (see the tests of memory_steps above)


class TanhGELU(torch.nn.Module):
    """GPT-2's activation as Hugging Face writes it: eight elementwise operators, each saving or making a tensor of
    the input's size, whose backward holds several gradients of that size at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


class WideActivation(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(16, 512), TanhGELU(), torch.nn.Linear(512, 16)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.down(self.act(self.up(batch))).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_modules_backward_is_planned_with_what_it_holds_beyond_its_input_gradient() -> None:
    import dataclasses

    from lightning_osdp import predict, profile

    batch = torch.randn(64, 16)
    prof = profile(WideActivation(), batch)
    act = prof.modules["act"]
    assert act.backward_transient_bytes is not None and act.backward_transient_bytes > act.output_bytes
    plan = Plan.uniform(WideActivation(), "no_shard")
    strategy = OSDPStrategy(plan=plan, memory_steps=3)
    loader = torch.utils.data.DataLoader(batch.repeat(4, 1), batch_size=64)
    _trainer(strategy, max_steps=3).fit(WideActivation(), loader)
    measured = strategy.peak_memory_bytes
    assert measured is not None
    assert predict(prof, plan, 1).peak_bytes >= measured
    # Without the measured transient, the walk counts the gradient of the input alone: below what ran.
    unmeasured = {n: dataclasses.replace(m, backward_transient_bytes=None) for n, m in prof.modules.items()}
    assert predict(dataclasses.replace(prof, modules=unmeasured), plan, 1).peak_bytes < measured
