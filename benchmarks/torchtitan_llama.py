"""The dry run's FSDP row beside torchtitan's published figures for the same Llama training runs.

``osdp plan`` predicts a model's step on hardware that is not here. This script puts its prediction for three runs
torchtitan published (``docs/performance.md`` of pytorch/torchtitan) beside the published figures, with the model of
``examples/llama`` at each run's shape, FSDP over every block and the rest as one unit (torchtitan's wrapping), and
FSDP2's ``MixedPrecisionPolicy(bf16, fp32)`` (``--precision bf16-fsdp``, torchtitan's default):

* Llama 3.1 8B on 8 H100s (96 GB HBM2e at 2.4 TB/s, 500 W: the ``h100-sxm5-96g`` preset), local batch 2 at sequence
  8,192, selective activation checkpointing: 5,762 tokens/s per GPU at 82.4 GiB (Table 1, "FSDP");
* Llama 3 8B on 64 A100-80GB, local batch 1 at 8,192, selective (op) activation checkpointing: 2,973 tokens/s per GPU;
* Llama 2 13B on 64 A100-80GB, local batch 2 at 4,096, no activation checkpointing: 2,162 tokens/s per GPU.

Run from the repository root: ``python benchmarks/torchtitan_llama.py`` (about a minute on one CPU core: each model
is traced on fake tensors at two batch sizes). ``--out FILE`` writes the table as JSON.

Activation checkpointing: see ``docs/benchmarks.md`` for how the runs that use it are modelled.
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

from lightning_osdp.budget import format_bytes
from lightning_osdp.cli.estimate import estimated_profile
from lightning_osdp.cli.hardware import get_hardware
from lightning_osdp.cost_model import Prediction, predict
from lightning_osdp.options import BF16_POLICY
from lightning_osdp.plan import Decision, Plan

from llama import LLAMA3_1_8B, LlamaModule

GIB = 2**30


@dataclass(frozen=True)
class PublishedRun:
    """One row of torchtitan's ``docs/performance.md``."""

    name: str
    shape: dict[str, Any]
    hardware: str
    world_size: int
    batch_size: int
    activation_checkpointing: str
    tokens_per_second: float
    memory_gib: float | None
    source: str


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
        "Table 1 (FSDP), 1D parallelism, local batch 2, selective AC, no torch.compile, no Float8",
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
        "Llama 3 performance numbers: batch 1, selective op AC, 2,973 WPS (58.2% MFU)",
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
        "Llama 2 performance numbers: batch 2, no AC, 2,162 WPS (61.1% MFU)",
    ),
)


def fsdp_predictions(run: PublishedRun) -> tuple[list[tuple[str, Prediction, Plan]], float]:
    """The dry run's FSDP rows: the model on the meta device, profiled on fake tensors with the preset's figures,
    every block and the root ``full_shard``; the seconds the trace took.

    torchtitan's selective checkpointing (per operator, or every second block) is not a block-level choice: a run
    that uses it is predicted with every block and with every second block recomputed, the two ends it lies between
    in memory (every block keeps only its input; every second block keeps half the activations)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    with torch.device("meta"):
        module = LlamaModule(**run.shape)
    figures = get_hardware(run.hardware).figures(run.world_size, "bf16-mixed")
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
    )
    traced = time.perf_counter() - start
    fsdp = Plan.uniform(module, "full_shard")
    blocks = [name for name in fsdp.decisions if name]
    variants = [("no recomputation", fsdp)]
    if run.activation_checkpointing != "none":
        variants = [
            (
                f"every {label} recomputed",
                Plan({**fsdp.decisions, **{b: Decision("full_shard", recompute=True) for b in blocks[::every]}}),
            )
            for label, every in (("block", 1), ("2nd block", 2))
        ]
    return [(label, predict(profile, plan, run.world_size), plan) for label, plan in variants], traced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    variants: list[tuple[PublishedRun, str, Prediction, Plan, float]] = []
    for run in RUNS:
        predictions, traced = fsdp_predictions(run)
        variants.extend((run, label, prediction, plan, traced) for label, prediction, plan in predictions)
    for run, label, prediction, plan, traced in variants:
        tokens = run.batch_size * int(run.shape["context_length"])
        rate = tokens / prediction.step_seconds
        step_parts = {k: round(v * 1e3, 1) for k, v in prediction.step_parts.items()}
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
                "throughput_ratio": round(rate / run.tokens_per_second, 3),
                "published_memory_gib": run.memory_gib,
                "predicted_memory_gib": round(prediction.peak_bytes / GIB, 2),
                "memory_ratio": round(prediction.peak_bytes / GIB / run.memory_gib, 3) if run.memory_gib else None,
                "step_ms": round(prediction.step_seconds * 1e3, 1),
                "step_parts_ms": step_parts,
                "peak_at": prediction.peak_at,
                "peak_parts": {k: format_bytes(v) for k, v in prediction.peak.as_dict().items()},
                "trace_seconds": round(traced, 1),
                "source": run.source,
            }
        )
    header = (
        f"{'run':30} {'AC':>12} {'modelled as':>27} {'tok/s pub':>10} {'tok/s dry':>10} {'ratio':>6} {'GiB pub':>8} "
        f"{'GiB dry':>8} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        pub_mem = f"{r['published_memory_gib']:.1f}" if r["published_memory_gib"] else "-"
        mem_ratio = f"{r['memory_ratio']:.2f}" if r["memory_ratio"] else "-"
        print(
            f"{r['run']:30} {r['activation_checkpointing']:>12} {r['modelled_as']:>27} "
            f"{r['published_tokens_per_second']:>10,.0f} "
            f"{r['predicted_tokens_per_second']:>10,.0f} {r['throughput_ratio']:>6.2f} {pub_mem:>8} "
            f"{r['predicted_memory_gib']:>8.1f} {mem_ratio:>6}"
        )
    for r in rows:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:,.1f}" for k, v in r["step_parts_ms"].items())
        print(
            f"\n{r['run']} ({r['modelled_as']}): step {r['step_ms']:,.1f} ms ({parts}); peak at {r['peak_at']!r}: "
            f"{r['peak_parts']}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
