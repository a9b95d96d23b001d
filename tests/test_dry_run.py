"""A dry run predicts with the target's figures: every term of a step on a GPU comes from that GPU's rates.

The terms are pinned by hand on a one-Linear profile of a CUDA device (where FSDP2's side streams and asynchronous
kernels hide what the development CPU pays in full), and end to end on built-in hardware presets.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lightning_osdp.cli.estimate import estimated_profile
from lightning_osdp.cli.hardware import (
    COLLECTIVE_LAUNCH_SECONDS,
    INFINIBAND_8X_NDR,
    MEMORY_EFFICIENCY,
    NVLINK4_NVSWITCH,
    get_hardware,
)
from lightning_osdp.cli.model import build_on_meta, import_object
from lightning_osdp.cost_model import CostModelConfig, predict
from lightning_osdp.plan import Plan
from lightning_osdp.profiling.model_profile import ModelProfile

from conftest import ROOT
from synthetic import one_linear_on

GPT_FILE = ROOT / "examples" / "gpt" / "gpt.py"


FULL_SHARD = Plan({"": "no_shard", "a": "full_shard"})
# Full shard on 2 ranks: a 40-byte shard (2 of 3 rows), 80 bytes gathered and reduced.
GATHER = 1e-3 + 80 / 1e6
REDUCE = 2e-3 + 80 / 5e5
HOOKS = 3.5e-4 + 2 * 8.5e-5  # one unit, two parameter tensors: the default host constants
DISPATCH = 2 * 1.5e-4  # two DTensors stepped by the optimizer


def test_a_cuda_profile_resolves_to_its_own_copy_rate_and_overlapping_host_work() -> None:
    config = CostModelConfig().resolve(one_linear_on("cuda:0"))
    assert config.copy_bytes_per_second == 1e5  # the profile's, not the CPU's calibrated 3 GB/s
    assert (config.overlap, config.host_overlap, config.collective_sync_seconds) == (1.0, 1.0, 0.0)
    # 10 ms outside the modules less the 6 ms optimizer step (modelled per unit), plus 5 ms of training loop.
    assert config.step_overhead_seconds == pytest.approx(4e-3 + 5e-3)
    cpu = CostModelConfig().resolve(one_linear_on("cpu"))
    assert cpu.copy_bytes_per_second == 3e9 and cpu.host_overlap == 0.0
    assert cpu.collective_sync_seconds == 2e-3 and cpu.step_overhead_seconds == pytest.approx(4e-3 + 12e-3)


def test_full_shard_on_cuda_by_hand_when_compute_hides_communication_and_side_copies() -> None:
    p = predict(one_linear_on("cuda:0"), FULL_SHARD)
    compute = 9e-3
    comm = 2 * GATHER + REDUCE  # 4.32 ms, less than the unit's 9 ms of compute: nothing exposed
    assert p.communication_seconds == pytest.approx(comm) and p.exposed_seconds == 0.0
    # Two copy-outs (80 bytes each) on the compute stream; the copy-ins (2 x 40) and the reduce-scatter's copy-in
    # (80) run on side streams within the 4.68 ms of compute the collectives leave.
    assert p.copies_seconds == pytest.approx(2 * 80 / 1e5)
    # The optimizer's kernels (40 local bytes at the profile's 0.1 ms per byte) outlast its DTensor dispatch.
    optimizer = 40 * 6e-3 / 60
    assert p.optimizer_seconds == pytest.approx(optimizer) and optimizer > DISPATCH
    assert p.overhead_seconds == 0.0  # the hooks' host time hides behind 9 ms of compute
    parts = p.step_parts
    assert parts == pytest.approx(
        {
            "compute": compute,
            "exposed_communication": 0.0,
            "copies": 2 * 80 / 1e5,
            "optimizer": optimizer,
            "overhead": 4e-3 + 5e-3,
        }
    )
    assert sum(parts.values()) == pytest.approx(p.step_seconds)


def test_full_shard_on_cuda_by_hand_when_the_unit_is_too_small_to_hide_anything() -> None:
    p = predict(one_linear_on("cuda:0", fwd=1e-5, bwd=2e-5), FULL_SHARD)
    compute = 3e-5
    comm = 2 * GATHER + REDUCE
    assert p.exposed_seconds == pytest.approx(comm - compute)
    # No compute is left after the collectives: the side-stream copies are exposed too.
    assert p.copies_seconds == pytest.approx((2 * 80 + 2 * 40 + 80) / 1e5)
    assert p.overhead_seconds == pytest.approx(HOOKS - compute)  # host-bound: the hooks outlast the compute
    assert p.optimizer_seconds == pytest.approx(40 * 6e-3 / 60)


def test_the_same_profile_on_cpu_pays_every_term_in_full() -> None:
    """On the CPU, host and device are the same cores and gloo blocks: the terms add up, as calibrated."""
    p = predict(one_linear_on("cpu"), FULL_SHARD, config=CostModelConfig(copy_bytes_per_second=1e5))
    sync = 2e-3
    comm = 2 * (GATHER + sync) + REDUCE + sync
    assert p.exposed_seconds == pytest.approx(comm)
    assert p.copies_seconds == pytest.approx((2 * (40 + 80) + 80) / 1e5)
    assert p.optimizer_seconds == pytest.approx(40 * 6e-3 / 60 + DISPATCH)
    assert p.overhead_seconds == pytest.approx(HOOKS)


def test_ddp_on_cuda_copies_every_gradient_into_its_bucket() -> None:
    """DDP's reducer copies each gradient into its bucket on the compute stream every step (Lightning's zero_grad
    sets the gradients to None, so they are never already bucket views): charged in full, at the device's rate."""
    p = predict(one_linear_on("cuda:0"), Plan({"": "no_shard", "a": "no_shard"}))
    assert p.copies_seconds == pytest.approx(60 / 1e5)
    assert p.optimizer_seconds == pytest.approx(60 * 6e-3 / 60)  # plain tensors: no DTensor dispatch
    assert p.exposed_seconds == 0.0  # the all-reduce hides behind the backward


