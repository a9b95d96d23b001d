"""What each block holds in forward and in backward, as the cost model's segment simulator counts it, measured on 2
ranks for shard_grad_op plans (and full_shard and DDP blocks beside them, some recomputing)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, torchrun

RUNNER = ROOT / "tests" / "distributed" / "segment_memory_runner.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("segment_memory")
    torchrun(RUNNER, str(out))
    return json.loads((out / "segment_memory.json").read_text())


@pytest.mark.distributed
def test_each_blocks_memory_under_sharded_modes_is_predicted_as_exactly_as_under_ddp(results: dict[str, dict]) -> None:
    # What the step holds besides the blocks (the loss, the embeddings' and head's activations) is the same under
    # every plan and is not this test's subject: each block's figure is compared with its figure under the all-DDP
    # plan, whose blocks the simulator counts without any FSDP2 event. A shard_grad_op block keeps its gathered
    # parameters from forward to its post-backward; a full_shard block gathers again in backward, with its output
    # gradient alive; a nested full_shard unit that its block's pre-backward prefetched is only copied out by the
    # recomputation, not gathered twice.
    reference = results["no_shard"]["blocks"]
    checked = 0
    for plan, result in results.items():
        for block, (figures, ref) in enumerate(zip(result["blocks"], reference, strict=True)):
            for phase in ("forward", "backward"):
                if phase == "forward" and figures["recompute"]:
                    # Unsaved, a recomputing block's forward holds what its own code computes between children (a
                    # child's output while the next runs), which the profile does not measure: not asserted here.
                    continue
                miss = figures[phase]["predicted"] - figures[phase]["measured"]
                miss_under_ddp = ref[phase]["predicted"] - ref[phase]["measured"]
                assert abs(miss - miss_under_ddp) <= 0.005 * figures[phase]["measured"], (plan, block, phase)
                checked += 1
    assert checked == 5 * 3 * 2 - 5  # every block of every plan in both passes, but the 5 recomputing forwards


@pytest.mark.distributed
def test_the_peak_of_shard_grad_op_plans_is_predicted_within_3_percent(results: dict[str, dict]) -> None:
    for plan, result in results.items():
        assert result["predicted"] == pytest.approx(result["peak"], rel=0.03), plan
    # Sharding the blocks' gradients and optimizer state saves memory, and recomputing saves more.
    peaks = {plan: result["peak"] for plan, result in results.items()}
    assert peaks["shard_grad_op+recompute+nested"] < peaks["shard_grad_op"] < peaks["no_shard"]
