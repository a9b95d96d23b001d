"""Full fine-tuning of a litgpt model with Lightning Fabric and ``strategy="osdp"``, as litgpt's ``finetune/full.py``.

The loop below is litgpt 0.5's ``litgpt/finetune/full.py`` (``main``, ``fit``, ``validate``) with its tokenizer, data
module and text generation left out, so that it runs anywhere without downloading: the model is a small litgpt
``GPT`` (a ``pythia-14m``-shaped config shrunk, random weights, written by this script as the ``lit_model.pth`` that
litgpt's ``convert_hf_checkpoint`` would have made), and the data a synthetic next-token task in litgpt's batch format
(``{"input_ids", "labels"}``). What a litgpt user changes in ``finetune/full.py`` to train under OSDP is marked
``# OSDP:`` (two places; ``docs/fabric.md`` says why):

* the strategy: ``strategy = "osdp"`` instead of ``FSDPStrategy(auto_wrap_policy={Block}, ...)``;
* the weights: ``fabric.load_raw(checkpoint_path, model)`` (what litgpt's ``load_checkpoint`` already does under
  ``FSDPStrategy``) instead of ``model.load_state_dict``: the model is built on the meta device and OSDP reads the
  weights into its shards once the plan is made.

Run: ``python examples/litgpt/finetune.py --devices 2 --max-steps 20`` (CPU is enough).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from litgpt.config import Config
from litgpt.finetune.full import get_lr_scheduler
from litgpt.model import GPT
from litgpt.utils import CycleIterator, chunked_cross_entropy, instantiate_torch_optimizer, num_parameters
from torch.utils.data import DataLoader, Dataset

import lightning_osdp  # noqa: F401  # OSDP: registers strategy="osdp" with Fabric
from lightning_osdp.fabric import OSDPFabricStrategy


@dataclasses.dataclass
class TrainArgs:
    """litgpt's ``TrainArgs``, the fields ``full.py`` reads."""

    global_batch_size: int = 8
    micro_batch_size: int = 2
    lr_warmup_steps: int = 2
    max_steps: int = 20
    log_interval: int = 5
    learning_rate: float = 3e-3

    def gradient_accumulation_iters(self, devices: int, num_nodes: int = 1) -> int:
        return max(self.global_batch_size // (devices * num_nodes * self.micro_batch_size), 1)


def tiny_config(n_layer: int = 2, n_embd: int = 64) -> Config:
    """A ``pythia-14m``-shaped litgpt config, shrunk: a GPT-NeoX block (parallel residual, rotary embeddings)."""
    return Config.from_name(
        "pythia-14m", n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=64, vocab_size=96, padded_vocab_size=96
    )


#: Tokens per sample (litgpt sets ``model.max_seq_length`` to the longest sample of the data).
SEQUENCE = 33


class NextToken(Dataset[dict[str, torch.Tensor]]):
    """Sequences whose every token is a fixed function of the one before (``3 t + 1 mod vocab``) from a random start:
    a task a small model learns in a few dozen steps, in litgpt's batch format."""

    def __init__(self, vocab: int, length: int, size: int, seed: int) -> None:
        starts = torch.randint(0, vocab, (size,), generator=torch.Generator().manual_seed(seed))
        rows = [starts]
        for _ in range(length - 1):
            rows.append((rows[-1] * 3 + 1) % vocab)
        self.tokens = torch.stack(rows, dim=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def write_checkpoint(config: Config, checkpoint_dir: Path) -> Path:
    """The ``lit_model.pth`` a pretrained litgpt checkpoint directory holds (here random weights)."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_dir / "lit_model.pth"
    torch.manual_seed(1234)
    torch.save(GPT(config).state_dict(), path)
    return path


def setup(
    out_dir: Path,
    devices: int = 2,
    precision: str = "32-true",
    train: TrainArgs | None = None,
    seed: int = 1337,
    memory_budget: str | None = None,
) -> dict[str, Any]:
    """litgpt's ``setup``: the strategy, then ``fabric.launch(main, ...)``. Returns each rank's result.

    ``memory_budget`` (``"2MiB"``) plans under that budget per device instead of the device's memory, which this
    small model never comes near: the way to see the planner shard it."""
    train = train or TrainArgs()
    config = tiny_config()
    # OSDP: instead of `FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, ...)`.
    strategy: Any = "osdp" if devices > 1 else "auto"
    if memory_budget is not None:
        strategy = OSDPFabricStrategy(memory_budget=memory_budget)
    fabric = L.Fabric(devices=devices, strategy=strategy, precision=precision, accelerator="cpu")
    return fabric.launch(main, devices, seed, config, out_dir, train)


def main(fabric: L.Fabric, devices: int, seed: int, config: Config, out_dir: Path, train: TrainArgs) -> Any:
    """litgpt's ``main``: the model on meta, ``fabric.setup``, the optimizer from its parameters, the weights, fit."""
    with fabric.rank_zero_first():
        checkpoint_path = out_dir / "checkpoint" / "lit_model.pth"
        if fabric.global_rank == 0 and not checkpoint_path.exists():
            write_checkpoint(config, checkpoint_path.parent)
    train_data = NextToken(config.vocab_size, SEQUENCE, 256, seed=0)
    val_data = NextToken(config.vocab_size, SEQUENCE, 32, seed=1)
    train_dataloader = DataLoader(train_data, batch_size=train.micro_batch_size, shuffle=True)
    val_dataloader = DataLoader(val_data, batch_size=train.micro_batch_size)
    train_dataloader, val_dataloader = fabric.setup_dataloaders(train_dataloader, val_dataloader)

    fabric.seed_everything(seed)  # same seed for every process to init model (FSDP)
    with fabric.init_module(empty_init=(fabric.world_size > 1)):
        model = GPT(config)
    fabric.print(f"Number of trainable parameters: {num_parameters(model, requires_grad=True):,}")
    model = fabric.setup(model)
    optimizer = instantiate_torch_optimizer("AdamW", model.parameters(), lr=train.learning_rate)
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = get_lr_scheduler(optimizer, warmup_steps=train.lr_warmup_steps, max_steps=train.max_steps)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0, "step_count": 0}

    # OSDP: litgpt's `load_checkpoint(fabric, model, checkpoint_path)` calls `model.load_state_dict` unless the strategy
    # is FSDPStrategy; `fabric.load_raw` is what it calls under FSDPStrategy, and reads into OSDP's shards.
    fabric.load_raw(checkpoint_path, state["model"])

    train_time = time.perf_counter()
    losses = fit(fabric, state, train_dataloader, val_dataloader, devices, train)
    fabric.print(f"Training time: {(time.perf_counter() - train_time):.2f}s")
    val_loss = validate(fabric, model, val_dataloader, max_iters=len(val_dataloader))
    fabric.print(f"Final evaluation | val loss: {val_loss.item():.3f} | val ppl: {math.exp(val_loss):.3f}")
    save_path = out_dir / "final" / "lit_model.pth"
    save_path.parent.mkdir(parents=True, exist_ok=True)
    fabric.save(save_path, {"model": state["model"]})
    summary = getattr(fabric.strategy, "summary", None)
    if summary is not None:
        fabric.print(summary())
    return {"losses": losses, "val_loss": val_loss.item(), "plan": getattr(fabric.strategy, "plan", None)}


def fit(
    fabric: L.Fabric,
    state: dict[str, Any],
    train_dataloader: DataLoader,
    val_dataloader: DataLoader,
    devices: int,
    train: TrainArgs,
) -> list[float]:
    """litgpt's ``fit``: a sanity-check validation, then the accumulating loop with ``no_backward_sync``."""
    model = state["model"]
    optimizer = state["optimizer"]
    scheduler = state["scheduler"]
    model.max_seq_length = SEQUENCE
    fabric.print("Verifying settings ...")
    validate(fabric, model, val_dataloader, max_iters=2)  # sanity check
    train_iterator = CycleIterator(train_dataloader)
    accumulate = train.gradient_accumulation_iters(devices)
    losses: list[float] = []
    while state["step_count"] < train.max_steps:
        state["iter_num"] += 1
        batch = next(train_iterator)
        input_ids, targets = batch["input_ids"], batch["labels"]
        is_accumulating = state["iter_num"] % accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            # shift the targets such that output n predicts token n+1
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
            fabric.backward(loss / accumulate)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state["step_count"] += 1
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
            if state["step_count"] % train.log_interval == 0:
                fabric.print(f"Step {state['step_count']} | loss train: {losses[-1]:.3f}")
    return losses


@torch.no_grad()
def validate(fabric: L.Fabric, model: Any, val_dataloader: DataLoader, max_iters: int) -> torch.Tensor:
    """litgpt's ``validate``."""
    model.eval()
    losses = torch.zeros(min(len(val_dataloader), max_iters))
    for k, batch in enumerate(val_dataloader):
        if k >= max_iters:
            break
        input_ids, targets = batch["input_ids"], batch["labels"]
        logits = model(input_ids)
        losses[k] = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:], chunk_size=0)
    val_loss = losses.mean()
    model.train()
    return val_loss


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("runs/litgpt"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=TrainArgs.max_steps)
    parser.add_argument("--memory-budget", default=None, help="plan under this budget per device (e.g. 2MiB)")
    return parser.parse_args()


if __name__ == "__main__":
    args = _arguments()
    setup(
        args.out_dir,
        devices=args.devices,
        precision=args.precision,
        train=TrainArgs(max_steps=args.max_steps),
        memory_budget=args.memory_budget,
    )
