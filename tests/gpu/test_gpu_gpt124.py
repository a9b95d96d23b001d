"""The cost model on the device: the example GPT at GPT-2 small's shape (124M parameters, context 1024, vocabulary
50304, batch 32, bf16-mixed), 12 steps per plan, predicted against measured peak memory and step time.

The plans: the planner's own (the strategy profiles the model on this device and solves), all ``full_shard``, half the
blocks sharded, every block ``full_shard`` and recomputed (``Plan.uniform(..., recompute=True)``), and the planner's
plan under a budget that only recomputation meets (``plan_model`` picks ``Decision(recompute=True)`` for some
blocks); then ``osdp plan --hardware h200-sxm``, the dry run on data-sheet figures, against the same measurements.

Each run reads three figures: the strategy's measured peak (``strategy.peak_memory_bytes``, over its step window), the
allocator's (``torch.cuda.max_memory_allocated`` read around each batch by :class:`~gpu_helpers.BatchMeter`) and the
strategy's median step (``strategy.step_time``). The strategy's peak is the allocator's, or at most
:data:`~gpu_helpers.ALLOCATOR_SLACK` below it; the predicted peak within 10% of both; the predicted step within 15% of
the measured one. On the CPU (a small GPT in 32-true) memory is judged the same way and step time only recorded.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from gpu_helpers import (
    ALLOCATOR_SLACK,
    DEVICES,
    MEMORY_TOLERANCE,
    QUIET,
    ROOT,
    TIME_TOLERANCE,
    BatchMeter,
    gib,
    relative_gap,
    release_memory,
    run_with_default_optimizer,
    with_foreach,
)

Record = Callable[[str, object], None]


@dataclass(frozen=True)
class Shape:
    """The GPT run: GPT-2 small's shape on CUDA, a small one on the CPU."""

    model: dict[str, Any]
    batch: int
    steps: int
    precision: str
    skip: int  # steps left out of the callback's median step time (lazy init, optimizer state, allocator warm-up)


SHAPES = {
    "cuda": Shape(
        {"vocab_size": 50304, "context_length": 1024, "width": 768, "depth": 12, "heads": 12}, 32, 12, "bf16-mixed", 3
    ),
    "cpu": Shape({"vocab_size": 256, "context_length": 64, "width": 64, "depth": 2, "heads": 4}, 4, 8, "32-true", 3),
}


def gpt_class() -> type[L.LightningModule]:
    """The example's ``GPTModule`` (``examples/gpt/gpt.py``)."""
    if str(ROOT / "examples" / "gpt") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from gpt import GPTModule

    return GPTModule


def fit_gpt(device: str, scratch: Path, plan: Any, foreach: bool | None) -> tuple[dict[str, Any], Any, Any]:
    """Train the GPT ``shape.steps`` steps under ``OSDPStrategy(plan=plan)`` (``None``: the planner's plan); returns
    the measurements, the profile (the planner's run only) and the plan in force. Nothing of the run stays alive
    afterwards: what it left allocated would count in the next run's peak."""
    from torch.utils.data import DataLoader

    from lightning_osdp import OSDPStrategy

    shape = SHAPES[device]
    release_memory()
    L.seed_everything(0, verbose=False)
    strategy = OSDPStrategy(plan=plan, plan_out=scratch / "gpt_plan.json")
    model = with_foreach(gpt_class(), foreach)(**shape.model, lr_schedule="constant")
    tokens = torch.randint(  # windows of context + 1 tokens, as GPTModule takes them
        0,
        shape.model["vocab_size"],
        (shape.batch * (shape.steps + 2), shape.model["context_length"] + 1),
        generator=torch.Generator().manual_seed(0),
    )
    meter = BatchMeter()
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        strategy=strategy,
        precision=shape.precision,
        max_steps=shape.steps,
        enable_checkpointing=False,
        callbacks=[meter],
        default_root_dir=str(scratch),
        **QUIET,
    )
    trainer.fit(model, DataLoader(tokens, batch_size=shape.batch))
    assert strategy.plan is not None
    run: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "plan": strategy.plan.summary(),
        "foreach": foreach,
        "strategy_peak_bytes": strategy.peak_memory_bytes,
        "strategy_step_seconds": strategy.step_time,
        "callback_step_seconds": statistics.median(meter.seconds[shape.skip :]),
        "callback_step_seconds_all": meter.seconds,
        "allocator_peak_bytes": max(meter.allocated) if meter.allocated else None,
        "reserved_peak_bytes": max(meter.reserved) if meter.reserved else None,
    }
    if device == "cuda":
        run["device_bytes"] = int(torch.cuda.get_device_properties(0).total_memory)
    check = strategy.prediction_check
    if check is not None:  # the strategy's own check (the planner's plan only), after its first steps
        run["strategy_check"] = {"ok": check.ok, "memory_ratio": check.memory_ratio, "time_ratio": check.time_ratio}
    profile, used = strategy.profile, strategy.plan
    del model, trainer, strategy
    release_memory()
    return run, profile, used