def _small_gpt_profile(hardware: str, world_size: int, precision: str = "bf16-mixed") -> tuple[ModelProfile, object]:
    from lightning.pytorch.plugins.precision import MixedPrecision

    init = {"width": 64, "depth": 2, "heads": 4, "context_length": 32, "vocab_size": 256}
    model = build_on_meta(import_object(f"{GPT_FILE}:GPTModule"), init)
    figures = get_hardware(hardware).figures(world_size, precision)
    batch = torch.zeros(2, 33, dtype=torch.long)
    plugin = MixedPrecision("bf16-mixed", "cpu")
    profile = estimated_profile(
        model, batch, figures, optimizer=torch.optim.AdamW, step_context=plugin.train_step_context
    )
    return profile, figures


def test_a_dry_run_on_a_preset_predicts_with_the_presets_figures_only() -> None:
    profile, figures = _small_gpt_profile("h100-sxm", 8)
    h100 = get_hardware("h100-sxm")
    copy = h100.memory_bytes_per_second * MEMORY_EFFICIENCY / 2
    assert profile.copy_bytes_per_second == copy == figures.copy_bytes_per_second  # type: ignore[attr-defined]
    config = CostModelConfig().resolve(profile)
    assert config.copy_bytes_per_second == copy
    assert (config.overlap, config.host_overlap, config.collective_sync_seconds) == (1.0, 1.0, 0.0)
    # FSDP over two blocks and the root: every copy-out is the unit's padded parameters (fp32 under bf16-mixed:
    # autocast casts after the gather) at the preset's copy rate, twice; nothing else is exposed at this size but
    # the side copies the (tiny) compute cannot hide.
    blocks = [f"model.blocks.{i}" for i in range(2)]
    fsdp = predict(profile, Plan({"": "full_shard", **{b: "full_shard" for b in blocks}}), 8)
    gathered = sum(u.gathered for u in fsdp.units) // 2  # UnitPrediction.gathered: parameters + all-gather buffer
    assert fsdp.copies_seconds >= 2 * gathered / copy
    side = sum(2 * u.kept.parameters + u.gathered // 2 for u in fsdp.units)
    assert fsdp.copies_seconds <= (2 * gathered + side) / copy * (1 + 1e-9)
    assert sum(fsdp.step_parts.values()) == pytest.approx(fsdp.step_seconds)


def test_a_ring_across_nodes_is_named_for_its_network_and_pays_its_hops() -> None:
    from lightning_osdp.cost_model.network import Network, bus_bytes_per_second
    from lightning_osdp.topology import Topology

    h100 = get_hardware("h100-sxm")
    figures = h100.figures(1024, "bf16-mixed")
    assert "between nodes 8 x 400 Gb/s NDR InfiniBand per node" in figures.description
    assert "between nodes NVLink" not in figures.description
    topology = Topology(128, 8)
    fit = Network(figures, topology).fit("all_gather", topology.world)
    # 1,023 ring steps, every one paying the network's latency (a step ends when its slowest link has delivered):
    # the across-node ring of 128 nodes, 127 steps, carried over to the world's.
    across = COLLECTIVE_LAUNCH_SECONDS + 127 * INFINIBAND_8X_NDR.hop_seconds
    assert fit.alpha_seconds == pytest.approx(across * 1023 / 127)
    # The world's ring runs at the slower of the node's NVLink and its whole network (8 NICs for 8 ranks).
    bus = min(NVLINK4_NVSWITCH.bus_bytes_per_second, INFINIBAND_8X_NDR.bus_bytes_per_second)
    assert bus_bytes_per_second(fit) == pytest.approx(bus)


@pytest.mark.slow
def test_the_readme_dry_run_adds_little_beyond_compute_and_communication(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's 1.3B GPT on 8 RTX 4090s: before the figures came from the target, copies at the CPU's 3 GB/s made
    3.76 s of a 4.6 s step. Now copies, optimizer and overhead are a few percent of it, and the parts table shows
    each term."""
    from lightning_osdp.cli import main

    init = {"width": 2048, "depth": 24, "heads": 16, "context_length": 1024, "vocab_size": 50304}
    capsys.readouterr()
    code = main(
        [
            "plan",
            "--model",
            f"{GPT_FILE}:GPTModule",
            "--init-args",
            json.dumps(init),
            "--world-size",
            "8",
            "--memory",
            "24GiB",
            "--hardware",
            "rtx4090-pcie",
            "--batch-size",
            "4",
            "--no-search",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    start = lines.index("Step parts per device at batch 4 (ms)")
    header = lines[start + 1].split()
    assert header[:2] == ["strategy", "compute"]
    rows = {}
    for line in lines[start + 3 : start + 7]:
        cells = line.split()
        rows[cells[0]] = [float(c.replace(",", "")) for c in cells[1:]]
    for name, (compute, exposed, copies, optimizer, overhead, step, comm) in rows.items():
        assert compute + exposed + copies + optimizer + overhead == pytest.approx(step, abs=0.3), name
        assert exposed <= comm
        # 1.3B fp32 parameters (5.2 GB): even DDP's optimizer over all of them is ~0.2 s at the card's 806 GB/s.
        assert copies + optimizer + overhead < 0.25 * step, (name, copies, optimizer, overhead, step)
    assert rows["FSDP"][2] >= 2 * 1.31e9 * 4 / (1008e9 * MEMORY_EFFICIENCY / 2) * 1e3  # two copy-outs, in ms


def test_a_resolved_config_keeps_explicit_figures() -> None:
    """Figures given explicitly win over the device's defaults (a measured machine, a calibration)."""
    config = CostModelConfig(copy_bytes_per_second=7e9, host_overlap=0.5).resolve(one_linear_on("cuda:0"))
    assert (config.copy_bytes_per_second, config.host_overlap) == (7e9, 0.5)
    assert dataclasses.replace(config, host_overlap=0.0).host_overlap == 0.0
