"""``OSDPStrategy(mixed_precision="bf16")``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on
the sharded units, Lightning's autocast for the replicated ones; the argument, a real 2-process run against plain
FSDP2 with the same policy, and the cost model's bytes under it.

The reference for the sharded units is Lightning's own FSDP2 strategy (``ModelParallelStrategy``) with a
``configure_model`` that wraps each block and the model with the same policy, as torchtitan wraps Llama: OSDP with a
plan sharding the same units must train identically. The reference for the replicated units is Lightning's DDP under
``bf16-mixed``: with nothing sharded the policy has nothing to cast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_osdp import OSDPStrategy, Plan
from lightning_osdp.cost_model import CostModelConfig, predict
from lightning_osdp.options import BF16_POLICY, check_mixed_precision
from lightning_osdp.profiling import profile, profile_with_policy
from lightning_osdp.profiling.model_profile import ModelProfile

from conftest import ROOT, torchrun
from models import TinyGPT
from synthetic import one_linear_on

# ================================================================================================ the argument


def test_bf16_is_the_policy_large_fsdp2_runs_use() -> None:
    assert check_mixed_precision("bf16") == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert check_mixed_precision(None) is None
    custom = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    assert check_mixed_precision(custom) is custom
    assert OSDPStrategy(mixed_precision="bf16").mixed_precision == BF16_POLICY
    assert OSDPStrategy().mixed_precision is None  # the default: Lightning's precision plugin alone


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("fp16", ValueError, "takes None, 'bf16' or a torch.distributed.fsdp.MixedPrecisionPolicy, got 'fp16'"),
        (16, TypeError, "got int"),
        (MixedPrecisionPolicy(param_dtype=torch.float32), ValueError, "param_dtype must be torch.bfloat16"),
    ],
)
def test_a_bad_policy_fails_at_construction_naming_the_argument(value: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape("OSDPStrategy(mixed_precision=...)") + ".*" + re.escape(message)):
        OSDPStrategy(mixed_precision=value)


def test_the_policy_needs_the_autocast_of_its_dtype_and_says_so_when_the_trainer_is_built() -> None:
    with pytest.raises(ValueError, match=re.escape("needs Trainer(precision='bf16-mixed'), got precision='32-true'")):
        L.Trainer(accelerator="cpu", devices=1, strategy=OSDPStrategy(mixed_precision="bf16"))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=OSDPStrategy(mixed_precision="bf16"), precision="bf16-mixed"
    )
    assert trainer.strategy.mixed_precision == BF16_POLICY
    # A policy that casts no parameter (reduce in bf16 only) goes with any precision.
    reduce_only = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    L.Trainer(accelerator="cpu", devices=1, strategy=OSDPStrategy(mixed_precision=reduce_only))


def test_lightning_cli_yaml_accepts_the_policy_by_name(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  precision: bf16-mixed\n  strategy:\n"
        "    class_path: lightning_osdp.OSDPStrategy\n    init_args:\n      mixed_precision: bf16\n"
    )
    cli = LightningCLI(TinyGPT, run=False, args=["--config", str(config)], save_config_callback=None)
    assert isinstance(cli.trainer.strategy, OSDPStrategy) and cli.trainer.strategy.mixed_precision == BF16_POLICY
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("mixed_precision: bf16", "mixed_precision: fp8"))
    with pytest.raises(ValueError, match=re.escape("OSDPStrategy(mixed_precision=...)")):
        LightningCLI(TinyGPT, run=False, args=["--config", str(bad)], save_config_callback=None)


# ================================================================================================ 2 processes
CASES = ["fsdp2", "full", "ddp", "replicated", "mixed", "memory"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("mixed_precision")
    torchrun(ROOT / "tests" / "distributed" / "mixed_precision_runner.py", str(out), *CASES)
    return {case: [torch.load(out / f"{case}.rank{r}.pt", weights_only=False) for r in range(2)] for case in CASES}


def _mean_rel(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The mean over tensors of ``|state - reference| / |reference|`` (Frobenius norms)."""
    assert set(state) == set(reference)
    return sum(float((state[k] - v).norm() / v.norm()) for k, v in reference.items()) / len(reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_units_train_exactly_as_plain_fsdp2_with_the_same_policy(runs: dict[str, list[dict[str, Any]]]) -> None:
    for rank in range(2):
        osdp, fsdp2 = runs["full"][rank], runs["fsdp2"][rank]
        assert len(osdp["losses"]) == len(fsdp2["losses"]) == 12
        # Same units, same policy, same collectives' results (two ranks: a sum of two terms has one order).
        assert osdp["losses"] == fsdp2["losses"]
        # Every weight is gathered in bf16 for the forward, and stored in fp32.
        assert set(osdp["weight_dtypes"].values()) == {"bfloat16"} == set(fsdp2["weight_dtypes"].values())
        assert osdp["param_dtypes"] == ["float32"]
    state, want = runs["full"][0]["state"], runs["fsdp2"][0]["state"]
    assert set(state) == set(want)
    for key, value in want.items():
        assert torch.equal(state[key], value), key


@pytest.mark.distributed
@pytest.mark.slow
def test_with_nothing_sharded_the_policy_is_lightnings_ddp_under_bf16_mixed(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for rank in range(2):
        assert runs["replicated"][rank]["losses"] == runs["ddp"][rank]["losses"]
        # Autocast casts the fp32 weights inside each matmul: the forward sees them in fp32.
        assert set(runs["replicated"][rank]["weight_dtypes"].values()) == {"float32"}
    state, want = runs["replicated"][0]["state"], runs["ddp"][0]["state"]
    for key, value in want.items():
        assert torch.equal(state[key], value), key


@pytest.mark.distributed
@pytest.mark.slow
def test_a_mixed_plan_gathers_its_sharded_units_in_bf16_and_trains_as_both_references(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    mixed = runs["mixed"][0]
    dtypes = mixed["weight_dtypes"]
    assert {dtypes[f"model.layers.{i}.attention.wq"] for i in (1, 2)} == {"bfloat16"}  # full_shard, shard_grad_op
    assert dtypes["model.layers.0.attention.wq"] == dtypes["model.output"] == "float32"  # no_shard (DDP)
    # The replicated units compute their matmuls from the same bf16-rounded weights; what differs is the precision
    # of the few non-matmul uses of a weight (RMSNorm scales, the embedding, in fp32 when replicated). The two
    # references differ from each other by as much.
    spread = max(abs(a - b) / abs(b) for a, b in zip(runs["ddp"][0]["losses"], runs["fsdp2"][0]["losses"], strict=True))
    for ref in ("ddp", "fsdp2"):
        for got, want in zip(mixed["losses"], runs[ref][0]["losses"], strict=True):
            assert abs(got - want) <= max(2 * spread, 1e-4) * abs(want), (ref, got, want)
    assert mixed["losses"][-1] < mixed["losses"][0] - 0.2  # and it learns
    # Parameters after 12 AdamW steps: as far from each reference, on average over tensors, as they are from each
    # other (AdamW normalises small gradient differences into lr-sized steps, so single elements say little).
    fsdp2, ddp = runs["fsdp2"][0]["state"], runs["ddp"][0]["state"]
    references = _mean_rel(ddp, fsdp2)
    assert _mean_rel(mixed["state"], fsdp2) <= 1.5 * references
    assert _mean_rel(mixed["state"], ddp) <= 1.5 * references


@pytest.mark.distributed
@pytest.mark.slow
def test_predicted_peaks_hold_under_both_precisions_and_the_policy_saves_autocasts_copies(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """A 4-block Llama on 2 ranks under bf16-mixed, with and without the policy, all full_shard and half the blocks
    replicated: the strategy's measured peak (max over ranks) against ``predict`` of a profile of the same step."""
    rows = runs["memory"][0]
    assert set(rows) == {"autocast full_shard", "autocast mixed", "bf16 full_shard", "bf16 mixed"}
    for name, row in rows.items():
        assert row["predicted"] == pytest.approx(row["measured"], rel=0.10), name
    # The policy's sharded units keep no bf16 copy of their weights between forward and backward.
    assert rows["bf16 full_shard"]["measured"] < 0.9 * rows["autocast full_shard"]["measured"]


# ================================================================================================ the cost model
def test_bytes_under_the_policy_by_hand() -> None:
    """Linear(4 -> 3) on 2 ranks, stored fp32: FSDP2 gathers bf16 and reduce-scatters fp32; DDP keeps fp32 and
    autocast's bf16 copy of the weight (not of the 1-D bias)."""
    profile = one_linear_on("cuda:0")
    profile.mixed_precision = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    full = predict(profile, Plan({"": "no_shard", "a": "full_shard"}))
    (unit,) = [u for u in full.units if u.name == "a"]
    # Shard: 2 of 3 rows of the weight and of the bias, fp32: 10 elements, 40 bytes; gathered 2 x 10 in bf16.
    assert unit.kept.parameters == 40 and unit.kept.gradients == 40
    assert unit.gathered == 40 + 40  # the unsharded parameters and the all-gather output, bf16
    all_gather = 1e-3 + 40 / 1e6  # half the bytes of the fp32 gather
    reduce_scatter = 2e-3 + 80 / 5e5  # fp32
    assert full.communication_seconds == pytest.approx(2 * all_gather + reduce_scatter)
    replicated = predict(profile, Plan({"": "no_shard", "a": "no_shard"}))
    (unit,) = [u for u in replicated.units if u.name == "a"]
    assert unit.kept.parameters == 60 + 12 * 2 and unit.kept.gradients == 60  # fp32 bucket
    plain = dataclass_without_policy(profile)
    (unit,) = [u for u in predict(plain, Plan({"": "no_shard", "a": "full_shard"})).units if u.name == "a"]
    assert unit.gathered == 80 + 80


def dataclass_without_policy(profile: ModelProfile) -> ModelProfile:
    import dataclasses

    return dataclasses.replace(profile, mixed_precision=None)


def test_a_profile_under_the_policy_keeps_stored_bytes_and_drops_autocasts_weight_copies() -> None:
    """Autocast over fp32 weights saves a bf16 copy of every Linear weight for backward; FSDP2's policy computes with
    the gathered bf16 weights themselves. The profile under the policy holds the stored (fp32) parameter, gradient and
    optimizer bytes of the plain one, and the activations less those copies."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def bf16_autocast() -> Any:
        return MixedPrecision("bf16-mixed", "cpu").train_step_context()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Linear(32, 8, bias=False))
    batch = torch.randn(4, 16)
    kwargs: dict[str, Any] = {"step": "forward", "optimizer": torch.optim.AdamW, "step_context": bf16_autocast}
    plain = profile(model, batch, **kwargs)
    policy = profile_with_policy(model, batch, BF16_POLICY, **kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model is left as it was
    assert policy.mixed_precision == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    for name in ("0", "2"):
        a, b = plain.modules[name], policy.modules[name]
        for field in ("param_bytes", "trainable_param_bytes", "grad_bytes", "optim_state_bytes"):
            assert getattr(b, field) == getattr(a, field), (name, field)
    # The first Linear's input needs no gradient, so autograd keeps only that input (bf16 either way); the second
    # keeps its weight too: autocast's bf16 copy, which the policy's step does not make.
    assert plain.modules["0"].activation_bytes == policy.modules["0"].activation_bytes == 4 * 16 * 2
    assert plain.modules["2"].activation_bytes - policy.modules["2"].activation_bytes == 32 * 8 * 2
    saved = json.loads(json.dumps(policy.to_dict()))
    assert ModelProfile.from_dict(saved).mixed_precision == policy.mixed_precision


def test_a_dry_run_under_the_policy_gathers_half_the_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_osdp.cli import main

    init = {"width": 128, "depth": 2, "heads": 4, "context_length": 64, "vocab_size": 256}
    outputs = {}
    for precision in ("bf16-mixed", "bf16-fsdp"):
        capsys.readouterr()
        code = main(
            [
                "plan",
                "--model",
                f"{ROOT / 'examples' / 'gpt' / 'gpt.py'}:GPTModule",
                "--init-args",
                json.dumps(init),
                "--world-size",
                "8",
                "--memory",
                "1GiB",
                "--hardware",
                "h100-sxm",
                "--batch-size",
                "2",
                "--precision",
                precision,
                "--no-search",
            ]
        )
        outputs[precision] = capsys.readouterr().out
        assert code == 0
    assert "precision bf16-fsdp" in outputs["bf16-fsdp"]
    parts = {p: _parts(out) for p, out in outputs.items()}
    # FSDP: all-gathers in bf16 instead of fp32 (the reduce-scatters stay fp32), copy-outs of half the bytes.
    assert parts["bf16-fsdp"]["FSDP"]["copies"] == pytest.approx(parts["bf16-mixed"]["FSDP"]["copies"] / 2, rel=0.05)
    # DDP has no FSDP2 unit: its figures are those of bf16-mixed but for autocast's weight copies, now counted with the
    # parameters instead of the activations (the same bytes).
    assert parts["bf16-fsdp"]["DDP"]["all comm"] == parts["bf16-mixed"]["DDP"]["all comm"]


def _parts(out: str) -> dict[str, dict[str, float]]:
    """The step-parts and communication tables' figures (ms) by strategy and column (the MFU left out)."""
    lines = out.splitlines()
    rows: dict[str, dict[str, float]] = {}
    for title in ("Step parts per device", "Communication per device and step"):
        start = next(i for i, line in enumerate(lines) if line.startswith(title))
        headers = re.split(r"\s{2,}", lines[start + 1].strip())
        for line in lines[start + 3 : start + 7]:
            cells = re.split(r"\s{2,}", line.strip())
            figures = zip(headers[1:], cells[1:], strict=True)
            rows.setdefault(cells[0], {}).update({h: float(c.replace(",", "")) for h, c in figures if h != "MFU"})
    return rows


def test_default_cost_model_config_reads_the_policy_from_the_profile() -> None:
    profile = one_linear_on("cuda:0")
    assert CostModelConfig().resolve(profile).param_itemsize is None
    profile.mixed_precision = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    resolved = CostModelConfig().resolve(profile)
    assert (resolved.param_itemsize, resolved.reduce_itemsize) == (2, 4)
