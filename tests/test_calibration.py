"""The published runs the dry run is calibrated on, the calibration's arithmetic, and the reserved-memory model."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import calibration

from lightning_osdp.cli.reserved_memory import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION_SHARE,
    NCCL_COMMUNICATOR_BYTES,
    device_memory,
)

GIB = 2**30


def test_every_published_run_parses_and_cites_its_source() -> None:
    runs = calibration.load_runs()
    assert len(runs) >= 25
    assert len({r.source for r in runs}) >= 4
    for run in runs:
        assert "https://" in run.citation, run.id
        assert run.world_size == run.nodes * run.gpus_per_node >= 1
        assert run.tokens_per_second_per_gpu > 0
        if run.memory_gib is not None:
            assert run.memory_kind, f"{run.id}: a memory figure must say which memory it is"


def test_a_run_without_a_required_field_is_refused_by_name(tmp_path: Path) -> None:
    data = json.loads(calibration.RUNS_FILE.read_text())
    del data["runs"][3]["citation"]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"run 3 \({data['runs'][3]['id']}\) lacks citation"):
        calibration.load_runs(path)


def test_a_run_with_an_unknown_sharding_is_refused(tmp_path: Path) -> None:
    data = json.loads(calibration.RUNS_FILE.read_text())
    data["runs"][0]["sharding"] = "zero3"
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="sharding 'zero3' is not one of"):
        calibration.load_runs(path)


def _small_run() -> calibration.PublishedRun:
    """A published row's configuration at a shape small enough to trace in a test."""
    (run,) = [r for r in calibration.load_runs() if r.id == "tt-13b-64xa100"]
    shape = {**run.shape, "dim": 256, "n_layers": 4, "n_heads": 4, "context_length": 512, "vocab_size": 1024}
    return dataclasses.replace(run, shape=shape, seq_len=512, micro_batch=2)


def test_a_runs_prediction_is_finite_and_exact_at_the_traced_rates() -> None:
    traced = calibration.trace_run(_small_run(), memory_axis=True)
    base = traced.profile(1.0, 0.8)
    assert {n: m.fwd_seconds for n, m in base.modules.items()} == {
        n: m.fwd_seconds for n, m in traced.base.modules.items()
    }
    for profile, expected in (
        (traced.profile(0.5, 0.8), traced.slower_matmuls),
        (traced.profile(1.0, 0.4), traced.slower_memory),
    ):
        for name, module in expected.modules.items():
            assert profile.modules[name].fwd_seconds == pytest.approx(module.fwd_seconds, rel=1e-9)
            assert profile.modules[name].bwd_seconds == pytest.approx(module.bwd_seconds, rel=1e-9)
    fast, slow = calibration.predict_run(traced, 0.9, 0.8), calibration.predict_run(traced, 0.7, 0.8)
    assert math.isfinite(fast.tokens_per_second_per_gpu) and fast.tokens_per_second_per_gpu > 0
    assert slow.tokens_per_second_per_gpu < fast.tokens_per_second_per_gpu
    assert calibration.predict_run(traced, 0.9, 0.4).tokens_per_second_per_gpu < fast.tokens_per_second_per_gpu
    # Memory does not depend on the rates; the reserved peak holds the allocated one and more.
    assert slow.memory == fast.memory
    assert fast.memory.allocated < fast.memory.reserved < fast.memory.device_total
    # `osdp plan`'s line of the same figures: the device total judged against the card.
    from lightning_osdp.cli.reserved_memory import plan_memory_line
    from lightning_osdp.cost_model import predict

    figures = calibration.figures_of(traced.run)
    plan = calibration.published_plan(traced.run, traced.module)
    prediction = predict(traced.profile(0.9, 0.8), plan, figures.topology)
    assert prediction.peak_bytes == fast.memory.allocated
    assert "fits the 80 GiB card" in plan_memory_line(prediction, plan, figures.topology, 80 * GIB)
    tight = fast.memory.device_total - 1
    assert "does not fit" in plan_memory_line(prediction, plan, figures.topology, tight)
    # Between the corners the interpolation is close to the exact prediction.
    corners = calibration.corners_of(traced)
    exact = calibration.predict_run(traced, 0.8, 0.6).tokens_per_second_per_gpu
    assert corners.tokens_per_second_per_gpu(0.8, 0.6) == pytest.approx(exact, rel=0.02)


def test_calibration_picks_the_least_error_and_holds_each_source_out() -> None:
    template = calibration.load_runs()[0]
    # Steps of matmuls only (1 s at the ceiling): source a's runs are right at efficiency 0.8, b's at 0.9; c's compiled
    # run, faster than any efficiency explains, is predicted but does not calibrate.
    right = {"a0": 0.8, "a1": 0.8, "b2": 0.9, "b3": 0.9, "c4": 1.5}
    runs, corners = [], {}
    for rid, e in right.items():
        tokens = template.micro_batch * template.seq_len
        step = "torch.compile" if rid[0] == "c" else "eager"
        run = dataclasses.replace(template, id=rid, source=rid[0], step=step, tokens_per_second_per_gpu=tokens * e)
        steps = {(c, m): 1.0 / c for c in calibration.MATMUL_CORNERS for m in calibration.MEMORY_CORNERS}
        runs.append(run)
        corners[rid] = calibration.Corners(run, steps)
    by_source = {s["source"]: s for s in calibration.summary(runs, corners)}
    assert by_source["a"]["rates_held_out"][0] == 0.9 and by_source["b"]["rates_held_out"][0] == 0.8
    assert by_source["a"]["median_error_held_out"] == pytest.approx(0.9 / 0.8 - 1)
    assert by_source["b"]["worst_error_held_out"] == pytest.approx(1 - 0.8 / 0.9)
    assert by_source["a"]["rates_all"] == by_source["b"]["rates_all"] == by_source["c"]["rates_held_out"]
    assert by_source["a"]["rates_all"][0] in (0.8, 0.825, 0.85, 0.875, 0.9)  # between the eager sources
    assert by_source["c"]["median_error_all"] > 0.4


def test_reserved_memory_adds_fragmentation_of_the_transient_bytes_and_what_lives_outside_the_allocator() -> None:
    memory = device_memory(60 * GIB, 40 * GIB, communicators=2)
    assert memory.reserved == 60 * GIB + round(FRAGMENTATION_SHARE * 40 * GIB)
    assert memory.device_total == memory.reserved + 2 * NCCL_COMMUNICATOR_BYTES + CUDA_CONTEXT_BYTES
    assert memory.fits(memory.device_total) and not memory.fits(memory.device_total - 1)
    with pytest.raises(ValueError, match="transient <= allocated"):
        device_memory(GIB, 2 * GIB)


def test_the_published_7b_at_batch_6_x_2048_fits_the_80_gb_card_it_ran_on() -> None:
    # llm-foundry's MPT-7B, FULL_SHARD without recomputation on 8 H100 80GB: issue 35's example of a "does not fit"
    # verdict for a published run that ran. Judged on the device total: reserved memory, NCCL's buffers, the context.
    (run,) = [r for r in calibration.load_runs() if r.id == "mf-7b-2048-8xh100"]
    traced = calibration.trace_run(run)
    prediction = calibration.predict_run(traced, 1.0, calibration.MEMORY_CORNERS[0])
    assert prediction.card_bytes == 80 * GIB
    assert prediction.memory.allocated < prediction.memory.reserved < prediction.memory.device_total < 80 * GIB
    assert prediction.fits
