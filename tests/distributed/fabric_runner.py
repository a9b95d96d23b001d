"""Fabric training loops under ``strategy="osdp"`` and ``"ddp"`` in one 2-process launch, saving what each measured.

Started by the tests as a plain script (``python fabric_runner.py OUT_DIR CASE [CASE ...]``): the first ``Fabric``
launches the second rank with Fabric's own subprocess launcher, and every later case runs in the same two processes
(the process group is reused). Each case writes ``OUT_DIR/CASE.rank{R}.pt``: the losses of every micro-batch, the full
state dict on rank 0 (the model's own keys), and facts of the run (the plan's modes, the measured peak).

The loop is written as litgpt's ``finetune/full.py`` writes it: ``fabric.setup(model)``, the optimizer built from
``model.parameters()`` after it, ``fabric.setup_optimizers``, a forward, a loss outside the model, ``fabric.backward``
under ``fabric.no_backward_sync`` while accumulating, ``fabric.clip_gradients``, then the optimizer step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

import lightning_osdp  # noqa: F401  # registers strategy="osdp" with Fabric
from lightning_osdp import Plan
from lightning_osdp.checkpoint import full_model_state
from lightning_osdp.fabric import OSDPFabricModule, OSDPFabricStrategy

from models import Block

VOCAB, WIDTH, HIDDEN, LAYERS, CONTEXT = 37, 21, 85, 3, 16
STEPS, ACCUMULATE, MICRO_BATCH = 4, 2, 4
# A plan that forces sharding: every mode, a tied group, split operators.
TIGHT = {
    "": "no_shard",
    "wte": "full_shard",
    "lm_head": "full_shard",
    "h.0": "full_shard",
    "h.0.fc": ("full_shard", 4),
    "h.1": "shard_grad_op",
    "h.2": "no_shard",
    "h.2.proj": ("full_shard", 2),
}
# Under bf16-mixed without the splits: a Linear split into slices differs from the whole Linear by about 4e-4 under
# bf16 autocast on CPU (tests/distributed/runner.py says the same of the Trainer's parity runs).
TIGHT_NO_SPLIT = {name: mode if isinstance(mode, str) else mode[0] for name, mode in TIGHT.items()}


class GPT(nn.Module):
    """A plain decoder-only LM as litgpt's ``GPT`` is one: ``forward(idx) -> logits``, the loss outside."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.h = nn.ModuleList([Block(WIDTH, HIDDEN) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.pos[: idx.shape[1]]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def batch(rank: int, step: int, micro: int) -> Tensor:
    """Rank ``rank``'s tokens of micro-batch ``micro`` of step ``step`` (each rank its own, as a sampler gives)."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, CONTEXT + 1), generator=generator)


#: Every Fabric made, the latest last (the tight budget is sized from the ample run's strategy).
FABRICS: list[L.Fabric] = []


def fabric_for(strategy: Any, precision: str = "32-true", devices: int = 2) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)
    fabric.launch()
    FABRICS.append(fabric)
    return fabric


def train(
    fabric: L.Fabric,
    *,
    steps: range = range(STEPS),
    meta: bool = False,
    state: dict[str, Any] | None = None,
    resume: Path | None = None,
    save: tuple[int, Path] | None = None,
    joint: bool = False,
) -> dict[str, Any]:
    """The loop (see the module docstring); ``resume`` loads a checkpoint before it, ``save=(step, path)`` saves after
    that step's optimizer step; ``joint``: ``fabric.setup(model, optimizer)`` with the optimizer built before."""
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=meta):
        model = GPT()
    if joint:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    else:
        model = fabric.setup(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        optimizer = fabric.setup_optimizers(optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume is not None:
        remainder = fabric.load(resume, state)
        assert not remainder, remainder
    loaded_step = state["step"]
    losses: list[float] = []
    norms: list[float] = []
    saved_state = None
    paused: list[tuple[float | None, bool]] = []
    for step in steps:
        for micro in range(ACCUMULATE):
            tokens = batch(fabric.global_rank, step, micro)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                logits = model(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                fabric.backward(loss / ACCUMULATE)
            losses.append(loss.item())
            if micro < ACCUMULATE - 1:
                paused.append(sync_probe(model.module))
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.5)))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if save is not None and save[0] == step:
            fabric.save(save[1], state)
            saved_state = _full_state(model)
    full = _full_state(model)
    strategy = fabric.strategy
    facts: dict[str, Any] = {"loaded_step": loaded_step, "resumed_step": state["step"]}
    if isinstance(strategy, OSDPFabricStrategy) and strategy.plan is not None:
        facts["modes"] = sorted({d.mode for d in strategy.plan.decisions.values()})
        facts["plan"] = strategy.plan.to_dict()["decisions"]
        facts["peak"] = strategy.peak_memory_bytes
        facts["summary"] = strategy.summary()
    rank0 = fabric.global_rank == 0
    return {
        "losses": losses,
        "norms": norms,
        "state": full if rank0 else None,
        "saved_state": saved_state if rank0 else None,
        "paused": paused,
        **facts,
    }


def sync_probe(module: GPT) -> tuple[float | None, bool]:
    """After a backward under ``no_backward_sync``: how far ``ln_f``'s gradient differs across the ranks when it is a
    plain tensor (the replicated root under DDP: equal when DDP all-reduced it), and whether ``h.0.ln_1``'s gradient
    exists (a sharded unit's ``.grad`` is set by its gradient reduction only)."""
    grad = module.ln_f.weight.grad
    spread = None
    if grad is not None and not hasattr(grad, "placements"):
        gathered = [torch.zeros_like(grad) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, grad.contiguous())
        spread = float(max((g - gathered[0]).abs().max() for g in gathered))
    return spread, module.h[0].ln_1.weight.grad is not None


