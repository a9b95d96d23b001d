"""Throughput and peak memory of OSDP plans against Lightning's DDP and FSDP2 (ModelParallelStrategy) baselines.

Run under ``python -m torch.distributed.run --nproc-per-node 2 benchmarks/throughput.py [options] CASE...``.
A case is ``ddp``, ``fsdp_full`` / ``fsdp_grad_op`` (each also with ``+ac``: every block checkpointed in
``configure_model``), (FSDP2 applied per block by ModelParallelStrategy, i.e.
FULL_SHARD / SHARD_GRAD_OP), ``osdp:MODE`` (a uniform plan over the blocks), ``osdp:PLAN.json`` or
``osdp@BUDGET`` (the planner, with a per-device budget such as ``300MiB``). Every case is measured the same
way: a callback times each training batch and runs the CPU live-storage tracker over it (the same tracker the
strategy uses), so figures are comparable. Prints one row per case on rank 0 and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

import lightning_osdp
from lightning_osdp import OSDPStrategy, Plan
from lightning_osdp.memory import LiveStorageTracker

from gpt import GPTModule


class RandomTokens(Dataset[torch.Tensor]):
    def __init__(self, n: int, length: int) -> None:
        self.data = torch.randint(0, 256, (n, length + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class Meter(Callback):
    """Step time (wall) and peak live-tensor bytes of each training batch on this rank."""

    def __init__(self, memory_steps: int) -> None:
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.memory_steps = memory_steps
        self._t0 = 0.0
        self._tracker: LiveStorageTracker | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if len(self.peaks) < self.memory_steps:
            self._tracker = LiveStorageTracker().start(trainer.strategy.model, *trainer.optimizers)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)
        if self._tracker is not None:
            self.peaks.append(self._tracker.stop())
            self._tracker = None


class FSDPBaseline(GPTModule):
    """FSDP2 as a Lightning user writes it: ``fully_shard`` each block, then the model, in ``configure_model``."""

    reshard_after_forward = True

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)


class FSDPGradOpBaseline(FSDPBaseline):
    reshard_after_forward = False


def _checkpoint_blocks(module: GPTModule) -> None:
    """Activation checkpointing of every block, as a Lightning user writes it in ``configure_model`` (torch's
    ``checkpoint_wrapper``, non-reentrant; before ``fully_shard``, the order torchtitan uses)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    blocks = set(module.model.blocks)
    apply_activation_checkpointing(module.model, check_fn=lambda m: m in blocks)


class DDPCheckpointed(GPTModule):
    """Lightning's DDP with every block checkpointed."""

    def configure_model(self) -> None:
        _checkpoint_blocks(self)


class FSDPCheckpointed(FSDPBaseline):
    """FULL_SHARD per block, every block checkpointed."""

    def configure_model(self) -> None:
        _checkpoint_blocks(self)
        super().configure_model()


class FSDPGradOpCheckpointed(FSDPCheckpointed):
    """SHARD_GRAD_OP per block, every block checkpointed."""

    reshard_after_forward = False


WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def fit_briefly(
    model: L.LightningModule, strategy: Any, args: argparse.Namespace, callbacks: list[Callback] | None = None
) -> L.Trainer:
    """Train ``args.steps`` steps on random tokens on every rank, with nothing but the training loop (no logger,
    checkpoints, progress bar or validation): what the benchmarks time."""
    data = DataLoader(RandomTokens(args.batch * 2 * (args.steps + 2), args.context), batch_size=args.batch)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    return trainer


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    L.seed_everything(0)
    kwargs = dict(
        width=args.width, depth=args.depth, heads=args.heads, context_length=args.context, lr_schedule="constant"
    )
    cls: type[GPTModule] = GPTModule
    strategy: Any
    if case == "ddp":
        strategy = "ddp"
    elif case == "fsdp_full":
        cls, strategy = FSDPBaseline, ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    elif case == "fsdp_grad_op":
        cls = FSDPGradOpBaseline
        strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    elif case == "ddp+ac":
        cls, strategy = DDPCheckpointed, "ddp"
    elif case == "fsdp_full+ac":
        cls, strategy = FSDPCheckpointed, ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    elif case == "fsdp_grad_op+ac":
        cls = FSDPGradOpCheckpointed
        strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    elif case.startswith("osdp@"):
        budget = case.split("@", 1)[1]
        strategy = OSDPStrategy(memory_budget=int(budget) if budget.isdigit() else budget, plan_out=args.plan_out)
    elif case.startswith("osdp:"):
        spec = case.split(":", 1)[1]
        model_for_names = cls(**kwargs)
        plan = Plan.load(spec) if spec.endswith(".json") else Plan.uniform(model_for_names, spec)
        strategy = OSDPStrategy(plan=plan)
    else:
        raise SystemExit(f"unknown case {case!r}")
    meter = Meter(memory_steps=args.memory_steps)
    trainer = fit_briefly(cls(**kwargs), strategy, args, [meter])
    times = meter.times[args.warmup :]
    peak = torch.tensor([max(meter.peaks)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    n_params = sum(p.numel() for p in GPTModule(**kwargs).parameters())
    return {
        "case": case,
        "params": n_params,
        "step_s": float(step),
        "samples_per_s": args.batch * WORLD / float(step),
        "peak_bytes": int(peak),
        "plan": trainer.strategy.plan.summary()
        if isinstance(trainer.strategy, OSDPStrategy) and trainer.strategy.plan is not None
        else "",
    }


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and run shape shared by the benchmarks."""
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--plan-out", default="/tmp/osdp_benchmark_plan.json", help="where OSDP saves its plans")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cases", nargs="+")
    add_model_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    assert lightning_osdp.OSDPStrategy.strategy_name == "osdp"
    rows = [run_case(case, args) for case in args.cases]
    if dist.get_rank() == 0:
        best = max(r["samples_per_s"] for r in rows)
        print(f"\n{'case':<22}{'step ms':>10}{'samples/s':>11}{'vs best':>9}{'peak MiB':>10}  plan")
        for r in rows:
            print(
                f"{r['case']:<22}{r['step_s'] * 1e3:>10.1f}{r['samples_per_s']:>11.1f}"
                f"{r['samples_per_s'] / best:>9.2f}{r['peak_bytes'] / 2**20:>10.1f}  {r['plan']}"
            )
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