def judge(device: str, run: dict[str, Any], prediction: Any, record: Record) -> None:
    """Record a run's figures beside ``prediction``, then assert them (see the module docstring)."""
    strategy_peak, allocator_peak = run["strategy_peak_bytes"], run["allocator_peak_bytes"]
    step = run["strategy_step_seconds"]
    run["predicted"] = {**prediction.to_dict(), "step_parts": prediction.step_parts}
    run["ratios"] = ratios = {
        "predicted_peak/strategy_peak": prediction.peak_bytes / strategy_peak,
        "predicted_step/measured_step": prediction.step_seconds / step,
    }
    if allocator_peak is not None:
        ratios["allocator_peak/strategy_peak"] = allocator_peak / strategy_peak
        ratios["predicted_peak/allocator_peak"] = prediction.peak_bytes / allocator_peak
        ratios["allocator_peak/device_bytes"] = allocator_peak / run["device_bytes"]
    json.dumps(run, allow_nan=False)  # the figures go to gpu_check.json as they are: plain JSON
    record("run", run)
    print(
        f"{run['plan']}: peak strategy {gib(strategy_peak)}, allocator {gib(allocator_peak)}, predicted "
        f"{gib(prediction.peak_bytes)} at {prediction.peak_at!r}; step measured {step * 1e3:.1f} ms, predicted "
        f"{prediction.step_seconds * 1e3:.1f} ms"
    )
    if allocator_peak is not None:
        assert strategy_peak <= allocator_peak <= strategy_peak * (1 + ALLOCATOR_SLACK), (
            f"the strategy's peak {gib(strategy_peak)} is not the allocator's {gib(allocator_peak)} (expected equal, "
            f"or up to {ALLOCATOR_SLACK:.0%} below it)"
        )
        assert relative_gap(prediction.peak_bytes, allocator_peak) <= MEMORY_TOLERANCE, (
            f"predicted peak {gib(prediction.peak_bytes)} against the allocator's {gib(allocator_peak)} "
            f"(x{ratios['predicted_peak/allocator_peak']:.3f}; target within {MEMORY_TOLERANCE:.0%})"
        )
    assert relative_gap(prediction.peak_bytes, strategy_peak) <= MEMORY_TOLERANCE, (
        f"predicted peak {gib(prediction.peak_bytes)} against the strategy's measured {gib(strategy_peak)} "
        f"(x{ratios['predicted_peak/strategy_peak']:.3f}; target within {MEMORY_TOLERANCE:.0%})"
    )
    if device == "cuda":  # a shared CPU's step times are noise: recorded, not judged
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in prediction.step_parts.items())
        assert relative_gap(prediction.step_seconds, step) <= TIME_TOLERANCE, (
            f"predicted step {prediction.step_seconds * 1e3:.1f} ms against measured {step * 1e3:.1f} ms "
            f"(x{ratios['predicted_step/measured_step']:.3f}; target within {TIME_TOLERANCE:.0%}; {parts})"
        )


def profile_figures(profile: Any) -> dict[str, Any]:
    """What the profile measured of the step (see docs/gpu.md, "How the profiler times a step on CUDA")."""
    from lightning_osdp.cost_model import CostModelConfig

    return {
        "mode": profile.mode,
        "device": profile.device,
        "plain_step_seconds": profile.info.get("measured_step_seconds"),
        "module_seconds_sum": sum(m.fwd_seconds + m.bwd_seconds for m in profile.modules.values()),
        "unattributed_seconds": profile.info.get("unattributed_seconds"),
        "step_overhead_seconds": profile.step_overhead_seconds,
        "optimizer_step_seconds": profile.optimizer_step_seconds,
        "framework_seconds": profile.framework_seconds,
        "copy_bytes_per_second": profile.copy_bytes_per_second,
        "profiling_seconds": profile.profiling_seconds,
        "cost_model_config": asdict(CostModelConfig().resolve(profile)),
    }


