"""The ``osdp`` command as users run it: ``plan`` (dry runs), ``show``, ``consolidate``, ``hardware``.

Commands run in this process through ``lightning_osdp.cli.main([...])`` with stdout and stderr captured (so they
are not terminals: plain-text tables, plain progress lines); one test runs the module entry point in a fresh
interpreter. The 1.3B-parameter dry run and the checkpoint round trip are ``slow`` (seconds, not minutes).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_osdp import OSDPStrategy, Plan
from lightning_osdp.cli import main
from lightning_osdp.cli.batch import batch_source
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.estimate import BatchScaledProfile, estimated_profile
from lightning_osdp.cli.hardware import (
    COLLECTIVE_LAUNCH_SECONDS,
    HARDWARE,
    INFINIBAND_8X_HDR,
    NVLINK3_NVSWITCH,
    get_hardware,
    hardware_from_file,
)
from lightning_osdp.cli.model import build_on_meta, discover_cli_model, import_object, read_configs
from lightning_osdp.cli.output import Output, plain_table
from lightning_osdp.cost_model.network import Network
from lightning_osdp.solver.report import PLAN_LEGEND

from conftest import ROOT, child_env
from models import TinyGPT, loaders

GPT_FILE = ROOT / "examples" / "gpt" / "gpt.py"
GPT_CONFIG = ROOT / "examples" / "gpt" / "configs" / "osdp_budget.yaml"
# GPT-2 XL's shape with a 2048-wide residual stream: 1.31B parameters.
GPT_1_3B = {"width": 2048, "depth": 24, "heads": 16, "context_length": 1024, "vocab_size": 50304}
GIB = 2**30


def osdp(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``osdp ARGV`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


#: The comparison's rows on one node; on several, HSDP's three join them.
ONE_NODE_ROWS = {"OSDP", "DDP", "ZeRO-2", "FSDP", "DDP+SAC", "ZeRO-2+SAC", "FSDP+SAC", "DDP+AC", "ZeRO-2+AC", "FSDP+AC"}
SEVERAL_NODES_ROWS = ONE_NODE_ROWS | {"HSDP", "HSDP+SAC", "HSDP+AC"}


def comparison(stdout: str, expected: set[str] = ONE_NODE_ROWS) -> dict[str, dict[str, str]]:
    """The rows of ``osdp plan``'s strategy comparison, by strategy name (plain-text columns)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    headers = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 2 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(headers):
            break
        rows[cells[0]] = cells
    assert set(rows) == expected, rows
    return {name: dict(zip(headers, cells, strict=True)) for name, cells in rows.items()}


