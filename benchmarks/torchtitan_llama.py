"""The dry run's FSDP rows beside the published figures of the same Llama training runs.

``osdp plan`` predicts a model's step on hardware that is not here. This script puts its prediction for runs that
torchtitan published (``docs/performance.md`` and ``benchmarks/llama3_h100_202412_torchtitan.md`` of
pytorch/torchtitan) beside the published figures, with the model of ``examples/llama`` at each run's shape, FSDP over
every block and the rest as one unit (torchtitan's wrapping), and FSDP2's ``MixedPrecisionPolicy(bf16, fp32)``
(``--precision bf16-fsdp``, torchtitan's default):

* Llama 3.1 8B on 8 H100s (96 GB HBM2e at 2.4 TB/s, 500 W: the ``h100-sxm5-96g`` preset), local batch 2 at sequence
  8,192, selective activation checkpointing: 5,762 tokens/s per GPU at 82.4 GiB (Table 1, "FSDP");
* Llama 3 8B on 64 A100-80GB (8 nodes), local batch 1 at 8,192, selective (op) activation checkpointing: 2,973
  tokens/s per GPU, 58.2% MFU;
* Llama 2 13B on 64 A100-80GB, local batch 2 at 4,096, no activation checkpointing: 2,162 tokens/s per GPU, 61.1%;
* Llama 3.1 405B's shape on 64 nodes of 8 H100 80GB (``h100-sxm``, 8 x 400 Gb/s InfiniBand), local batch 1 at 8,192,
  every block recomputed: no FSDP-only run of it is published (torchtitan's ran out of memory on 128 H100s); beside
  it, the MFU of the runs that are: 38-43% for Meta's Llama 3 405B with TP, PP, CP and FSDP on 8,192-16,384 H100s
  (the Llama 3 paper, Table 4, BF16), and torchtitan's 29.0% for FSDP 16 x TP 8 on 128 H100 96GB, local batch 2, full
  recomputation (``docs/performance.md`` before 2025, "Llama 3.1 performance numbers").

MFU is torchtitan's (``torchtitan/utils.py`` ``get_num_flop_per_token``): ``6 * parameters without the embedding +
12 * layers * heads * head_dim * sequence`` FLOPs per token (causal attention counted as full, "we follow the
convention"), over the data sheet's dense BF16 peak (989 TFLOPS for both H100s, as torchtitan divides by).

Selective activation checkpointing (per operator) is a plan's choice (``recompute="selective"``: the outputs of the
matrix products and attention kept, the other operators recomputed): the runs that use it are predicted with it on
every block, and, beside it, with every block fully recomputed and with every second block, as the dry run could only
express them before. torchtitan's published runs also recompute every second matrix product of a block (its
``_save_list`` policy); OSDP's selective policy keeps them all, so its figures sit above torchtitan's in memory and
below in recomputed work (``benchmarks/calibration.py`` predicts these runs with torchtitan's policy and kernels).
``fits`` says whether the predicted peak fits the GPU's memory less the CUDA reserve and the planner's headroom and the
device total (``cost_model/device_memory.py``) fits the card, as ``osdp plan`` judges it.

Run from the repository root: ``python benchmarks/torchtitan_llama.py [--only NAME]`` (the 405B shape takes most of
the time: a few minutes on 2 cores). ``--out FILE`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "llama"))

from lightning_osdp.budget import CUDA_RESERVE_BYTES, format_bytes
from lightning_osdp.cli.estimate import estimated_profile
from lightning_osdp.cli.hardware import get_hardware
from lightning_osdp.cost_model import Prediction, predict
from lightning_osdp.cost_model.device_memory import plan_device_memory
from lightning_osdp.options import BF16_POLICY
from lightning_osdp.plan import Decision, Plan
from lightning_osdp.solver.policy import DEFAULT_MEMORY_HEADROOM, planned_budget

from llama import LLAMA3_1_8B, LlamaModule, ffn_hidden_size

GIB = 2**30


@dataclass(frozen=True)
class PublishedRun:
    """One published run (``tokens_per_second`` ``None``: none at this configuration, only ``mfu`` references).

    Attributes:
        activation_checkpointing: ``"selective"``/``"selective op"`` (per operator: not expressible yet, modelled by
            its two block-level ends), ``"full"`` (every block) or ``"none"``.
        mfu: the published MFU (torchtitan's convention), or a range ``(low, high)`` of comparable runs.
        nodes: nodes of the world (``None``: as few as the preset's 8-GPU machines hold).
    """

    name: str
    shape: dict[str, Any]
    hardware: str
    world_size: int
    batch_size: int
    activation_checkpointing: str
    tokens_per_second: float | None
    memory_gib: float | None
    source: str
    mfu: float | tuple[float, float] | None = None
    nodes: int | None = None


LLAMA3_8B = {**LLAMA3_1_8B}  # Llama 3 and 3.1 8B share the architecture; 3.1 only extends RoPE for long contexts
LLAMA2_13B = {
    "vocab_size": 32000,
    "context_length": 4096,
    "dim": 5120,
    "n_layers": 40,
    "n_heads": 40,
    "n_kv_heads": None,
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "rope_theta": 10000.0,
}
#: Llama 3.1 405B (Meta's params.json; torchtitan's llama3_configs["405B"]): FFN 53,248 (1.2 x 2/3 x 4 x 16,384
#: rounded up to a multiple of 4,096), at sequence 8,192.
LLAMA3_1_405B = {
    "vocab_size": 128256,
    "context_length": 8192,
    "dim": 16384,
    "n_layers": 126,
    "n_heads": 128,
    "n_kv_heads": 8,
    "multiple_of": 4096,
    "ffn_dim_multiplier": 1.2,
    "rope_theta": 500000.0,
}

RUNS = (
    PublishedRun(
        "Llama 3.1 8B, 8 x H100 96GB",
        LLAMA3_1_8B,
        "h100-sxm5-96g",
        8,
        2,
        "selective",
        5762.0,
        82.4,
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 1 (FSDP), local batch 2, selective AC, no "
        "torch.compile, no Float8; its text: 8B on 8 or 128 H100 without Float8 at 33% to 39% MFU (5,762 tokens/s is "
        "33.7% by its formula)",
        mfu=0.33,
    ),
    PublishedRun(
        "Llama 3 8B, 64 x A100 80GB",
        LLAMA3_8B,
        "a100-80g-nvlink",
        64,
        1,
        "selective op",
        2973.0,
        None,
        "torchtitan docs/performance.md, Llama 3 performance numbers: batch 1, selective op AC, 2,973 WPS (58.2% MFU)",
        mfu=0.582,
    ),
    PublishedRun(
        "Llama 2 13B, 64 x A100 80GB",
        LLAMA2_13B,
        "a100-80g-nvlink",
        64,
        2,
        "none",
        2162.0,
        None,
        "torchtitan docs/performance.md, Llama 2 performance numbers: batch 2, no AC, 2,162 WPS (61.1% MFU)",
        mfu=0.611,
    ),
    PublishedRun(
        "Llama 3.1 405B, 512 x H100 80GB",
        LLAMA3_1_405B,
        "h100-sxm",
        512,
        1,
        "full",
        None,
        None,
        "no FSDP-only run published; MFU of comparable runs: Meta's 4-D parallel Llama 3 405B 38-43% (Llama 3 paper, "
        "Table 4, BF16, 8,192-16,384 H100); torchtitan FSDP 16 x TP 8, 128 H100 96GB, batch 2, full AC: 29.0%",
        mfu=(0.38, 0.43),
        nodes=64,
    ),
)


def flops_per_token(shape: dict[str, Any], parameters_without_embedding: int) -> float:
    """torchtitan's model FLOPs per token (see the module docstring)."""
    layers, heads, dim, seq = shape["n_layers"], shape["n_heads"], shape["dim"], shape["context_length"]
    return 6 * parameters_without_embedding + 12 * layers * heads * (dim // heads) * seq


def _parameters_without_embedding(shape: dict[str, Any]) -> int:
    dim, layers, vocab = shape["dim"], shape["n_layers"], shape["vocab_size"]
    heads, kv = shape["n_heads"], shape["n_kv_heads"] or shape["n_heads"]
    hidden = ffn_hidden_size(dim, shape["multiple_of"], shape["ffn_dim_multiplier"])
    attention = dim * dim * 2 + 2 * dim * (dim // heads) * kv
    block = attention + 3 * dim * hidden + 2 * dim
    return layers * block + dim + vocab * dim  # blocks, final norm, output head


def fsdp_predictions(run: PublishedRun) -> tuple[list[tuple[str, Prediction, Plan]], float]:
    """The dry run's FSDP rows: the model on the meta device, profiled on fake tensors with the preset's figures,
    every block and the root ``full_shard``, on the preset's nodes; the seconds the trace took.

    A run with selective checkpointing (per operator) is predicted with it on every block, and with every block and
    every second block fully recomputed (see the module docstring)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    with torch.device("meta"):
        module = LlamaModule(**run.shape)
    figures = get_hardware(run.hardware).figures(run.world_size, "bf16-mixed", nodes=run.nodes)
    context = int(run.shape["context_length"])
    batch = torch.zeros((run.batch_size, context + 1), dtype=torch.int64, device="meta")
    start = time.perf_counter()
    profile = estimated_profile(
        module,
        batch,
        figures,
        optimizer=torch.optim.AdamW,
        step_context=MixedPrecision("bf16-mixed", "cpu").train_step_context,
        mixed_precision=BF16_POLICY,
        world_size=run.world_size,  # the figures' two levels, as `osdp plan` attaches them
    )
    traced = time.perf_counter() - start
    fsdp = Plan.uniform(module, "full_shard")
    blocks = [name for name in fsdp.decisions if name]
    every: list[tuple[str, int, str]] = {
        "none": [("no recomputation", 0, "none")],
        "full": [("every block recomputed", 1, "full")],
    }.get(
        run.activation_checkpointing,
        [
            ("selective on every block", 1, "selective"),
            ("before: every block fully recomputed", 1, "full"),
            ("before: every 2nd block fully recomputed", 2, "full"),
        ],
    )
    variants = []
    for label, step, how in every:
        recomputed = blocks[::step] if step else []
        plan = Plan({**fsdp.decisions, **{b: Decision("full_shard", recompute=how) for b in recomputed}})  # type: ignore[arg-type]
        variants.append((label, plan))
    return [(label, predict(profile, plan, figures.topology), plan) for label, plan in variants], traced


def osdp_objective_and_prediction(run: PublishedRun, nodes: int) -> tuple[Plan, float, float, float]:
    """``osdp plan``'s own OSDP solve for ``run`` on ``nodes`` nodes (the dry run's estimated profile, the GPU's
    memory less the CUDA reserve, the planner's headroom): the plan, the solver's objective for it, the timeline's
    prediction of it and plain FSDP's predicted step, in seconds (issue 21: the first two are one figure)."""
    from lightning_osdp.cli.output import Output
    from lightning_osdp.cli.parsers import add_plan_parser
    from lightning_osdp.cli.plan import _precision_plugin, _solve, resolve

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    gpus = str(run.world_size // nodes)
    args = ["plan", "--init-args", json.dumps(run.shape), "--model", "examples/llama/llama.py:LlamaModule"]
    args += ["--nodes", str(nodes), "--gpus-per-node", gpus, "--hardware", run.hardware, "--precision", "bf16-fsdp"]
    dry = resolve(parser.parse_args([*args, "--batch-size", str(run.batch_size)]), Output(quiet=True))
    profile = estimated_profile(
        dry.model,
        dry.batch.make(run.batch_size),
        dry.figures,
        step=dry.batch.step,
        optimizer=dry.optimizer,
        step_context=_precision_plugin(dry.precision).train_step_context,
        mixed_precision=BF16_POLICY,
        world_size=run.world_size,
    )
    plan = _solve(dry, profile)
    assert plan.report is not None
    fsdp = predict(profile, Plan.uniform(dry.model, "full_shard"), dry.topology)
    return plan, plan.report.ilp_step_seconds, plan.report.predicted_step_seconds, fsdp.step_seconds


def _mfu_text(value: float | tuple[float, float] | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return f"{value[0]:.0%}-{value[1]:.0%}"
    return f"{value:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    parser.add_argument("--only", help="only the runs whose name contains this text (e.g. 405B)")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for run in RUNS:
        if args.only and args.only not in run.name:
            continue
        predictions, traced = fsdp_predictions(run)
        hardware = get_hardware(run.hardware)
        peak = hardware.half_flops
        figures = hardware.figures(run.world_size, "bf16-mixed", nodes=run.nodes)
        capacity, topology = figures.memory_bytes, figures.topology
        budget = planned_budget(capacity - CUDA_RESERVE_BYTES, DEFAULT_MEMORY_HEADROOM) if capacity else None
        per_token = flops_per_token(run.shape, _parameters_without_embedding(run.shape))
        for label, prediction, plan in predictions:
            tokens = run.batch_size * int(run.shape["context_length"])
            rate = tokens / prediction.step_seconds
            rows.append(
                {
                    "run": run.name,
                    "hardware": run.hardware,
                    "world_size": run.world_size,
                    "batch": f"{run.batch_size} x {run.shape['context_length']}",
                    "activation_checkpointing": run.activation_checkpointing,
                    "modelled_as": label,
                    "plan": plan.summary(),
                    "published_tokens_per_second": run.tokens_per_second,
                    "predicted_tokens_per_second": round(rate, 1),
                    "throughput_ratio": round(rate / run.tokens_per_second, 3) if run.tokens_per_second else None,
                    "published_mfu": run.mfu,
                    "predicted_mfu": round(rate * per_token / peak, 4),
                    "published_memory_gib": run.memory_gib,
                    "predicted_memory_gib": round(prediction.peak_bytes / GIB, 2),
                    "memory_ratio": round(prediction.peak_bytes / GIB / run.memory_gib, 3) if run.memory_gib else None,
                    "fits": (
                        prediction.peak_bytes <= budget
                        and plan_device_memory(prediction, plan, topology).fits(capacity)
                        if budget is not None and capacity
                        else None
                    ),
                    "planned_budget_gib": round(budget / GIB, 2) if budget is not None else None,
                    "step_ms": round(prediction.step_seconds * 1e3, 1),
                    "step_parts_ms": {k: round(v * 1e3, 1) for k, v in prediction.step_parts.items()},
                    "communication_ms": round(prediction.communication_seconds * 1e3, 1),
                    "exposed_by_cause_ms": {k: round(v * 1e3, 1) for k, v in prediction.exposed_by_cause.items()},
                    "peak_at": prediction.peak_at,
                    "peak_parts": {k: format_bytes(v) for k, v in prediction.peak.as_dict().items()},
                    "trace_seconds": round(traced, 1),
                    "source": run.source,
                }
            )
    header = (
        f"{'run':32} {'AC':>12} {'modelled as':>52} {'tok/s pub':>10} {'tok/s dry':>10} {'ratio':>6} "
        f"{'MFU pub':>8} {'MFU dry':>8} {'GiB pub':>8} {'GiB dry':>8} {'ratio':>6} {'fits':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        pub_rate = f"{r['published_tokens_per_second']:,.0f}" if r["published_tokens_per_second"] else "-"
        ratio = f"{r['throughput_ratio']:.2f}" if r["throughput_ratio"] else "-"
        pub_mem = f"{r['published_memory_gib']:.1f}" if r["published_memory_gib"] else "-"
        mem_ratio = f"{r['memory_ratio']:.2f}" if r["memory_ratio"] else "-"
        print(
            f"{r['run']:32} {r['activation_checkpointing']:>12} {r['modelled_as']:>52} {pub_rate:>10} "
            f"{r['predicted_tokens_per_second']:>10,.0f} {ratio:>6} {_mfu_text(r['published_mfu']):>8} "
            f"{r['predicted_mfu']:>8.1%} {pub_mem:>8} {r['predicted_memory_gib']:>8.1f} {mem_ratio:>6} "
            f"{'-' if r['fits'] is None else 'yes' if r['fits'] else 'no':>5}"
        )
    for r in rows:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:,.1f}" for k, v in r["step_parts_ms"].items())
        causes = ", ".join(f"{k.replace('_', ' ')} {v:,.1f}" for k, v in r["exposed_by_cause_ms"].items())
        print(
            f"\n{r['run']} ({r['modelled_as']}): step {r['step_ms']:,.1f} ms ({parts}); communication "
            f"{r['communication_ms']:,.1f} ms, exposed by cause: {causes}; peak at {r['peak_at']!r}: {r['peak_parts']}"
        )
    for run in RUNS:
        if run.name == "Llama 3 8B, 64 x A100 80GB" and (not args.only or args.only in run.name):
            plan, objective, predicted, fsdp = osdp_objective_and_prediction(run, nodes=8)
            print(
                f"\n{run.name}, batch {run.batch_size}, OSDP plan {plan.summary()}: solver objective "
                f"{objective * 1e3:,.3f} ms, timeline prediction {predicted * 1e3:,.3f} ms "
                f"({(objective / predicted - 1) * 100:+.3f}%); plain FSDP {fsdp * 1e3:,.1f} ms "
                f"(OSDP {fsdp / predicted:.3f}x its throughput)"
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