@pytest.fixture(scope="module", params=DEVICES)
def planner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The planner's own run on the device (profiled and solved by the strategy): its measurements, profile and
    plan, which the other tests predict from."""
    device = request.param
    run, profile, plan = fit_gpt(device, tmp_path_factory.mktemp(f"planner-{device}"), None, None)
    return {"device": device, "run": run, "profile": profile, "plan": plan}


def test_the_planners_plan_meets_its_prediction(planner: dict[str, Any], record_property: Record) -> None:
    from lightning_osdp.cost_model import predict

    figures = profile_figures(planner["profile"])
    json.dumps(figures, allow_nan=False)
    record_property("profile", figures)
    judge(planner["device"], planner["run"], predict(planner["profile"], planner["plan"], 1), record_property)


def fixed_plan(name: str, device: str) -> Any:
    from lightning_osdp import Plan, default_units

    with torch.device("meta"):
        model = gpt_class()(**SHAPES[device].model)
    blocks = default_units(model)
    if name == "full_shard":
        return Plan.uniform(model, "full_shard")
    if name == "full_shard+recompute":
        return Plan.uniform(model, "full_shard", recompute=True)
    assert name == "half_sharded"
    half = len(blocks) // 2
    return Plan({"": "no_shard", **{b: "full_shard" if i < half else "no_shard" for i, b in enumerate(blocks)}})


@pytest.mark.parametrize("name", ["full_shard", "half_sharded", "full_shard+recompute"])
def test_a_fixed_plan_meets_its_prediction(
    name: str, planner: dict[str, Any], tmp_path: Path, record_property: Record
) -> None:
    from lightning_osdp.cost_model import predict

    device, plan = planner["device"], fixed_plan(name, planner["device"])
    (run, _, _), _, default_error = run_with_default_optimizer(device, lambda fe: fit_gpt(device, tmp_path, plan, fe))
    judge(device, run, predict(planner["profile"], plan, 1), record_property)
    assert default_error is None, default_error


def test_under_a_budget_only_recomputation_meets_the_planner_recomputes_and_keeps_it(
    planner: dict[str, Any], tmp_path: Path, record_property: Record
) -> None:
    """At world size 1 sharding frees nothing: a budget below every plan that keeps its activations is met by
    recomputing some blocks. The budget is half-way between the smallest peak with recomputation and the planner's
    plan without; the measured peak stays under it (the budget is a promise)."""
    from lightning_osdp.cost_model import predict
    from lightning_osdp.solver.policy import plan_model, smallest_memory_budget

    device, profile = planner["device"], planner["profile"]
    keeping = predict(profile, planner["plan"], 1).peak_bytes
    smallest = smallest_memory_budget(profile, 1)
    budget = (keeping + smallest) // 2
    plan = plan_model(profile, budget, 1)
    recomputed = sorted(name for name, decision in plan.decisions.items() if decision.recomputes)
    record_property("budget", {"bytes": budget, "keeping_peak_bytes": keeping, "smallest_budget_bytes": smallest})
    record_property("recomputed", recomputed)
    assert recomputed, f"under {gib(budget)} (below {gib(keeping)}) the planner recomputes nothing: {plan.summary()}"
    (run, _, _), _, default_error = run_with_default_optimizer(device, lambda fe: fit_gpt(device, tmp_path, plan, fe))
    judge(device, run, predict(profile, plan, 1), record_property)
    measured = run["allocator_peak_bytes"] or run["strategy_peak_bytes"]
    assert measured <= budget, f"the measured peak {gib(measured)} is over the budget of {gib(budget)}"
    assert default_error is None, default_error


def test_the_dry_run_predicts_the_measured_peak(
    planner: dict[str, Any], tmp_path: Path, record_property: Record
) -> None:
    """``osdp plan --hardware h200-sxm`` (data-sheet figures, fake tensors) for the same model, batch and precision,
    in a fresh process. Memory does not depend on the hardware figures: within 10% of the measured peak. Data-sheet
    rates are approximations: the step-time ratio is recorded, not judged."""
    shape, measured = SHAPES[planner["device"]], planner["run"]
    plan_file = tmp_path / "dry_plan.json"
    args = ["plan", "--model", "examples/gpt/gpt.py:GPTModule"]
    args += ["--init-args", json.dumps({**shape.model, "lr_schedule": "constant"}), "--world-size", "1"]
    args += ["--hardware", "h200-sxm", "--batch-size", str(shape.batch), "--precision", shape.precision]
    args += ["--no-search", "--out", str(plan_file)]
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_osdp.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    assert proc.returncode == 0, f"osdp {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
    info = json.loads(plan_file.read_text())["info"]
    peak = measured["allocator_peak_bytes"] or measured["strategy_peak_bytes"]
    dry = {
        "command": "osdp " + " ".join(args),
        "predicted_peak_bytes": info["predicted_peak_bytes"],
        "predicted_step_seconds": info["predicted_step_seconds"],
        "peak/measured_peak": info["predicted_peak_bytes"] / peak,
        "step/measured_step": info["predicted_step_seconds"] / measured["strategy_step_seconds"],
    }
    record_property("dry_run", dry)
    assert abs(dry["peak/measured_peak"] - 1) <= MEMORY_TOLERANCE, (
        f"the dry run predicts a peak of {gib(dry['predicted_peak_bytes'])} against {gib(peak)} measured "
        f"(x{dry['peak/measured_peak']:.3f}; target within {MEMORY_TOLERANCE:.0%})"
    )