def step_parts(stdout: str) -> dict[str, dict[str, str]]:
    """The rows of ``osdp plan``'s step-parts table, by strategy name."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Step parts per device"))
    headers = re.split(r"\s{2,}", lines[start + 1].strip())
    rows = {}
    for line in lines[start + 3 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(headers):
            break
        rows[cells[0]] = dict(zip(headers, cells, strict=True))
    return rows


def gib(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"GiB": 1, "MiB": 2**-10, "KiB": 2**-20}[unit]


# ============================================================================================== osdp plan
def plan_1_3b_on_rtx4090s(capsys: pytest.CaptureFixture[str], memory: str, *extra: str) -> tuple[int, str, str]:
    """``osdp plan`` of the 1.3B GPT on 8 RTX 4090s at batch 4 under ``memory``."""
    return osdp(
        capsys,
        "plan",
        "--model",
        f"{GPT_FILE}:GPTModule",
        "--init-args",
        json.dumps(GPT_1_3B),
        "--world-size",
        8,
        "--memory",
        memory,
        "--hardware",
        "rtx4090-pcie",
        "--batch-size",
        4,
        *extra,
    )


@pytest.mark.slow
def test_dry_run_of_a_1_3b_gpt_on_8_x_24gib_gpus_shows_ddp_does_not_fit_and_fsdp_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # How long it takes is a benchmark figure (benchmarks/plan_at_scale.py), not a test's: CI may run loaded.
    code, out, err = plan_1_3b_on_rtx4090s(capsys, "24GiB")
    assert code == 0, err
    assert "1.31B parameters" in out and "8 x NVIDIA GeForce RTX 4090" in out
    assert "OSDP plan: Plan(" in out and "predicted peak" in out
    rows = comparison(out)
    # DDP keeps 16 bytes per parameter (fp32 weights and gradients, AdamW's two moments): 19.6 GiB before a single
    # activation, plus the activations of 4 x 1024 tokens through 24 blocks.
    state = 1.31e9 * 16 / GIB
    ddp, fsdp, osdp_row, zero2 = rows["DDP"], rows["FSDP"], rows["OSDP"], rows["ZeRO-2"]
    assert gib(ddp["peak/device"]) > max(state, 24) and ddp["fits"] == "no"
    # The state alone fits a 24 GiB card, but not with batch 1's activations within the budget less the planner's
    # headroom (2%: 23.5 GiB), which every row is judged against, as OSDP's plan is.
    assert ddp["max batch"] == "none"
    # FSDP shards that state 8 ways (2.4 GiB); what remains is mostly activations.
    assert gib(fsdp["peak/device"]) < 24 and fsdp["fits"] == "yes"
    # The planner holds OSDP's allocated peak within the budget less its headroom. On a GPU, "fits" also judges the
    # device total (the allocator's reserved peak, NCCL's buffers, the CUDA context) against the card: a budget of the
    # whole card leaves the plan no room for them.
    assert gib(osdp_row["peak/device"]) <= 24 * 0.98
    for name, row in rows.items():
        assert gib(row["device total"]) > gib(row["peak/device"]), name
        fits = gib(row["peak/device"]) <= 24 * 0.98 and gib(row["device total"]) <= 24
        assert (row["fits"] == "yes") == fits, name
    # OSDP's own plan fits the card: the budget's plan did not, so it was solved again under a lower one.
    assert osdp_row["fits"] == "yes" and "was over the 24.00 GiB card" in out
    for row in (fsdp, osdp_row, zero2):
        assert row["max batch"].isdigit() and int(row["max batch"]) >= 1
    # Whatever fits at batch 4 fits a batch at least that large; OSDP can always fall back to FSDP's choice.
    assert int(fsdp["max batch"]) >= 4 and int(osdp_row["max batch"]) >= int(fsdp["max batch"])
    # Checkpointing every block keeps each block's input instead of its activations: 8 GiB less than DDP (the
    # unsharded state still does not fit with it), and ZeRO-2 and FSDP with it fit batches several times larger.
    ddp_ac = rows["DDP+AC"]
    assert gib(ddp_ac["peak/device"]) < gib(ddp["peak/device"]) - 8
    assert int(rows["FSDP+AC"]["max batch"]) > 4 * int(fsdp["max batch"])
    assert float(ddp_ac["step ms"].replace(",", "")) > float(ddp["step ms"].replace(",", ""))  # a forward again
    # Selective recomputation on every block lies between: less memory than keeping everything, more than full
    # recomputation, and a step between the two (its replay is the forward's operators but the matrix products).
    ddp_sac = rows["DDP+SAC"]
    assert gib(ddp_ac["peak/device"]) < gib(ddp_sac["peak/device"]) < gib(ddp["peak/device"])
    ms = {name: float(row["step ms"].replace(",", "")) for name, row in rows.items()}
    assert ms["DDP"] < ms["DDP+SAC"] < ms["DDP+AC"] and ms["FSDP"] < ms["FSDP+SAC"] < ms["FSDP+AC"]
    # OSDP is never predicted slower than a baseline that fits (same cost model, larger choice).
    step = {name: float(row["step ms"].replace(",", "")) for name, row in rows.items()}
    assert all(step["OSDP"] <= step[name] * 1.001 for name, row in rows.items() if row["fits"] == "yes")
    # Tokens/s per GPU beside samples/s over the 8 ranks: windows of 1,025 ids train on 1,024 tokens each.
    assert "1,024 tokens trained per sample" in out and "4,096 tokens per device and step" in out
    printed = 0.05 * 1024 / 8 + 0.5  # samples/s is printed to 0.1, tokens/s to 1
    for name, row in rows.items():
        if row["fits"] == "yes":
            samples = float(row["samples/s"].replace(",", ""))
            assert float(row["tokens/s/GPU"].replace(",", "")) == pytest.approx(samples * 1024 / 8, abs=printed), name
            at_max = float(row["samples/s @max"].replace(",", ""))
            tokens_at_max = float(row["tokens/s/GPU @max"].replace(",", ""))
            assert tokens_at_max == pytest.approx(at_max * 1024 / 8, abs=printed), name
    assert "\x1b[" not in out, "captured output is not a terminal: plain text"


def test_a_row_within_the_budget_does_not_fit_a_card_its_device_total_exceeds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A budget above the card's 24 GiB: DDP+AC's allocated peak (about 24.5 GiB) is within it, its device total is not
    # within the card.
    code, out, err = plan_1_3b_on_rtx4090s(capsys, "26GiB", "--no-search")
    assert code == 0, err
    ddp_ac = comparison(out)["DDP+AC"]
    assert gib(ddp_ac["peak/device"]) <= 26 * 0.98 and gib(ddp_ac["device total"]) > 24
    assert ddp_ac["fits"] == "no" and ddp_ac["samples/s"] == "-"


def test_a_budget_no_plan_fits_exits_2_with_the_minimum_budget(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = osdp(capsys, "plan", "--config", GPT_CONFIG, "--memory", "1MiB", "--hardware", "l4-pcie")
    assert code == 2 and out == ""
    message = [line for line in err.splitlines() if line.startswith("osdp: error:")]
    assert len(message) == 1 and "Traceback" not in err
    found = re.search(r"the minimum budget is [\d.]+ MiB \((\d+) bytes\)", message[0])
    assert found, message[0]
    # The config's model: 3.2M parameters (12.4 MiB in fp32) whose 16 bytes per parameter of state shard 2 ways,
    # plus 8 x 64 tokens of activations: tens of MiB, not one.
    assert 25 * 2**20 < int(found.group(1)) < 200 * 2**20


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'; known: a100-80g-nvlink, a100-40g-nvlink, h100-sxm"),
        (["--hardware", "l4-pcie", "--memory", "lots"], "cannot parse memory budget 'lots'"),
        (["--hardware", "l4-pcie", "--model", "no/such/file.py:Model"], "model file 'no/such/file.py' does not exist"),
        (
            ["--hardware", "l4-pcie", "--model", "no_such_package.models:GPT"],
            "module 'no_such_package.models' not found",
        ),
        (
            ["--hardware", "l4-pcie", "--model", f"{GPT_FILE}:GPTT"],
            "has no 'GPTT' (did you mean 'GPT'?); it defines: Block, CausalSelfAttention, GPT, GPTModule, MLP",
        ),
        (["--hardware", "l4-pcie", "--model", f"{GPT_FILE}:GPTModule", "--init-arg", "depthh=2"], "unexpected keyword"),
        (["--hardware", "rtx4090-pcie", "--world-size", "16"], "one machine of 8 GPUs; world size 16 needs 2"),
        (["--hardware", "l4-pcie", "--batch", "int64:8xB"], "cannot read the shape in batch spec"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    base = ["plan", "--world-size", "2"] if "--world-size" not in argv else ["plan"]
    model = [] if "--model" in argv else ["--model", f"{GPT_FILE}:GPTModule"]
    code, _, err = osdp(capsys, *base, *model, *argv)
    errors = [line for line in err.splitlines() if line.startswith("osdp: error:")]
    assert code == 2 and len(errors) == 1, err
    assert message in errors[0] and "Traceback" not in err


def test_plan_reads_a_lightningcli_config_and_finds_the_model_class_in_its_script() -> None:
    config = read_configs([GPT_CONFIG])
    assert (config.model, config.world_size, config.batch_size, config.precision) == (None, 2, 8, "32-true")
    assert config.memory_budget == "80MiB" and config.init_args["width"] == 256
    found = discover_cli_model(GPT_CONFIG)
    assert found is not None and found[0] == f"{GPT_FILE}:GPTModule" and found[1].endswith("train.py")
    # A later config overrides the earlier one, argument by argument.
    later = read_configs([GPT_CONFIG, ROOT / "examples" / "gpt" / "configs" / "model_10m.yaml"])
    assert later.init_args["width"] == 384 and later.init_args["lr_schedule"] == "cosine"


def test_the_batch_comes_from_a_spec_a_function_or_the_model() -> None:
    model = build_on_meta(import_object(f"{GPT_FILE}:GPTModule"), {"context_length": 32})
    assert next(model.parameters()).is_meta
    tokens = batch_source(None, model)
    assert tokens.step == "training_step" and tokens.make(3).shape == (3, 33)
    pair = batch_source("float32:8x3x16x16,int64:8", model)
    images, labels = pair.make(5)
    assert pair.default_size == 8 and images.shape == (5, 3, 16, 16) and labels.dtype == torch.int64
    assert images.is_meta, "a batch of any size costs no memory"
    with pytest.raises(CLIError, match="must take the per-device batch size"):
        batch_source("operator:add", model)


def test_batch_scaled_profile_equals_a_profile_made_at_that_batch_size() -> None:
    model = build_on_meta(import_object(f"{GPT_FILE}:GPTModule"), {"context_length": 32, "lr_schedule": "constant"})
    figures = get_hardware("a100-80g-nvlink").figures(8, "32-true")
    source = batch_source(None, model)
    at = {b: estimated_profile(model, source.make(b), figures) for b in (2, 4, 7)}
    scaled = BatchScaledProfile(at[2], 2, at[4], 4).at(7)
    assert at[7].rates == scaled.rates == figures.rates, "the target's rates, not this CPU's"
    assert at[7].copy_bytes_per_second == scaled.copy_bytes_per_second == figures.copy_bytes_per_second
    assert at[7].device.startswith("cuda") and at[7].world_size == 8
    for name, direct in at[7].modules.items():
        got = scaled.modules[name]
        assert got.activation_bytes == direct.activation_bytes, name
        assert got.output_bytes == direct.output_bytes and got.fwd_flops == direct.fwd_flops, name
        assert got.param_bytes == direct.param_bytes and got.optim_state_bytes == direct.optim_state_bytes, name
        assert got.fwd_seconds == pytest.approx(direct.fwd_seconds, rel=1e-9, abs=1e-15), name
        assert got.bwd_seconds == pytest.approx(direct.bwd_seconds, rel=1e-9, abs=1e-15), name
    assert scaled.extra_activation_bytes == at[7].extra_activation_bytes
    assert at[7].loss is not None and at[7].loss.output_bytes > at[4].loss.output_bytes  # type: ignore[union-attr]
    assert scaled.loss == at[7].loss, "the loss region (the logits) grows with the batch too"
    assert scaled.step_overhead_seconds == pytest.approx(at[7].step_overhead_seconds, rel=1e-9)
    assert scaled.batch["tensors"][0]["shape"] == [7, 33]


def test_ring_collective_figures() -> None:
    link = NVLINK3_NVSWITCH
    fits = get_hardware("a100-80g-nvlink").figures(8, "bf16-mixed").collectives
    size = 2**30
    # Ring all-reduce on 8 GPUs: 2 x 7/8 of the buffer through each GPU at the bus bandwidth, 14 ring steps.
    want = COLLECTIVE_LAUNCH_SECONDS + 14 * link.hop_seconds + 2 * 7 / 8 * size / link.bus_bytes_per_second
    assert fits["all_reduce"].seconds(size) == pytest.approx(want)
    assert fits["all_gather"].seconds(size) == pytest.approx(
        COLLECTIVE_LAUNCH_SECONDS + 7 * link.hop_seconds + 7 / 8 * size / link.bus_bytes_per_second
    )
    # 16 GPUs are two nodes: figures within a node, and across nodes one GPU's share of the node's network; the
    # world's ring runs at the network's bus bandwidth (lightning_osdp/cost_model/network.py).
    figures = get_hardware("a100-80g-nvlink").figures(16, "bf16-mixed")
    assert figures.nodes == 2 and figures.collectives["all_gather"].world_size == 8
    across = figures.inter_node_collectives["all_gather"]
    assert (across.world_size, across.beta_bytes_per_second) == (2, INFINIBAND_8X_HDR.bus_bytes_per_second / 8 * 2)
    world = Network(figures, figures.topology).fit("all_gather", figures.topology.world)
    assert world.beta_bytes_per_second == pytest.approx(INFINIBAND_8X_HDR.bus_bytes_per_second * 16 / 15)
    # Precision picks the matmul rate: tensor cores for half precision (the A100's published measured maximum,
    # 271.2 TFLOPS, at a training step's share of it), FP32 units for 32-true (70% of the data sheet's 19.5: nothing
    # is published).
    from lightning_osdp.cli.hardware import TRAINING_MATMUL_EFFICIENCY

    a100 = HARDWARE["a100-80g-nvlink"]
    half = a100.figures(8, "bf16-mixed").rates.matmul_flops_per_second
    single = a100.figures(8, "32-true").rates.matmul_flops_per_second
    assert half / single == pytest.approx(271.2 * TRAINING_MATMUL_EFFICIENCY["ampere"] / (19.5 * 0.7))


def test_hardware_lists_every_built_in_entry(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = osdp(capsys, "hardware", "--world-size", 8)
    assert code == 0
    for name in HARDWARE:
        assert re.search(rf"^{re.escape(name)}\s", out, re.M), name
    assert "Approximations, not measurements" in out


# ============================================================================================== osdp show
@pytest.fixture(scope="module")
def small_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``osdp plan --out`` on the GPT example's budget config (3.2M parameters) on 2 L4s: the plan file."""
    path = tmp_path_factory.mktemp("plan") / "osdp_plan.json"
    code = main(
        [
            "-q",
            "plan",
            "--config",
            str(GPT_CONFIG),
            "--memory",
            "50MiB",
            "--hardware",
            "l4-pcie",
            "--batch-size",
            "4",
            "--no-search",
            "--out",
            str(path),
        ]
    )
    assert code == 0
    return path


