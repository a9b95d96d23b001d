"""The OSDP paper's two published settings, predicted by the cost model on built-in figures of 8-GPU PCIe servers.

The authors' code reports (README of Youhe-Jiang/IJCAI2023-OptimalShardedDataParallel; 8 TITAN RTX 24 GB on PCIe
3.0, by the paper), for OSDP and FairScale's FSDP:

* GPT-2, 48 layers of width 1536 and 48 heads, minGPT's addition task (vocabulary 10, sequences of 6 tokens), 96
  sequences per GPU and step (``--train_batch_size 1`` times ``--seq_length 96``), fp32, Adam, 8 GB per GPU:
  192.26 against 158.05 "seq/sec" (the script's figure: ``96 * 6`` tokens over the step time, on rank 0), 1.22x;
* an OPT-30B-shaped slice, 8 layers of width 7168 (56 heads, FFN 28672), fp32, Adam, 16 GB per GPU, OSDP at 2
  sequences per GPU and FSDP at 1 (their scripts): 1261.98 against 453.18 seq/s, 2.78x. The data is their BERT wiki
  sample, whose sequence length the repository does not say: 512 here.

This script builds the same shapes with ``examples/gpt``'s GPT (its embedding and head are tied, as OPT's are;
minGPT's are not, which at a vocabulary of 10 changes nothing), profiles them on fake tensors with each machine's
figures (as ``osdp plan`` does), solves OSDP's plan under the limit with no headroom (the authors' limit is the
planner's target) and predicts OSDP and FSDP (every block ``full_shard``): the ratio of their throughputs at the
published batch sizes, and at the largest batch each fits.

Machines: ``rtx4090-pcie`` and ``l4-pcie`` (built-in), and the paper's server as the same kind of entry: TITAN RTX
data-sheet figures (FP32 16.3 TFLOPS, tensor 130 TFLOPS, GDDR6 672 GB/s, 24 GB) on PCIe 3.0 without peer-to-peer:
the built-in PCIe 4.0 link at half its bus bandwidth (PCIe 3.0 runs 8 GT/s a lane to 4.0's 16).

NOTE: the cost model's copy rate is a constant calibrated on the development CPU unless given; here it is the
machine's (half its DRAM bandwidth, what ``osdp plan``'s figures carry), passed through ``CostModelConfig``.

Run: ``python benchmarks/paper_settings.py`` (about a minute on 2 cores). docs/benchmarks.md keeps the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from lightning_osdp.cli.batch import batch_source
from lightning_osdp.cli.batch_search import Probe, largest_batch
from lightning_osdp.cli.estimate import BatchScaledProfile, estimated_profile
from lightning_osdp.cli.hardware import GB, HARDWARE, PCIE4_NO_P2P, TFLOPS, Hardware, Link, get_hardware
from lightning_osdp.cli.model import build_on_meta, import_object
from lightning_osdp.cost_model import CostModelConfig, predict
from lightning_osdp.plan import Plan
from lightning_osdp.solver import InfeasibleBudgetError, plan_model, smallest_memory_budget

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt" / "gpt.py") + ":GPTModule"

#: The paper's server as a built-in-style entry (see the module docstring).
TITAN_RTX_PCIE3 = Hardware(
    name="titan-rtx-pcie3",
    gpu="NVIDIA TITAN RTX",
    memory_bytes=24 * 2**30,
    half_flops=130 * TFLOPS,
    fp32_flops=16.3 * TFLOPS,
    memory_bytes_per_second=672 * GB,
    gpus_per_node=8,
    intra=Link("PCIe 3.0 x16 without peer-to-peer", PCIE4_NO_P2P.bus_bytes_per_second / 2, PCIE4_NO_P2P.hop_seconds),
    inter=None,
    source="NVIDIA TITAN RTX data sheet (FP32 16.3 TFLOPS, 130 tensor TFLOPS, 24 GB GDDR6 at 672 GB/s)",
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One published setting: the model, the per-GPU batch sizes of each side, the limit, the published figures."""

    name: str
    init_args: dict[str, Any]
    osdp_batch: int
    fsdp_batch: int
    limit_gib: int
    published_osdp: float
    published_fsdp: float


SETTINGS = (
    Setting(
        "GPT-2 1.5B, 48 layers, 8 GB",
        {"vocab_size": 10, "context_length": 6, "width": 1536, "depth": 48, "heads": 48, "lr_schedule": "constant"},
        96,
        96,
        8,
        192.26,
        158.05,
    ),
    Setting(
        "OPT-30B-shaped, 8 layers, 16 GB",
        {"vocab_size": 50272, "context_length": 512, "width": 7168, "depth": 8, "heads": 56, "lr_schedule": "constant"},
        2,
        1,
        16,
        1261.98,
        453.18,
    ),
)


