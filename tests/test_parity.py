"""A sharded run matches Lightning's DDP run of the same seed and data, for every mode and a mixed plan.

All cases run in one ``torchrun --nproc-per-node 2`` launch (tests/distributed/runner.py): the gloo group
and the imports are shared, the cases are sequential fits in the same two processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASES = [
    "ddp",
    "no_shard",
    "full_shard",
    "shard_grad_op",
    "mixed",
    "tied_split",
    "ddp@accum_clip",
    "mixed@accum_clip",
    "ddp@sgd",
    "full_shard@sgd",
    "ddp@bf16-mixed",
    "mixed@bf16-mixed",
    "ddp@bf16-true",
    "mixed@bf16-true",
    "ddp@ac",
    "no_shard+ac@ac",
    "full_shard+ac@ac",
    "shard_grad_op+ac@ac",
    "ddp@acmix",
    "mixed+ac@acmix",
    "ddp@sac",
    "no_shard+sac@sac",
    "full_shard+sac@sac",
    "shard_grad_op+sac@sac",
    "hybrid_shard+sac@sac",
    "ddp@sacmix",
    "mixed+sac@sacmix",
    "ddp@sacmix_bf16",
    "mixed+sac_nosplit@sacmix_bf16",
    "ddp@sacmix_accum",
    "mixed+sac@sacmix_accum",
]
# Relative tolerance of the issue: losses per step and final parameters within 1e-5 of DDP.
RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("parity")
    torchrun(ROOT / "tests" / "distributed" / "runner.py", str(out), *CASES)
    return {case: [torch.load(out / f"{case}.rank{r}.pt", weights_only=False) for r in range(2)] for case in CASES}


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def assert_matches(case: dict[str, Any], ref: dict[str, Any], rtol: float) -> None:
    assert len(case["losses"]) == len(ref["losses"]) > 0
    for got, want in zip(case["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= rtol * abs(want), (got, want)
    if ref["state"] is not None:  # rank 0 holds the full state
        assert set(case["state"]) == set(ref["state"]), "state-dict keys must be the unsharded model's own"
        for key, want in ref["state"].items():
            assert case["state"][key].shape == want.shape, key
            assert _max_rel(case["state"][key], want) <= rtol, key


@pytest.mark.parametrize("plan", ["no_shard", "full_shard", "shard_grad_op", "mixed", "tied_split"])
def test_every_mode_matches_ddp(results: dict[str, list[dict[str, Any]]], plan: str) -> None:
    for rank in range(2):
        assert_matches(results[plan][rank], results["ddp"][rank], RTOL)


@pytest.mark.parametrize("plan", ["no_shard+ac@ac", "full_shard+ac@ac", "shard_grad_op+ac@ac", "mixed+ac@acmix"])
def test_recomputation_matches_ddp_with_the_same_blocks_checkpointed_by_hand(
    results: dict[str, list[dict[str, Any]]], plan: str
) -> None:
    # Dropout 0.1: the recomputation draws the masks the forward drew (torch's checkpoint restores the RNG state),
    # or the losses would part from the reference's at the first step.
    reference = "ddp@" + plan.partition("@")[2]
    for rank in range(2):
        assert_matches(results[plan][rank], results[reference][rank], RTOL)
    assert results[plan][0]["plan"]["decisions"]["h.0"].get("recompute") == "full"


@pytest.mark.parametrize(
    "plan",
    [
        "no_shard+sac@sac",
        "full_shard+sac@sac",
        "shard_grad_op+sac@sac",
        "hybrid_shard+sac@sac",
        "mixed+sac@sacmix",
        "mixed+sac_nosplit@sacmix_bf16",
        "mixed+sac@sacmix_accum",
    ],
)
def test_selective_recomputation_matches_ddp_with_the_same_policy_applied_by_hand(
    results: dict[str, list[dict[str, Any]]], plan: str
) -> None:
    # Dropout 0.1: dropout is not a kept operator, so the replay draws its masks again (from the restored RNG state).
    # The reference checkpoints the same blocks by hand with torch's selective contexts and the same operator list;
    # the mixed plan has a unit in each of the three options (a tied group, a split Linear in the selective block),
    # also with gradient accumulation, and under bf16-mixed (without the split, see the runner's PLANS).
    reference = "ddp@" + plan.partition("@")[2]
    for rank in range(2):
        assert_matches(results[plan][rank], results[reference][rank], RTOL)
        _record_error(plan, results[plan][rank], results[reference][rank])
    decisions = results[plan][0]["plan"]["decisions"]
    assert decisions["h.0"]["recompute"] == "selective"
    if plan.startswith("mixed"):
        assert decisions["h.1"]["recompute"] == "full" and "recompute" not in decisions["h.2"]


def _record_error(plan: str, case: dict[str, Any], ref: dict[str, Any]) -> None:
    """The largest relative errors of the losses and of the final state (rank 0), printed for the record (``-s``)."""
    losses = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(case["losses"], ref["losses"], strict=True))
    state = max(_max_rel(case["state"][k], v) for k, v in ref["state"].items()) if ref["state"] is not None else None
    print(f"[parity] {plan}: losses {losses:.2e}" + (f", final state {state:.2e}" if state is not None else ""))


def test_accumulation_and_clipping_match_ddp(results: dict[str, list[dict[str, Any]]]) -> None:
    for rank in range(2):
        assert_matches(results["mixed@accum_clip"][rank], results["ddp@accum_clip"][rank], RTOL)


def test_no_gradient_reduction_on_accumulating_micro_batches(results: dict[str, list[dict[str, Any]]]) -> None:
    osdp = results["mixed@accum_clip"][0]
    ddp = results["ddp@accum_clip"][0]["grad_sync"]
    # accumulate_grad_batches=2: micro-batches 0, 2, 4, ... accumulate, 1, 3, 5, ... step.
    # Sharded (FSDP2): no reduce-scatter ran while accumulating, so no sharded `.grad` exists yet.
    accumulating_sharded = [has for batch, has in osdp["sharded_grad"] if batch % 2 == 0]
    stepping_sharded = [has for batch, has in osdp["sharded_grad"] if batch % 2 == 1]
    assert accumulating_sharded and not any(accumulating_sharded), "a sharded gradient was reduced while accumulating"
    assert stepping_sharded and all(stepping_sharded)
    # Replicated (DDP): local gradients differ across ranks while accumulating (no all-reduce ran), equal after it,
    # exactly as under Lightning's DDP strategy.
    for records in (osdp["grad_sync"], ddp):
        accumulating = [spread for batch, spread in records if batch % 2 == 0]
        stepping = [spread for batch, spread in records if batch % 2 == 1]
        assert accumulating and all(s is not None and s > 0 for s in accumulating), "reduced while accumulating"
        assert stepping and all(s == 0.0 for s in stepping), "replicated gradients differ across ranks after sync"


def test_sgd_momentum_matches_ddp(results: dict[str, list[dict[str, Any]]]) -> None:
    for rank in range(2):
        assert_matches(results["full_shard@sgd"][rank], results["ddp@sgd"][rank], RTOL)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_match_ddp(results: dict[str, list[dict[str, Any]]], precision: str) -> None:
    for rank in range(2):
        assert_matches(results[f"mixed@{precision}"][rank], results[f"ddp@{precision}"][rank], RTOL)


def test_metrics_samplers_and_loops(results: dict[str, list[dict[str, Any]]]) -> None:
    osdp, ddp = results["mixed"], results["ddp"]
    # Validation and test loops ran and reduced across ranks to DDP's figures (sync_dist and torchmetrics).
    for key in ("val_loss_sync", "val_loss", "val_acc"):
        assert osdp[0]["val"][key] == pytest.approx(ddp[0]["val"][key], rel=RTOL)
        assert osdp[0]["val"][key] == osdp[1]["val"][key]
    assert osdp[0]["test"]["test_loss"] == pytest.approx(ddp[0]["test"]["test_loss"], rel=RTOL)
    # A distributed sampler split each epoch's 64 samples into two disjoint halves.
    first_epoch = [set(osdp[r]["seen"][:32]) for r in range(2)]
    assert first_epoch[0].isdisjoint(first_epoch[1])
    assert first_epoch[0] | first_epoch[1] == set(range(64))


def test_step_time_and_peak_memory_are_measured(results: dict[str, list[dict[str, Any]]]) -> None:
    full, replicated = results["full_shard"][0], results["no_shard"][0]
    assert full["step_time"] > 0 and replicated["step_time"] > 0
    # Sharding parameters, gradients and AdamW state over two ranks lowers the measured peak.
    assert 0 < full["peak_memory_bytes"] < replicated["peak_memory_bytes"]


def test_two_nodes_of_one_process_match_ddp(tmp_path: Path) -> None:
    """``num_nodes=2, devices=1`` through torchrun's cluster environment: two agents with a static rendezvous."""
    import subprocess
    import sys

    from conftest import child_env, free_port

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(ROOT / "tests" / "distributed" / "runner.py"),
                str(tmp_path),
                "ddp",
                "mixed",
            ],
            env=child_env(OSDP_TEST_NUM_NODES="2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for node in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outputs)
    runs = {
        c: [torch.load(tmp_path / f"{c}.rank{r}.pt", weights_only=False) for r in range(2)] for c in ("ddp", "mixed")
    }
    assert runs["mixed"][0]["plan"]["decisions"]["h.0"]["mode"] == "full_shard"
    for rank in range(2):
        assert_matches(runs["mixed"][rank], runs["ddp"][rank], RTOL)