def _recomputation(path: Path) -> dict[str, int]:
    plan = Plan.load(path)
    counts: dict[str, int] = {}
    for decision in plan.decisions.values():
        counts[decision.recompute] = counts.get(decision.recompute, 0) + 1
    return counts


def test_plan_takes_activation_checkpointing_from_the_config_and_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """As OSDPStrategy(activation_checkpointing=...) in the config; --activation-checkpointing overrides it."""
    argv = ["plan", "--memory", "50MiB", "--hardware", "l4-pcie", "--batch-size", "4", "--no-search"]
    auto = tmp_path / "auto.json"
    assert osdp(capsys, *argv, "--config", GPT_CONFIG, "--out", auto)[0] == 0
    chosen = _recomputation(auto)
    assert chosen.get("full", 0) + chosen.get("selective", 0) > 0, f"the budget needs recomputation: {chosen}"
    config = tmp_path / "no_recompute.yaml"
    config.write_text(
        GPT_CONFIG.read_text().replace("      plan: null", "      plan: null\n      activation_checkpointing: false")
    )
    assert read_configs([config]).activation_checkpointing is False
    argv += ["--model", f"{GPT_FILE}:GPTModule"]  # the copied config lies away from the example's script
    never = tmp_path / "never.json"
    assert osdp(capsys, *argv, "--config", config, "--out", never)[0] == 0
    assert set(_recomputation(never)) == {"none"}
    full = tmp_path / "full.json"
    flag = ["--activation-checkpointing", "full"]
    assert osdp(capsys, *argv, "--config", config, *flag, "--out", full)[0] == 0
    assert set(_recomputation(full)) == {"none", "full"} and "selective" not in _recomputation(full)
    config.write_text(
        GPT_CONFIG.read_text().replace(
            "      plan: null", "      plan: null\n      activation_checkpointing: sometimes"
        )
    )
    code, _, err = osdp(capsys, *argv, "--config", config)
    assert code == 2 and "activation_checkpointing='sometimes'" in err