def predicted(setting: Setting, hw: Hardware, world_size: int = 8) -> dict[str, Any]:
    """OSDP's and FSDP's predicted throughput (sequences per second over the world) for ``setting`` on ``hw``."""
    figures = hw.figures(world_size, "32-true")
    config = CostModelConfig(copy_bytes_per_second=figures.copy_bytes_per_second)
    model = build_on_meta(import_object(GPT), setting.init_args)
    source = batch_source(None, model)
    import torch

    def at(batch: int) -> Any:
        return estimated_profile(model, source.make(batch), figures, optimizer=torch.optim.Adam)

    low = min(setting.osdp_batch, setting.fsdp_batch)
    scaled = BatchScaledProfile(at(low), low, at(2 * low), 2 * low)
    budget = setting.limit_gib * 2**30
    fsdp = Plan.uniform(model, "full_shard")

    def osdp_seconds(batch: int) -> float | None:
        try:
            plan = plan_model(scaled.at(batch), budget, world_size, headroom=0.0, config=config)
        except InfeasibleBudgetError:
            return None
        return predict(scaled.at(batch), plan, world_size, config=config).step_seconds

    def fsdp_fits(batch: int) -> Probe:
        peak = predict(scaled.at(batch), fsdp, world_size, config=config).peak_bytes
        return Probe(peak <= budget, peak)

    def osdp_fits(batch: int) -> Probe:
        minimum = smallest_memory_budget(scaled.at(batch), world_size, headroom=0.0, config=config)
        return Probe(minimum <= budget, minimum)

    fsdp_peak = predict(scaled.at(setting.fsdp_batch), fsdp, world_size, config=config).peak_bytes
    out: dict[str, Any] = {
        "osdp": osdp_seconds(setting.osdp_batch),
        "fsdp": predict(scaled.at(setting.fsdp_batch), fsdp, world_size, config=config).step_seconds,
        "fsdp_fits": fsdp_peak <= budget,
        "fsdp_peak": fsdp_peak,
    }
    out["osdp_max"] = largest_batch(osdp_fits, budget, limit=4096)
    out["fsdp_max"] = largest_batch(fsdp_fits, budget, limit=4096)
    out["osdp_at_max"] = osdp_seconds(out["osdp_max"]) if out["osdp_max"] else None
    out["fsdp_at_max"] = (
        predict(scaled.at(out["fsdp_max"]), fsdp, world_size, config=config).step_seconds if out["fsdp_max"] else None
    )
    return out


def _rate(batch: int, seconds: float | None, world_size: int = 8) -> float | None:
    return batch * world_size / seconds if seconds else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", nargs="*", default=["titan-rtx-pcie3", "rtx4090-pcie", "l4-pcie"])
    args = parser.parse_args()
    machines = {TITAN_RTX_PCIE3.name: TITAN_RTX_PCIE3, **HARDWARE}
    started = time.perf_counter()
    print(
        "| setting | machine | OSDP/FSDP published | predicted at the published batches (OSDP vs FSDP) | "
        "largest batch under the limit (OSDP vs FSDP) |"
    )
    print("|---|---|---|---|---|")
    for setting in SETTINGS:
        published = setting.published_osdp / setting.published_fsdp
        for name in args.hardware:
            hw = machines[name] if name in machines else get_hardware(name)
            r = predicted(setting, hw)
            osdp = _rate(setting.osdp_batch, r["osdp"])
            fsdp = _rate(setting.fsdp_batch, r["fsdp"])
            same = f"**{osdp / fsdp:.2f}x** ({osdp:,.1f} vs {fsdp:,.1f} seq/s)" if osdp and fsdp else "-"
            if not r["fsdp_fits"]:
                same += f", FSDP's peak {r['fsdp_peak'] / 2**30:.1f} GiB"
            most_osdp = _rate(r["osdp_max"], r["osdp_at_max"])
            most_fsdp = _rate(r["fsdp_max"], r["fsdp_at_max"])
            if most_osdp and most_fsdp:
                largest = f"{most_osdp / most_fsdp:.2f}x (batch {r['osdp_max']} vs {r['fsdp_max']})"
            else:
                largest = f"batch {r['osdp_max']} vs {r['fsdp_max'] or 'none'}"
            print(f"| {setting.name} | {name} | {published:.2f}x | {same} | {largest} |", flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