def _full_state(model: Any) -> dict[str, Tensor]:
    """The unsharded state dict under the model's own keys (a collective; rank 0's is whole)."""
    forward = model._forward_module
    # Copies: on rank 0 a replicated parameter's entry is the live tensor, which the optimizer goes on updating.
    if isinstance(forward, OSDPFabricModule):
        return {k: v.detach().clone() for k, v in full_model_state(forward.module).items()}
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def tight_budget(fabric: L.Fabric) -> int:
    """A budget under which the ample run's plan does not fit: what the planner needs with every unit sharded, plus a
    tenth (another profile of the same model measures a little differently)."""
    strategy = fabric.strategy
    assert isinstance(strategy, OSDPFabricStrategy) and strategy.profile is not None
    return int(strategy.planner_options.smallest_budget(strategy.profile, strategy.topology) * 1.1)


def collectives(fabric: L.Fabric) -> dict[str, Any]:
    """Fabric's collectives through the strategy: barrier, broadcast, all_reduce, all_gather."""
    fabric.barrier()
    rank = fabric.global_rank
    return {
        "broadcast": fabric.broadcast({"from": rank}, src=0),
        "all_reduce_sum": fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item(),
        "all_reduce_mean": fabric.all_reduce(torch.tensor(float(rank + 1))).item(),
        "all_gather": fabric.all_gather(torch.tensor([rank])).flatten().tolist(),
        "sampler": fabric.strategy.distributed_sampler_kwargs,
    }


CASES: dict[str, Callable[[Path, dict[str, Any]], dict[str, Any]]] = {
    "collectives": lambda out, memo: collectives(fabric_for("osdp")),
    "ddp": lambda out, memo: train(fabric_for("ddp")),
    "osdp": lambda out, memo: train(fabric_for("osdp")),
    "osdp_plan": lambda out, memo: train(fabric_for(OSDPFabricStrategy(plan=Plan(TIGHT)))),
    "osdp_budget": lambda out, memo: train(fabric_for(OSDPFabricStrategy(memory_budget=memo["tight"]))),
    "ddp_bf16": lambda out, memo: train(fabric_for("ddp", "bf16-mixed")),
    "osdp_mp": lambda out, memo: train(
        fabric_for(OSDPFabricStrategy(plan=Plan(TIGHT_NO_SPLIT), mixed_precision="bf16"), "bf16-mixed")
    ),
    "ddp_bf16_true": lambda out, memo: train(fabric_for("ddp", "bf16-true")),
    "osdp_bf16_true": lambda out, memo: train(fabric_for(OSDPFabricStrategy(plan=Plan(TIGHT_NO_SPLIT)), "bf16-true")),
    "osdp_bf16": lambda out, memo: train(fabric_for(OSDPFabricStrategy(plan=Plan(TIGHT_NO_SPLIT)), "bf16-mixed")),
    # A meta model planned at its first forward (stand-ins until then), and one under a plan given at setup: the
    # materialization is the unsharded model's under any plan, so both train alike.
    "osdp_meta": lambda out, memo: train(fabric_for("osdp"), meta=True),
    "osdp_meta_plan": lambda out, memo: train(fabric_for(OSDPFabricStrategy(plan=Plan(TIGHT))), meta=True),
    # `fabric.setup(model, optimizer)` at once, a meta model planned at its first forward under a tight budget.
    "osdp_meta_joint": lambda out, memo: train(
        fabric_for(OSDPFabricStrategy(memory_budget=memo["tight"])), meta=True, joint=True
    ),
    # Saved after step 1 under the solved plan, resumed under the tight plan for steps 2-3.
    "osdp_save": lambda out, memo: train(fabric_for("osdp"), save=(1, out / "ckpt")),
    "osdp_resume": lambda out, memo: train(
        fabric_for(OSDPFabricStrategy(plan=Plan(TIGHT))), steps=range(2, STEPS), resume=out / "ckpt"
    ),
    # A full checkpoint file (state_dict_type="full"), saved and resumed under the tight plan.
    "osdp_full_save": lambda out, memo: train(
        fabric_for(OSDPFabricStrategy(plan=Plan(TIGHT), state_dict_type="full")), save=(1, out / "full.ckpt")
    ),
    "osdp_full_resume": lambda out, memo: train(
        fabric_for(OSDPFabricStrategy(plan=Plan(TIGHT), state_dict_type="full")),
        steps=range(2, STEPS),
        resume=out / "full.ckpt",
    ),
    # Loaded on one rank (another world size): DCP reshards the two ranks' shards.
    "osdp_load_one_rank": lambda out, memo: train(fabric_for("osdp", devices=1), steps=range(0), resume=out / "ckpt"),
    # Resumed by a model not planned yet: it takes the checkpoint's plan.
    "osdp_resume_unplanned": lambda out, memo: train(fabric_for("osdp"), steps=range(2, STEPS), resume=out / "ckpt"),
}


def main() -> None:
    out = Path(sys.argv[1])
    memo: dict[str, Any] = {}
    for case in sys.argv[2:]:
        if case in ("osdp_budget", "osdp_meta_joint") and "tight" not in memo:
            raise SystemExit(f"{case} needs the osdp case before it (its profile sizes the budget)")
        result = CASES[case](out, memo)
        if case == "osdp":
            memo["tight"] = tight_budget(FABRICS[-1])
        rank = FABRICS[-1].global_rank
        torch.save(result, out / f"{case}.rank{rank}.pt")


if __name__ == "__main__":
    main()
    finish()
