"""Lightning's own usages match Lightning's DDP under every plan shape: BatchNorm (buffers) with and without
recomputation, manual optimization (two optimizers, toggling, clipping, a scheduler), gradient clipping by norm and by
value, and ``torch.compile``d blocks; under the planner's own plans at an ample and a halfway budget, and under
hand-written all-sharded, hybrid, recomputing and mixed plans.

All cases run in one ``torchrun --nproc-per-node 2`` launch (tests/distributed/usage_runner.py); each is compared
with the DDP run of the same model, seed and data: losses, final parameters *and buffers* (rank 0's full state,
and each rank's buffers), and the validation loss that reads BatchNorm's running statistics.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import ROOT, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RTOL = 1e-5
PLANNED = ("ample", "halfway")
CASES = {
    # BatchNorm: the planner's halfway plan recomputes blocks; every hand-written shape too, selective recomputation
    # (its convolutions kept, BatchNorm replayed on the statistics its forward saw) among them.
    "bn": (
        "ample",
        "halfway",
        "full_shard",
        "shard_grad_op",
        "recompute",
        "full_shard_recompute",
        "selective",
        "full_shard_selective",
        "mixed",
    ),
    "bn_compile": ("halfway", "full_shard_recompute", "full_shard_selective"),
    "gan": ("ample", "halfway", "no_shard", "full_shard", "mixed"),
    "gpt_clip": ("no_shard", "full_shard", "hybrid_shard", "mixed"),
    "gpt_clipv": ("full_shard", "mixed"),
    "compile_method": ("full_shard", "mixed", "halfway", "full_shard_selective"),
    "compile_fn": ("full_shard", "mixed"),
}
RUNS = [f"{model}:{plan}" for model, plans in CASES.items() for plan in ("ddp", *plans)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("usages")
    torchrun(ROOT / "tests" / "distributed" / "usage_runner.py", str(out), *RUNS, timeout=1500)
    return {
        run: [torch.load(out / f"{run.replace(':', '-')}.rank{r}.pt", weights_only=False) for r in range(2)]
        for run in RUNS
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _own_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # `torch.compile(block)` puts the block under `_orig_mod` in `state_dict()`; torch's distributed state dicts (and
    # so OSDP's) name it as the uncompiled model does.
    return {k.replace("._orig_mod", ""): v for k, v in state.items()}


def _matches_ddp(case: list[dict[str, Any]], ddp: list[dict[str, Any]]) -> None:
    for rank in range(2):
        got, want = case[rank], ddp[rank]
        assert len(got["losses"]) == len(want["losses"]) > 0
        for a, b in zip(got["losses"], want["losses"], strict=True):
            assert abs(a - b) <= RTOL * abs(b), (a, b)
        assert set(got["buffers"]) == set(want["buffers"])
        for name, buffer in want["buffers"].items():
            assert _rel(got["buffers"][name], buffer) <= RTOL, f"rank {rank}'s buffer {name}"
        for key, value in want["val"].items():
            assert got["val"][key] == pytest.approx(value, rel=RTOL), key
    state, reference = _own_keys(case[0]["state"]), _own_keys(ddp[0]["state"])
    assert set(state) == set(reference)
    for key, value in reference.items():
        assert _rel(state[key], value) <= RTOL, key


@pytest.mark.parametrize("run", [r for r in RUNS if not r.endswith(":ddp")])
def test_matches_lightnings_ddp_in_losses_parameters_and_buffers(
    results: dict[str, list[dict[str, Any]]], run: str
) -> None:
    model = run.partition(":")[0]
    _matches_ddp(results[run], results[f"{model}:ddp"])


def test_buffers_are_rank_zeros_on_every_rank_under_every_plan(results: dict[str, list[dict[str, Any]]]) -> None:
    # DDP's semantics (broadcast_buffers): what rank 0 computed is what every rank evaluates with, whatever the plan.
    for run in RUNS:
        if not run.startswith("bn"):
            continue
        rank0, rank1 = (results[run][r]["buffers"] for r in range(2))
        for name, value in rank0.items():
            assert torch.equal(value, rank1[name]), f"{run}: {name} differs across ranks"


def test_the_planner_recomputes_batchnorm_blocks_at_the_halfway_budget_and_keeps_the_budget(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    for model in ("bn", "bn_compile"):
        decisions = results[f"{model}:halfway"][0]["plan"]["decisions"]
        assert any(d.get("recompute") for d in decisions.values()), decisions
    for run in RUNS:
        if run.partition(":")[2] in PLANNED:
            for rank in range(2):
                result = results[run][rank]
                assert 0 < result["peak"] <= result["budget"], run


def test_manual_optimization_is_planned_from_its_own_training_step(results: dict[str, list[dict[str, Any]]]) -> None:
    # The planner's own plans for a manual training_step: its profile ran the step (two optimizers, toggling,
    # clipping, a scheduler); at the halfway budget the plan shards something.
    halfway = results["gan:halfway"][0]["plan"]["decisions"]
    assert {d["mode"] for d in halfway.values()} != {"no_shard"}, halfway


@pytest.mark.parametrize("model", ["compile_method", "compile_fn", "bn_compile"])
def test_compiled_blocks_stay_compiled_under_every_plan(results: dict[str, list[dict[str, Any]]], model: str) -> None:
    ddp = results[f"{model}:ddp"][0]
    assert ddp["frames"].get("ok", 0) > 0
    for plan in CASES[model]:
        for rank in range(2):
            frames = results[f"{model}:{plan}"][rank]["frames"]
            assert frames.get("ok", 0) >= ddp["frames"]["ok"], f"{model}:{plan} rank {rank}: {frames}"
            assert frames.get("ok", 0) == frames.get("total", 0), f"{model}:{plan} rank {rank}: {frames}"
