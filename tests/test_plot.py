"""Pictures of a plan: the timeline they draw is the prediction's, and the figure has one size for every model."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import pytest

from lightning_osdp.cli import main
from lightning_osdp.cli.plot import DPI, FIGSIZE, PlotSide, fold_plan, fsdp_plan, plot_plan
from lightning_osdp.cost_model import memory_timeline, predict
from lightning_osdp.cost_model.timeline import PHASES, phase_of
from lightning_osdp.plan import Decision, Plan
from lightning_osdp.profiling.model_profile import ModelProfile

from conftest import ROOT
from synthetic import gloo_like_collectives, gpt_profile

GPT_CONFIG = ROOT / "examples" / "gpt" / "configs" / "osdp_budget.yaml"


def _blocks(depth: int, decision: Decision) -> dict[str, Decision]:
    return {f"model.blocks.{i}": decision for i in range(depth)}


def _two_nodes(profile: ModelProfile) -> ModelProfile:
    """``profile`` as if measured on 2 nodes of 2 ranks (fits across nodes: the same gloo-like ones)."""
    return dataclasses.replace(profile, world_size=4, nodes=2, inter_node_collectives=gloo_like_collectives(4))


PLANS = {
    "DDP": (Plan({"": "no_shard"}), 2),
    "FSDP": (Plan({"": "full_shard", **_blocks(4, Decision("full_shard"))}), 2),
    "FSDP+AC on 8": (Plan({"": "full_shard", **_blocks(4, Decision("full_shard", recompute="full"))}), 8),
    "ZeRO-2+SAC": (Plan({"": "shard_grad_op", **_blocks(4, Decision("shard_grad_op", recompute="selective"))}), 2),
    "mixed, split": (
        Plan(
            {
                "": "no_shard",
                "model.blocks.0": Decision("no_shard"),
                "model.blocks.1": Decision("shard_grad_op", recompute="full"),
                "model.blocks.1.mlp.fc": Decision("full_shard", 4),
                "model.blocks.2": Decision("full_shard", recompute="selective"),
                "model.blocks.3": Decision("full_shard"),
            }
        ),
        2,
    ),
    "HSDP on 2 nodes": (Plan({"": "hybrid_shard", **_blocks(4, Decision("hybrid_shard", recompute="full"))}), 4),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_the_timelines_largest_instant_is_the_predicted_peak(name: str) -> None:
    plan, world_size = PLANS[name]
    profile = gpt_profile(depth=4, world_size=world_size)
    if name.startswith("HSDP"):
        profile = _two_nodes(profile)
    prediction = predict(profile, plan, world_size)
    timeline = memory_timeline(profile, plan, world_size)
    largest = max(timeline, key=lambda p: p.parts.total)  # the first of equal instants, as the prediction takes it
    assert largest.parts == prediction.peak and largest.parts.total == prediction.peak_bytes
    assert largest.label == prediction.peak_at
    assert [p.position for p in timeline] == list(range(len(timeline)))
    assert [(p.label, p.parts.total) for p in timeline] == prediction.instants
    # Every instant has a phase, and the phases come in the step's order, each of them present.
    order = [PHASES.index(p.phase) for p in timeline]
    assert order == sorted(order) and set(order) == set(range(len(PHASES)))
    assert timeline[0].label == "step start" and timeline[-1].phase == "optimizer"


def test_an_instant_the_walk_does_not_write_has_no_phase() -> None:
    assert phase_of("loss backward") == "backward" and phase_of("final reduce model.wte") == "backward"
    with pytest.raises(ValueError, match="no phase for the timeline's instant 'checkpoint'"):
        phase_of("checkpoint")


def test_identical_consecutive_blocks_fold_into_runs() -> None:
    decisions = {
        "": Decision("no_shard"),
        **_blocks(3, Decision("full_shard", recompute="full")),
        "model.blocks.3": Decision("full_shard", recompute="full"),
        "model.blocks.3.mlp.fc": Decision("full_shard", 4),
        "model.blocks.3.mlp.proj": Decision("full_shard", 4),
        "model.blocks.4": Decision("shard_grad_op"),
        "model.blocks.5": Decision("shard_grad_op"),
        "model.lm_head": Decision("no_shard"),
    }
    order = ["", *(f"model.blocks.{i}" for i in range(6)), "model.lm_head"]
    runs = fold_plan(Plan(decisions), order)
    assert [r.label for r in runs] == [
        "<root>  no_shard",
        "model.blocks.0-2 x3  full_shard, recompute full",
        "model.blocks.3  full_shard, recompute full; mlp.{fc,proj} full_shard, split 4",
        "model.blocks.4-5 x2  shard_grad_op",
        "model.lm_head  no_shard",
    ]
    fsdp = fsdp_plan(Plan(decisions), "full")
    assert fsdp.decisions[""] == Decision("full_shard")
    assert fsdp.decisions["model.blocks.3"] == Decision("full_shard", recompute="full")
    assert "model.blocks.3.mlp.fc" not in fsdp.decisions


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def test_the_figure_has_one_size_whatever_the_number_of_blocks(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sizes = set()
    for depth in (2, 126):
        profile = gpt_profile(depth=depth, width=32, tokens=64)
        plan = Plan(
            {"": "no_shard", **{f"model.blocks.{i}": Decision("full_shard", recompute="full") for i in range(depth)}}
        )
        fsdp = fsdp_plan(plan)
        sides = [PlotSide("OSDP", plan, predict(profile, plan)), PlotSide("FSDP", fsdp, predict(profile, fsdp))]
        budget = sides[0].prediction.peak_bytes * 2
        sizes.add(_png_size(plot_plan(tmp_path / f"{depth}.png", sides, budget=budget, capacity=budget + 1)))
    assert sizes == {(round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))}


def test_osdp_plan_plot_writes_the_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "pictures" / "plan.png"
    argv = ["plan", "--config", str(GPT_CONFIG), "--memory", "50MiB", "--hardware", "l4-pcie", "--batch-size", "4"]
    code = main(["-q", *argv, "--no-search", "--plot", str(picture)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"wrote {picture}" in out
    assert _png_size(picture) == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
