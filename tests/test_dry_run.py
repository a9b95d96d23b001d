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
    # On CPU the training loop is priced from the step's counted calls (none counted here: the loop with two values
    # logged, one synced; lightning_osdp/cost_model/config.py [Note: calibration]).
    assert cpu.collective_sync_seconds == 2e-3 and cpu.step_overhead_seconds == pytest.approx(4e-3 + 1.9e-3)


def test_full_shard_on_cuda_by_hand_when_compute_hides_communication_and_side_copies() -> None:
    p = predict(one_linear_on("cuda:0"), FULL_SHARD)
    compute = 9e-3
    comm = 2 * GATHER + REDUCE  # 4.32 ms, less than the unit's 9 ms of compute
    # The gathers hide in the compute; the reduce-scatter does not: the unit takes the model's input, so FSDP2 reduces
    # it in its final callback, after the whole backward, and waits for it.
    assert p.communication_seconds == pytest.approx(comm) and p.exposed_seconds == pytest.approx(REDUCE)
    assert p.exposed_by_cause == pytest.approx({"not_hidden": 0.0, "unoverlapped": REDUCE, "contention": 0.0})
    # Two copy-outs (80 bytes each) on the compute stream; the copy-ins (2 x 40) and the reduce-scatter's copy-in
    # (80) run on side streams within the 6.84 ms of compute the gathers leave.
    assert p.copies_seconds == pytest.approx(2 * 80 / 1e5)
    # The optimizer's kernels (40 local bytes at the profile's 0.1 ms per byte) outlast its DTensor dispatch.
    optimizer = 40 * 6e-3 / 60
    assert p.optimizer_seconds == pytest.approx(optimizer) and optimizer > DISPATCH
    assert p.overhead_seconds == 0.0  # the hooks' host time hides behind 9 ms of compute
    parts = p.step_parts
    assert parts == pytest.approx(
        {
            "compute": compute,
            "recompute": 0.0,
            "exposed_communication": REDUCE,
            "contention": 0.0,  # a profile without the device's rates does not know what its collectives hold
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
    # NCCL's model of a ring over nodes (tuning.cc): of the 1,023 ring steps, 127 cross the network at 14 us and
    # the other 896 stay within a node at NVLink's 3.4 us (each within-node step carrying its share of the fit's
    # fixed cost: 8.4 us over the 7 steps of a node's ring).
    across = COLLECTIVE_LAUNCH_SECONDS + 127 * INFINIBAND_8X_NDR.hop_seconds
    within = (COLLECTIVE_LAUNCH_SECONDS + 7 * NVLINK4_NVSWITCH.hop_seconds) / 7
    assert INFINIBAND_8X_NDR.hop_seconds == 14e-6 and NVLINK4_NVSWITCH.hop_seconds == 3.4e-6
    assert fit.alpha_seconds == pytest.approx(across + 896 * within)
    # The world's ring runs at the slower of the node's NVLink and its whole network (8 NICs for 8 ranks), the
    # network's figure scaled to 128 nodes as the published sweep measured it (260 of 360 GB/s).
    bus = min(NVLINK4_NVSWITCH.bus_bytes_per_second, INFINIBAND_8X_NDR.bus_bytes_per_second * 260 / 360)
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
    start = next(i for i, line in enumerate(lines) if line.startswith("Step parts per device at batch 4 (ms; MFU: "))
    header = lines[start + 1].split()
    assert header[:3] == ["strategy", "compute", "recompute"]
    rows = {}
    for line in lines[start + 3 : start + 10]:
        cells = line.split()
        rows[cells[0]] = [float(c.replace(",", "")) for c in cells[1:-1]]  # the last is the MFU
    comm_start = lines.index("Communication per device and step at batch 4 (ms)")
    comm_lines = lines[comm_start + 3 : comm_start + 10]
    comm = {line.split()[0]: float(line.split()[1].replace(",", "")) for line in comm_lines}
    for name, (compute, recompute, exposed, contention, copies, optimizer, overhead, step) in rows.items():
        assert compute + recompute + exposed + contention + copies + optimizer + overhead == pytest.approx(
            step, abs=0.5
        ), name
        assert exposed <= comm[name]
        # OSDP recomputes where the card needs it (PlannerOptions.plan's [Note: the plan within the card]).
        if name != "OSDP":
            assert (recompute > 0) == name.endswith(("+AC", "+SAC"))
        # 1.3B fp32 parameters (5.2 GB): even DDP's optimizer over all of them is ~0.2 s at the card's 806 GB/s.
        assert copies + optimizer + overhead < 0.25 * step, (name, copies, optimizer, overhead, step)
    assert rows["FSDP"][4] >= 2 * 1.31e9 * 4 / (1008e9 * MEMORY_EFFICIENCY / 2) * 1e3  # two copy-outs, in ms


def test_a_resolved_config_keeps_explicit_figures() -> None:
    """Figures given explicitly win over the device's defaults (a measured machine, a calibration)."""
    config = CostModelConfig(copy_bytes_per_second=7e9, host_overlap=0.5).resolve(one_linear_on("cuda:0"))
    assert (config.copy_bytes_per_second, config.host_overlap) == (7e9, 0.5)
    assert dataclasses.replace(config, host_overlap=0.0).host_overlap == 0.0


# ------------------------------------------------------------------------------- attention and matmuls by shape
class _Attention(torch.nn.Module):
    def __init__(self, causal: bool, mask: bool = False) -> None:
        super().__init__()
        self.causal, self.mask = causal, mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.mask:
            tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=tril)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _traced_attention(causal: bool, mask: bool = False, seq: int = 64, dim: int = 16) -> tuple[object, object]:
    from lightning_osdp.profiling.tracer import ModuleTracer

    model = _Attention(causal, mask)
    q, k, v = (torch.randn(2, 4, seq, dim, requires_grad=True) for _ in range(3))
    tracer = ModuleTracer(model)
    with tracer.iteration(ops=True) as record:
        with tracer.forward():
            out = model(q, k, v)
        tracer.backward(out.sum())
    return record.modules[""], record.outside


def test_causal_attention_is_charged_the_work_its_fused_kernel_does() -> None:
    from lightning_osdp.profiling.tracer import causal_fraction

    full, _ = _traced_attention(causal=False)
    causal, _ = _traced_attention(causal=True)
    # torch's counter: 4 * b * h * s^2 * d forward, 2.5 times that backward (with the scores recomputed).
    assert full.fwd_flops == 4 * 2 * 4 * 64**2 * 16  # type: ignore[attr-defined]
    share = causal_fraction(64, 64)
    assert share == pytest.approx(65 / 128)
    assert causal.fwd_flops == round(full.fwd_flops * share)  # type: ignore[attr-defined]
    # What the kernel skips is recorded beside, so that an MFU may count causal attention in full (PaLM's convention).
    assert causal.fwd_flops + causal.fwd_causal_skipped_flops == full.fwd_flops  # type: ignore[attr-defined]
    assert full.fwd_causal_skipped_flops == 0  # type: ignore[attr-defined]
    kernels = [k for k in causal.fwd_ops.kernels if k.kind == "attention"]  # type: ignore[attr-defined]
    assert [(k.seq_len, k.head_dim, k.causal) for k in kernels] == [(64, 16, True)]


def test_an_explicit_causal_mask_is_charged_in_full_as_the_masked_kernels_compute_every_score() -> None:
    full, _ = _traced_attention(causal=False)
    masked, _ = _traced_attention(causal=False, mask=True)
    assert masked.fwd_flops == full.fwd_flops  # type: ignore[attr-defined]


def test_causal_fraction_counts_the_scores_below_the_diagonal() -> None:
    from lightning_osdp.profiling.tracer import causal_fraction

    assert causal_fraction(4, 4) == pytest.approx((1 + 2 + 3 + 4) / 16)
    assert causal_fraction(2, 4) == pytest.approx((1 + 2) / 8)  # top-left alignment: query i sees keys 0..i
    assert causal_fraction(4, 2) == pytest.approx((1 + 2 + 2 + 2) / 8)


def test_a_matmul_on_the_roofline_is_bound_by_its_bytes_or_its_flops() -> None:
    from lightning_osdp.profiling.rates import DeviceRates
    from lightning_osdp.profiling.tracer import ComputeKernel, OpTally

    rates = DeviceRates("cuda", "bfloat16", 1e-6, 1e12, 1e-6, 1e9, matmul_roofline=True)
    narrow = ComputeKernel("matmul", flops=10**9, bytes=10**7)  # 100 FLOPs per byte, below the ridge of 1,000
    wide = ComputeKernel("matmul", flops=10**12, bytes=10**7)
    tally = OpTally(matmul_ops=3, matmul_flops=10**9 * 2 + 10**12, kernels={narrow: 2, wide: 1})
    assert rates.kernel_seconds(narrow) == pytest.approx(1e-2)  # bytes / B
    assert rates.kernel_seconds(wide) == pytest.approx(1.0)  # flops / R
    assert rates.seconds(tally) == pytest.approx(3 * 1e-6 + 2 * 1e-2 + 1.0)
    # Measured rates (no roofline, no attention points) charge a flat rate, as they always did.
    flat = DeviceRates("cuda", "bfloat16", 1e-6, 1e12, 1e-6, 1e9)
    assert flat.seconds(tally) == pytest.approx(3 * 1e-6 + (2e9 + 1e12) / 1e12)


def test_attention_runs_at_the_published_rate_of_its_length_head_size_and_causality() -> None:
    from lightning_osdp.cli.hardware import FA2_H100
    from lightning_osdp.profiling.tracer import ComputeKernel

    # At the chart's rates (a training step's share of them is TRAINING_MATMUL_EFFICIENCY, tested below).
    rates = get_hardware("h100-sxm").figures(8, "bf16-mixed", training_efficiency=1.0).rates
    assert rates.attention_rate(8192, 128, True) == pytest.approx(308e12)  # the chart's point
    assert rates.attention_rate(8192, 128, False) == pytest.approx(335e12)
    assert rates.attention_rate(8192, 64, True) == pytest.approx(273e12)
    # Between points: linear in log2 of the length (5,793 keys: halfway between 4,096 and 8,192 in log2).
    between = rates.attention_rate(round(4096 * 2**0.5), 128, True)
    assert between == pytest.approx((294e12 + 308e12) / 2, rel=1e-4)
    assert rates.attention_rate(128, 128, True) == pytest.approx(163e12)  # clamped at the ends
    assert rates.attention_rate(65536, 128, True) == pytest.approx(328e12)
    assert dict(FA2_H100[(True, 128)])[8192] == 308
    kernel = ComputeKernel("attention", flops=10**15, bytes=10**6, seq_len=8192, head_dim=128, causal=True)
    assert rates.kernel_seconds(kernel) == pytest.approx(1e15 / 308e12)


def test_device_rates_with_their_shape_model_survive_json() -> None:
    from lightning_osdp.profiling.rates import DeviceRates

    rates = get_hardware("a100-80g-nvlink").figures(8, "bf16-mixed").rates
    assert DeviceRates(**json.loads(json.dumps(rates.to_dict()))) == rates


def test_presets_use_the_published_matmul_maxima_where_there_are_some() -> None:
    from lightning_osdp.cli.hardware import MATMUL_EFFICIENCY_FP32, MATMUL_EFFICIENCY_HALF, TRAINING_MATMUL_EFFICIENCY

    # A training step reaches its generation's TRAINING_MATMUL_EFFICIENCY of the published maxima (calibrated,
    # benchmarks/calibration.py).
    eta, ampere = TRAINING_MATMUL_EFFICIENCY["hopper"], TRAINING_MATMUL_EFFICIENCY["ampere"]
    assert 0.5 < eta < 1.0 and 0.5 < ampere < 1.0
    h100 = get_hardware("h100-sxm").figures(8, "bf16-mixed").rates
    assert h100.matmul_flops_per_second == pytest.approx(794.5e12 * eta)
    assert h100.attention_rate(8192, 128, True) == pytest.approx(308e12 * eta)
    assert get_hardware("h200-sxm").figures(8, "bf16-mixed").rates.matmul_flops_per_second == pytest.approx(
        794.5e12 * eta
    )
    assert get_hardware("a100-80g-nvlink").figures(8, "bf16-true").rates.matmul_flops_per_second == pytest.approx(
        271.2e12 * ampere
    )
    at_ceiling = get_hardware("h100-sxm").figures(8, "bf16-mixed", training_efficiency=1.0).rates
    assert at_ceiling.matmul_flops_per_second == pytest.approx(794.5e12)
    # 500 W: the middle of torchtitan's "between SXM and NVL".
    h100_96 = get_hardware("h100-sxm5-96g").figures(8, "bf16-mixed").rates
    assert h100_96.matmul_flops_per_second == pytest.approx(794.5e12 * (989 + 835) / 2 / 989 * eta)
    # Without a published measurement: the data sheet times the stated assumption; FP32 likewise.
    l4 = get_hardware("l4-pcie")
    assert l4.figures(8, "bf16-mixed").rates.matmul_flops_per_second == pytest.approx(121e12 * MATMUL_EFFICIENCY_HALF)
    fp32 = get_hardware("h100-sxm").figures(8, "32-true").rates
    assert fp32.matmul_flops_per_second == pytest.approx(67e12 * MATMUL_EFFICIENCY_FP32)
    assert fp32.attention_flops_per_second == ()  # no fused kernel takes FP32


# ------------------------------------------------------------------------------- the ring at scale, contention, edges
def test_the_ring_across_nodes_loses_bandwidth_as_the_published_sweep_measured() -> None:
    from lightning_osdp.cli.hardware import RING_BUS_BANDWIDTH_BY_NODES, ring_scaling

    for nodes, bus in RING_BUS_BANDWIDTH_BY_NODES:
        assert ring_scaling(nodes) == pytest.approx(bus / 360)
    assert ring_scaling(1) == ring_scaling(2) == 1.0
    assert ring_scaling(256) == pytest.approx((260 - 20) / 360)  # the last slope, 20 GB/s per doubling
    figures = get_hardware("h100-sxm").figures(512, "bf16-mixed", nodes=64)
    across = figures.inter_node_collectives["reduce_scatter"]
    from lightning_osdp.cost_model.network import bus_bytes_per_second

    assert bus_bytes_per_second(across) * 8 == pytest.approx(280e9)  # 8 ranks' shares of the node's network
    assert any("x0.778 over 64 nodes = 280 GB/s" in note for note in figures.notes)


def test_collectives_hidden_behind_compute_slow_it_by_the_share_of_the_device_they_hold() -> None:
    share = 0.25
    p = predict(one_linear_on("cuda:0"), FULL_SHARD, config=CostModelConfig(collective_compute_share=share))
    # The two gathers hide in the unit's compute (its reduce-scatter runs after it, exposed): each of their seconds
    # costs the compute a quarter of a second.
    assert p.contention_seconds == pytest.approx(share * 2 * GATHER)
    assert p.step_parts["contention"] == pytest.approx(share * 2 * GATHER)
    assert sum(p.step_parts.values()) == pytest.approx(p.step_seconds)
    base = predict(one_linear_on("cuda:0"), FULL_SHARD)
    assert p.step_seconds - base.step_seconds == pytest.approx(share * 2 * GATHER)
    # A preset knows its share: NCCL's 16 channels on the H100's 132 multiprocessors.
    assert get_hardware("h100-sxm").figures(8, "bf16-mixed").rates.collective_compute_share == pytest.approx(16 / 132)


def test_the_roots_gathers_and_the_final_reductions_have_nothing_to_overlap() -> None:
    profile, _ = _small_gpt_profile("h100-sxm", 8)
    blocks = [f"model.blocks.{i}" for i in range(2)]
    fsdp = predict(profile, Plan({"": "full_shard", **{b: "full_shard" for b in blocks}}), 8)
    root = next(u for u in fsdp.units if u.name == "")
    # The root's all-gathers come before any compute and its reduction in FSDP2's final callback, after all of it.
    assert root.time.unoverlapped == pytest.approx(root.time.communication)
    assert root.time.exposed == pytest.approx(root.time.communication)
    assert fsdp.unoverlapped_seconds >= root.time.communication
    causes = fsdp.exposed_by_cause
    assert causes["not_hidden"] + causes["unoverlapped"] == pytest.approx(fsdp.exposed_seconds)
    # A DDP root all-reduces its buckets during backward: nothing of it is counted as unoverlapped.
    ddp_root = predict(profile, Plan({"": "no_shard", **{b: "full_shard" for b in blocks}}), 8)
    assert next(u for u in ddp_root.units if u.name == "").time.unoverlapped == 0.0


def test_osdp_plan_prints_every_term_of_the_step_and_the_network_figures_it_used(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_osdp.cli import main

    init = {"width": 64, "depth": 2, "heads": 4, "context_length": 32, "vocab_size": 256}
    capsys.readouterr()
    argv = ["plan", "--model", f"{GPT_FILE}:GPTModule", "--init-args", json.dumps(init), "--nodes", "16"]
    argv += ["--gpus-per-node", "8", "--hardware", "h100-sxm", "--precision", "bf16-fsdp", "--batch-size", "2"]
    assert main([*argv, "--no-search"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    parts = lines.index("Step parts per device at batch 2 (ms; MFU: PaLM convention, causal attention counted in full)")
    assert lines[parts + 1].split() == [
        "strategy", "compute", "recompute", "exposed", "comm", "contention", "copies", "optimizer", "overhead", "step",
        "MFU",
    ]  # fmt: skip
    comm = lines.index("Communication per device and step at batch 2 (ms)")
    rows = {}
    for line in lines[comm + 3 :]:
        cells = line.split()
        if not cells or cells[0] not in ("OSDP", "DDP", "ZeRO-2", "FSDP", "HSDP"):
            break
        rows[cells[0]] = [float(c.replace(",", "")) for c in cells[1:]]
    for name, (total, hidden, not_hidden, unoverlapped, contention) in rows.items():
        assert hidden + not_hidden + unoverlapped == pytest.approx(total, abs=0.2), name
        assert contention == pytest.approx(hidden * 16 / 132, abs=0.1), name  # 16 NCCL channels of 132 SMs
    assert rows["FSDP"][3] > 0  # the root's gathers and final reduction
    assert "x0.889 over 16 nodes = 320 GB/s" in out  # NVIDIA/nccl#1229's 16-node point
    assert "network ring step 14.0 us" in out and "ring step 3.4 us" in out
    from lightning_osdp.cli.hardware import TRAINING_MATMUL_EFFICIENCY

    eta = TRAINING_MATMUL_EFFICIENCY["hopper"]
    assert f"{794.5 * eta:,.1f} TFLOPS ({eta:.1%} of the measured maximum)" in out
