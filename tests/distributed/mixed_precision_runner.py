"""Runs the 2-process cases of ``tests/test_mixed_precision.py`` inside one set of processes.

Started with ``torchrun --nproc-per-node 2``. Usage: ``mixed_precision_runner.py OUT_DIR CASE [CASE ...]``; each case
writes ``OUT_DIR/CASE.rank{R}.pt`` (losses, final full state on rank 0, and the dtypes the weights had in forward).

Cases (the Llama example at a small size, bf16 autocast throughout):

* ``fsdp2``: the reference, Lightning's ``ModelParallelStrategy`` (FSDP2) whose ``configure_model`` shards each block
  and the model with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, the way torchtitan wraps Llama;
* ``full``: ``OSDPStrategy(mixed_precision="bf16")`` with a plan sharding the same units (``full_shard``);
* ``ddp``: Lightning's DDP with ``bf16-mixed``;
* ``replicated``: ``OSDPStrategy(mixed_precision="bf16")`` with a plan replicating everything (no FSDP2 unit: the
  policy has nothing to cast);
* ``mixed``: the policy with one block sharded and the rest replicated;
* ``memory``: a wider Llama under ``bf16-mixed`` with and without the policy, two plans each: the strategy's measured
  peak (max over ranks) beside the cost model's prediction from a profile of the same step (``memory.rank0.pt``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "llama"))

from clean_exit import finish

from lightning_osdp import OSDPStrategy, Plan

from llama import LlamaModule

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SHAPE = {"vocab_size": 64, "context_length": 16, "dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2}
LAYERS = [f"model.layers.{i}" for i in range(3)]
PLANS: dict[str, dict[str, Any]] = {
    "full": {"": "full_shard", **{name: "full_shard" for name in LAYERS}},
    "replicated": {"": "no_shard", **{name: "no_shard" for name in LAYERS}},
    "mixed": {"": "no_shard", LAYERS[0]: "no_shard", LAYERS[1]: "full_shard", LAYERS[2]: "shard_grad_op"},
}


class Windows(Dataset[Tensor]):
    """Deterministic token windows with a learnable pattern (an arithmetic sequence modulo the vocabulary)."""

    def __init__(self, n: int = 64, length: int = 17, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(7)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 5, (n, 1), generator=g)
        self.data = (start + step * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Tensor:
        return self.data[i]


class Recorded(LlamaModule):
    """The Llama example recording each step's loss, and the dtype each Linear's weight had in its forward."""

    def __init__(self, shard_in_configure_model: bool = False) -> None:
        super().__init__(**SHAPE, lr=3e-3, warmup_steps=1)
        self.losses: list[float] = []
        self.weight_dtypes: dict[str, str] = {}
        self.shard_in_configure_model = shard_in_configure_model
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(self._record_dtype(name))

    def _record_dtype(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.weight_dtypes.setdefault(name, str(module.weight.dtype).removeprefix("torch."))

        return hook

    def configure_model(self) -> None:
        if not self.shard_in_configure_model:
            return
        # torchtitan's wrapping (parallelize_llama): each block, then the model (embedding, norm, output) as the root.
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=POLICY)
        fully_shard(self.model, mesh=mesh, mp_policy=POLICY)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss


def memory(out: Path) -> None:
    """Predicted against measured peaks under ``bf16-mixed``, with FSDP2's policy and without it."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_osdp.cost_model import predict
    from lightning_osdp.profiling import profile, profile_with_policy

    shape = {"vocab_size": 64, "context_length": 32, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2}
    data = torch.randint(0, 64, (32, 33), generator=torch.Generator().manual_seed(0))
    layers = [f"model.layers.{i}" for i in range(4)]
    plans = {
        "full_shard": Plan({"": "full_shard", **dict.fromkeys(layers, "full_shard")}),
        "mixed": Plan(
            {"": "no_shard", **dict.fromkeys(layers[:2], "no_shard"), **dict.fromkeys(layers[2:], "full_shard")}
        ),
    }

    def model() -> LlamaModule:
        L.seed_everything(0, verbose=False)
        return LlamaModule(**shape, warmup_steps=1)

    def autocast() -> Any:
        return MixedPrecision("bf16-mixed", "cpu").train_step_context()

    rows = {}
    for policy in (None, "bf16"):
        kwargs: dict[str, Any] = {"optimizer": torch.optim.AdamW, "step_context": autocast}
        prof = (
            profile(model(), data[:4], **kwargs)
            if policy is None
            else profile_with_policy(model(), data[:4], POLICY, **kwargs)
        )
        for name, plan in plans.items():
            strategy = OSDPStrategy(plan=plan, memory_steps=3, mixed_precision=policy)
            trainer = L.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=strategy,
                precision="bf16-mixed",
                max_steps=3,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(model(), DataLoader(data, batch_size=4))
            peak = torch.tensor([strategy.peak_memory_bytes], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            rows[f"{policy or 'autocast'} {name}"] = {
                "predicted": predict(prof, plan, 2).peak_bytes,
                "measured": int(peak),
            }
    torch.save(rows, out / f"memory.rank{dist.get_rank()}.pt")


def run(case: str, out: Path) -> None:
    if case == "memory":
        memory(out)
        return
    L.seed_everything(0, workers=True)
    model = Recorded(shard_in_configure_model=case == "fsdp2")
    strategy: Any
    if case == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif case == "ddp":
        strategy = "ddp"
    else:
        strategy = OSDPStrategy(plan=Plan(PLANS[case]), mixed_precision="bf16")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, DataLoader(Windows(), batch_size=4, shuffle=True))
    if case == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = {k: v.float() for k, v in full.items()}
    elif case == "ddp":
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    else:
        state = {k: v.float() for k, v in trainer.strategy.full_model_state_dict().items()}
    result = {
        "losses": model.losses,
        "state": state if dist.get_rank() == 0 else None,
        "weight_dtypes": model.weight_dtypes,
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
    }
    torch.save(result, out / f"{case}.rank{dist.get_rank()}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[2:]:
        run(case, out)


if __name__ == "__main__":
    main()
    finish()