def test_plan_accumulates_micro_batches_as_the_trainer_would(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--accumulate-grad-batches (or the config's trainer.accumulate_grad_batches): the gradients held between
    micro-batches and K batches per step, in the peaks, the step times and the rates."""
    argv = ["plan", "--config", GPT_CONFIG, "--memory", "50MiB", "--hardware", "l4-pcie", "--batch-size", "4"]
    argv += ["--no-search"]
    code, once, _ = osdp(capsys, *argv)
    assert code == 0
    code, four, _ = osdp(capsys, *argv, "--accumulate-grad-batches", "4")
    assert code == 0 and "4 micro-batches per optimizer step" in four
    single, accumulated = comparison(once)["DDP"], comparison(four)["DDP"]
    assert gib(accumulated["peak/device"]) > gib(single["peak/device"])  # unsharded gradients held
    parts = step_parts(once)["DDP"], step_parts(four)["DDP"]
    assert float(parts[1]["compute"]) == pytest.approx(4 * float(parts[0]["compute"]), abs=0.2)
    config = tmp_path / "accumulating.yaml"
    config.write_text(GPT_CONFIG.read_text().replace("trainer:\n", "trainer:\n  accumulate_grad_batches: 4\n", 1))
    assert read_configs([config]).accumulate_grad_batches == 4
    code, _, err = osdp(capsys, *argv, "--accumulate-grad-batches", "0")
    assert code == 2 and "--accumulate-grad-batches must be at least 1" in err


def test_plan_on_several_nodes_reads_in_the_units_published_runs_compare(capsys: pytest.CaptureFixture[str]) -> None:
    """HSDP+AC and HSDP+SAC beside FSDP's rows; tokens/s per GPU beside samples/s; the MFU's convention named (PaLM's,
    causal attention in full) and the other on request; identical blocks folded in the plan table, every unit on
    request; one figure for compute."""
    init = {"width": 64, "depth": 6, "heads": 4, "context_length": 64, "vocab_size": 256}
    argv = ["plan", "--model", f"{GPT_FILE}:GPTModule", "--init-args", json.dumps(init), "--nodes", 2]
    argv += ["--gpus-per-node", 4, "--hardware", "h100-sxm", "--precision", "bf16-fsdp", "--batch-size", 2]
    code, out, err = osdp(capsys, *argv, "--no-search")
    assert code == 0, err
    rows = comparison(out, SEVERAL_NODES_ROWS)
    peak = {name: gib(row["peak/device"]) for name, row in rows.items()}
    step = {name: float(row["step ms"].replace(",", "")) for name, row in rows.items()}
    # Recomputation trades memory for time under hybrid sharding as under full sharding.
    assert peak["HSDP+AC"] < peak["HSDP+SAC"] < peak["HSDP"] and step["HSDP"] < step["HSDP+SAC"] < step["HSDP+AC"]
    assert rows["HSDP+AC"]["modes"] == "all hybrid_shard"  # the name says the recomputation, once
    assert "+recompute" not in out and "+selective" not in out
    # Windows of 65 ids train on 64 tokens: tokens/s per GPU is samples/s (over the 8 ranks) x 64 / 8.
    assert "64 tokens trained per sample" in out and "128 tokens per device and step" in out
    for name, row in rows.items():
        samples = float(row["samples/s"].replace(",", ""))
        assert float(row["tokens/s/GPU"].replace(",", "")) == pytest.approx(samples * 64 / 8, abs=0.05 * 8 + 0.5), name
    # The MFU is PaLM's by default, named in the title; the note gives OSDP's in the other convention.
    assert "(ms; MFU: PaLM convention, causal attention counted in full)" in out
    palm = {name: float(row["MFU"].rstrip("%")) for name, row in step_parts(out).items()}
    other = re.search(r"OSDP's in the other convention \(--mfu-convention flash-attention\): ([0-9.]+)%", out)
    assert other is not None
    code, flash_out, err = osdp(capsys, *argv, "--no-search", "--mfu-convention", "flash-attention", "--all-units")
    assert code == 0, err
    assert "(ms; MFU: FlashAttention convention, causal attention at the scores computed)" in flash_out
    flash = {name: float(row["MFU"].rstrip("%")) for name, row in step_parts(flash_out).items()}
    assert flash["OSDP"] == pytest.approx(float(other.group(1)), abs=0.05)
    # Causal attention's skipped scores count in PaLM's convention only (a model this small rounds both near 0%).
    assert all(palm[name] >= flash[name] for name in palm)
    # The six identical blocks on one line of the plan table; every one of them with --all-units.
    folded = [line.split() for line in out.splitlines() if line.startswith("model.blocks.")]
    assert len(folded) < 6 and any(re.fullmatch(r"model\.blocks\.\d+-\d+", cells[0]) for cells in folded)
    assert sum(int(cells[1][1:]) if cells[1].startswith("x") else 1 for cells in folded) == 6
    every = [line.split()[0] for line in flash_out.splitlines() if line.startswith("model.blocks.")]
    assert every == [f"model.blocks.{i}" for i in range(6)]
    # Every column is explained below its table.
    legend = ("units: ", "kept: ", "gathered: ", "comm ms: ", "added ms: ", "tokens/s/GPU: ", "+AC: ", "+SAC: ")
    assert all(f" {name}" in out or f"\n{name}" in out for name in legend), legend
    # One compute figure: the plan's summary gives the step-parts table's.
    summary = re.search(r"predicted step [0-9.,]+ ms \(compute ([0-9.]+),", out)
    assert summary is not None and float(summary.group(1)) == pytest.approx(
        float(step_parts(out)["OSDP"]["compute"].replace(",", "")), abs=0.05
    )


def test_the_plan_table_folds_blocks_with_their_own_units_and_only_identical_ones() -> None:
    from lightning_osdp.cost_model import predict
    from lightning_osdp.solver import format_plan

    from synthetic import gpt_profile

    profile = gpt_profile(depth=5, width=64)
    decisions: dict[str, object] = {"": "no_shard"}
    for i in range(5):  # every block sharded, its MLP's first Linear a unit of its own cut in two
        decisions |= {f"model.blocks.{i}": "full_shard", f"model.blocks.{i}.mlp.fc": ("full_shard", 2)}
    plan = Plan(decisions)  # type: ignore[arg-type]
    prediction = predict(profile, plan, 2)
    every = format_plan(plan, prediction, rich_markup=False)
    folded = format_plan(plan, prediction, rich_markup=False, fold=True).splitlines()
    rows = [line.split()[:3] for line in folded if line.startswith("model.")]
    assert rows == [["model.blocks.0-4", "x5", "33.3K"], ["model.blocks.0-4.mlp.fc", "x5", "16.6K"]]
    # The figures are each block's; the totals and the summary stay those of every unit.
    assert [line.split() for line in folded[-4:]] == [line.split() for line in every.splitlines()[-4:]]
    assert sum(line.startswith("model.") for line in every.splitlines()) == 10
    # A block whose own unit differs (not split) ends the run.
    decisions["model.blocks.4.mlp.fc"] = "full_shard"
    plan = Plan(decisions)  # type: ignore[arg-type]
    table = format_plan(plan, predict(profile, plan, 2), rich_markup=False, fold=True).splitlines()
    assert [line.split()[0] for line in table if line.startswith("model.")] == [
        "model.blocks.0-3", "model.blocks.0-3.mlp.fc", "model.blocks.4", "model.blocks.4.mlp.fc"
    ]  # fmt: skip


def test_the_plan_table_and_the_comparison_count_decisions_in_one_vocabulary() -> None:
    from lightning_osdp import Decision

    plan = Plan(
        {
            "": "no_shard",
            "blocks.0": Decision("full_shard", recompute="full"),
            "blocks.1": Decision("full_shard", split=2, recompute="selective"),
            "blocks.2": "hybrid_shard",
        }
    )
    assert plan.counts() == "1 no_shard, 2 full_shard, 1 hybrid_shard, 1 split, 1 AC, 1 SAC"
    assert plan.summary() == f"Plan(4 decisions: {plan.counts()})"  # the strategy's logs say it alike


def test_the_mfu_counts_causal_attention_in_full_or_at_its_work_by_convention() -> None:
    from lightning_osdp.cli import parsers
    from lightning_osdp.cli.plan import MFU_CONVENTIONS, model_flops_utilization
    from lightning_osdp.profiling.model_profile import ModelProfile, ModuleProfile

    assert tuple(MFU_CONVENTIONS) == parsers.MFU_CONVENTIONS  # written out in the parser, which imports no torch
    blocks = {
        "": ModuleProfile("", "Model", None, fwd_flops=10),
        "attention": ModuleProfile("attention", "Attention", "", fwd_flops=50, fwd_causal_skipped_flops=40),
    }
    profile = ModelProfile(blocks)
    # Three times the forward's FLOPs (forward and backward) per second over the peak.
    assert model_flops_utilization(profile, 2.0, 100.0) == pytest.approx(3 * 100 / 2 / 100)
    assert model_flops_utilization(profile, 2.0, 100.0, "flash-attention") == pytest.approx(3 * 60 / 2 / 100)
    assert model_flops_utilization(profile, 2.0, 0.0) is None  # no data-sheet peak
    with pytest.raises(ValueError, match="unknown MFU convention 'hfu'"):
        model_flops_utilization(profile, 2.0, 100.0, "hfu")


def test_show_a_plan_file_with_its_profile(capsys: pytest.CaptureFixture[str], small_plan: Path) -> None:
    path = small_plan
    plan = Plan.load(path)
    assert path.with_name("osdp_plan.profile.json").is_file()
    assert plan.info["dry_run"]["hardware"] == "l4-pcie" and plan.info["dry_run"]["batch_size"] == 4
    code, out, err = osdp(capsys, "show", path)
    assert code == 0, err
    assert f"{path}: {plan.summary()}" in out and "2 ranks, budget 50.00 MiB per device" in out
    # The profile beside the plan gives the same prediction the solver made.
    peak = re.search(r"predicted peak ([\d.]+ MiB) of budget 50.00 MiB", out)
    assert plan.report is not None
    assert peak and gib(peak.group(1)) * GIB == pytest.approx(plan.report.predicted_peak_bytes, rel=1e-3)
    assert PLAN_LEGEND[0] in out  # every column explained, as under osdp plan
    code, every, _ = osdp(capsys, "show", path, "--all-units")
    assert code == 0 and len(every.splitlines()) >= len(out.splitlines())
    for name, decision in plan:
        assert re.search(rf"^{re.escape(name or '<root>')}\s.*\s{decision.mode}\s", every, re.M), name


def test_show_plot_needs_matplotlib_and_draws_with_it(
    capsys: pytest.CaptureFixture[str],
    small_plan: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = small_plan
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
        code, _, err = osdp(capsys, "show", path, "--plot", tmp_path / "missing.png")
    assert code == 2 and 'pip install "lightning-osdp[plot]"' in err
    pytest.importorskip("matplotlib")
    code, _, err = osdp(capsys, "show", path, "--plot", tmp_path / "plan.png")
    assert code == 0, err
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hardware_profile_file_reuses_measured_figures(small_plan: Path) -> None:
    profile_path = small_plan.with_name("osdp_plan.profile.json")
    l4 = get_hardware("l4-pcie").figures(2, "32-true")
    same = hardware_from_file(profile_path, 2)
    assert same.rates == l4.rates and same.copy_bytes_per_second == l4.copy_bytes_per_second
    assert same.collectives["all_reduce"].beta_bytes_per_second == l4.collectives["all_reduce"].beta_bytes_per_second
    # Measured on 2 ranks, used for 8: the ring's bus bandwidth carries over.
    eight = hardware_from_file(profile_path, 8).collectives["all_gather"]
    assert eight.beta_bytes_per_second == pytest.approx(
        get_hardware("l4-pcie").figures(8, "32-true").collectives["all_gather"].beta_bytes_per_second
    )


def test_hardware_profile_from_a_measured_run_derives_its_rates(tmp_path: Path) -> None:
    from lightning_osdp.profiling import profile

    model = build_on_meta(import_object(f"{GPT_FILE}:GPTModule"), {"context_length": 32, "lr_schedule": "constant"})
    model.to_empty(device="cpu")
    measured = profile(model, torch.zeros(4, 33, dtype=torch.long), mode="measured", repeats=1)
    path = measured.save(tmp_path / "measured.profile.json")
    # No "rates" in a measured profile: the matmul rate is fitted to its modules' FLOPs and times.
    rates = hardware_from_file(path, 1).rates
    assert 1e8 < rates.matmul_flops_per_second < 1e14 and rates.memory_bytes_per_second > 0
    # Measured without a process group: it says nothing about communication, so it cannot plan for 8 ranks.
    with pytest.raises(CLIError, match="measured on one rank"):
        hardware_from_file(path, 8)


# ============================================================================================== checkpoints
@pytest.mark.slow
def test_show_and_consolidate_a_checkpoint_of_a_one_process_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan = Plan({"": "no_shard", "h.0": "full_shard", "h.1": "shard_grad_op", "h.2": "full_shard"})
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
    trainer.fit(model, loaders()[0])
    sharded = tmp_path / "step=3.ckpt"
    trainer.save_checkpoint(sharded)
    assert sharded.is_dir()
    trained = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }

    code, out, err = osdp(capsys, "show", sharded)
    assert code == 0, err
    assert f"{sharded}: {plan.summary()}" in out and "1 ranks" in out
    for name, decision in plan:
        assert re.search(rf"^{re.escape(name or '<root>')}\s+{decision.mode}\s+1$", out, re.M), name
    assert "No profile was saved with this plan" in out

    full = tmp_path / "model.ckpt"
    code, out, err = osdp(capsys, "consolidate", sharded, full)
    assert code == 0, err
    assert out.startswith(f"wrote {full} (")
    loaded = TinyGPT.load_from_checkpoint(full)
    state = dict(loaded.named_parameters())
    assert set(state) == set(trained)
    assert all(torch.equal(state[k].detach(), trained[k]) for k in trained)
    assert torch.load(full, weights_only=True, map_location="cpu")["global_step"] == 3
    # The consolidated file carries the plan too.
    code, out, _ = osdp(capsys, "show", full)
    assert code == 0 and plan.summary() in out

    code, _, err = osdp(capsys, "consolidate", tmp_path / "nothing.ckpt", tmp_path / "x.ckpt")
    assert code == 2 and "does not exist" in err


# ============================================================================================== entry point
def test_module_entry_point_reports_errors_in_one_line() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_osdp.cli",
            "plan",
            "--model",
            "x:Y",
            "--world-size",
            "8",
            "--hardware",
            "a100",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"osdp: error: unknown hardware 'a100'; known: {', '.join(HARDWARE)} (or --hardware-profile FILE)"
    ]


# ============================================================================================== output
def test_tables_are_plain_text_when_piped_and_rich_on_a_terminal() -> None:
    import io

    assert plain_table(["a", "n"], [["x", "1"], ["yyy", "22"]], right=[1]) == "a     n\n-------\nx     1\nyyy  22"
    buffer = io.StringIO()
    Output(buffer).table("T", ["a", "n"], [["x", "1"]], right=[1])
    assert "\x1b[" not in buffer.getvalue() and "─" not in buffer.getvalue()
    buffer = io.StringIO()
    Output(buffer, rich=True, width=40).table("T", ["a", "n"], [["x", "1"]], right=[1])
    assert "─" in buffer.getvalue()
