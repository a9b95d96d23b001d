"""Checkpoint cases: save, resume, resume under another plan or world size, consolidate; run in shared processes.

``checkpoint_runner.py OUT world2``: under ``torchrun --nproc-per-node 2``, every two-rank case in one launch (the
imports and the gloo group are shared), in dependency order; each case writes ``OUT/CASE.rank{R}.pt``.
``checkpoint_runner.py OUT batchnorm``: a BatchNorm model (buffers that every training forward changes) saved as
every checkpoint kind and resumed from each, under an all-sharded and a mixed plan (2 ranks).
``checkpoint_runner.py OUT save-loop PATH``: one process saving a large model to PATH again and again (the
kill-during-save test kills it). ``checkpoint_runner.py OUT save-concurrently PATH N``: N saves to PATH, while other
processes save there too. ``checkpoint_runner.py OUT bench``: save/load timings, sharded vs full (2 ranks).
The one-rank cases run inside the test process (:func:`fit` is imported from here).
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clean_exit import finish

from lightning_osdp import OSDPStrategy, Plan
from lightning_osdp import checkpoint as ckpt

from models import BatchNormCNN, ImageDataset, TinyGPT, loaders

PLANS: dict[str, dict[str, Any]] = {
    # Tied embedding and head as their own sharded group, split operators in a sharded block (as runner.py).
    "tied_split": {
        "": "no_shard",
        "wte": "full_shard",
        "lm_head": "full_shard",
        "h.0": "shard_grad_op",
        "h.0.fc": ("full_shard", 4),
        "h.1.proj": ("full_shard", 2),
    },
    # Every mode and split differs from tied_split: what a changed budget could produce.
    "other": {
        "": "full_shard",
        "h.0": "full_shard",
        "h.0.fc": ("shard_grad_op", 3),
        "h.1": "no_shard",
        "h.2": "shard_grad_op",
        "h.2.proj": ("full_shard", 2),
    },
    "mixed": {"": "no_shard", "h.0": "full_shard", "h.1": "shard_grad_op", "h.2": "no_shard", "frozen": "full_shard"},
    # BatchNormCNN's: every unit sharded (the root broadcasts rank 0's buffers), and DDP beside FSDP2 (DDP does).
    "bn_sharded": {"": "full_shard", "blocks.0": "full_shard", "blocks.1": "shard_grad_op", "blocks.2": "full_shard"},
    "bn_mixed": {"": "no_shard", "blocks.0": "full_shard", "blocks.1": "no_shard", "blocks.2": "shard_grad_op"},
    "bn_replicated": {"": "no_shard", "blocks.0": "no_shard", "blocks.1": "no_shard", "blocks.2": "no_shard"},
}
#: Steps per epoch at two ranks: 64 samples, batch 4 per rank.
EPOCH_STEPS_2 = 8


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def snapshot(trainer: L.Trainer) -> dict[str, Any] | None:
    """The full model and optimizer states (the model's own keys; optimizer in ``optimizer.state_dict()`` format)
    on rank 0, ``None`` elsewhere. A collective under OSDP."""
    strategy = trainer.strategy
    module = trainer.lightning_module
    optimizers = [o._optimizer if hasattr(o, "_optimizer") else o for o in trainer.optimizers]
    if isinstance(strategy, OSDPStrategy):
        model = strategy.full_model_state_dict()
        # Copies: for replicated parameters the gathered state aliases the live tensors, updated in place later.
        optim = [_clone(ckpt.full_optimizer_state(module, o)) for o in optimizers]
    else:
        model = {k: v.detach().clone() for k, v in module.state_dict().items()}
        optim = [_clone(o.state_dict()) for o in optimizers]
    if _rank() != 0:
        return None
    return {"model": {k: v.float().clone() for k, v in model.items()}, "optim": optim, "step": trainer.global_step}


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def local_buffers(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """This rank's own buffers (copies): after a training forward each rank holds the statistics of its batch."""
    return {name: b.detach().clone() for name, b in module.named_buffers()}


class Recorder(Callback):
    """Snapshots after the restore (``start``), after given steps, and at the end of training; and each rank's own
    buffers at the same points."""

    def __init__(self, at_steps: tuple[int, ...] = ()) -> None:
        self.at_steps = at_steps
        self.states: dict[Any, Any] = {}
        self.buffers: dict[Any, dict[str, torch.Tensor]] = {}

    def _record(self, key: Any, trainer: L.Trainer) -> None:
        self.states[key] = snapshot(trainer)
        self.buffers[key] = local_buffers(trainer.lightning_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("start", trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in self.at_steps:
            self._record(trainer.global_step, trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("end", trainer)


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fit(
    out: Path,
    name: str,
    *,
    plan: str | None,
    devices: int,
    state_dict_type: str = "sharded",
    ckpt_path: Path | str | None = None,
    last_in: Path | None = None,
    max_steps: int = -1,
    save_every: int | None = None,
    save_epochs: bool = False,
    save_last_link: bool = False,
    record_at: tuple[int, ...] = (),
    model_kwargs: dict[str, Any] | None = None,
    model_class: str = "TinyGPT",
) -> dict[str, Any]:
    """One ``Trainer.fit`` of TinyGPT (or ``model_class="BatchNormCNN"``, 4 steps per epoch at two ranks) (DDP when
    ``plan`` is None), with ModelCheckpoint saving to ``out/name``; returns (and saves as ``out/name.rank{R}.pt``) the
    losses, snapshots, this rank's buffers, messages and error of this rank.

    ``save_last_link`` (with ``save_epochs``): the epoch checkpoints keep only the first one (``save_top_k=1`` on
    the smallest ``step``), and ``last.ckpt`` is a link to it (``save_last="link"``), still at the run's end.
    ``last_in``: the directory where ``ckpt_path="last"`` finds ``last.ckpt``, through a ModelCheckpoint there that
    saves nothing (Lightning looks for ``last*.ckpt`` in its checkpoint callbacks' directories)."""
    L.seed_everything(0, workers=True)
    model: TinyGPT | BatchNormCNN
    if model_class == "BatchNormCNN":
        model = BatchNormCNN(**(model_kwargs or {}))
        train = DataLoader(ImageDataset(), batch_size=8, shuffle=True)
    else:
        model = TinyGPT(**(model_kwargs or {}))
        train, _ = loaders()
    recorder = Recorder(record_at)
    callbacks: list[Callback] = [recorder]
    if save_every:
        callbacks.append(ModelCheckpoint(out / name, filename="{step}", every_n_train_steps=save_every, save_top_k=-1))
    if save_epochs and save_last_link:
        callbacks.append(
            ModelCheckpoint(
                out / name,
                filename="{epoch}",
                save_on_train_epoch_end=True,
                monitor="step",
                mode="min",
                save_top_k=1,
                save_last="link",
            )
        )
    elif save_epochs:
        callbacks.append(ModelCheckpoint(out / name, filename="{epoch}", save_on_train_epoch_end=True, save_top_k=-1))
    if last_in is not None:
        callbacks.append(ModelCheckpoint(last_in, save_top_k=0))
    strategy: Any = "ddp"
    if plan is not None:
        # memory_steps=0: the CPU peak-memory tracker is not under test here, and it costs Python time per operator.
        strategy = OSDPStrategy(plan=Plan(PLANS[plan]), state_dict_type=state_dict_type, memory_steps=0)  # type: ignore[arg-type]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(save_every or save_epochs or last_in),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        deterministic=True,
    )
    messages = _Messages()
    logging.getLogger("lightning.pytorch").addHandler(messages)
    error: BaseException | None = None
    try:
        trainer.fit(model, train, ckpt_path=ckpt_path)
    except Exception as err:
        error = err
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(messages)
    result = {
        "losses": model.losses,
        "states": recorder.states,
        "buffers": recorder.buffers,
        "global_step": trainer.global_step,
        "messages": messages.lines,
        "error": None if error is None else (type(error).__name__, str(error)),
    }
    torch.save(result, out / f"{name}.rank{_rank()}.pt")
    return result


def world2(out: Path) -> None:
    """The two-rank cases, in dependency order (later cases resume from earlier cases' checkpoints)."""
    osdp, ddp = out / "A_osdp", out / "A_ddp"
    # Uninterrupted runs that also checkpoint mid-epoch (step 5) and at the end of epoch 0 (step 8).
    for name, plan in (("A_ddp", None), ("A_osdp", "tied_split")):
        fit(out, name, plan=plan, devices=2, save_every=5, save_epochs=True, record_at=(5,))
    # Interrupted at step 5 (mid-epoch) and 8 (epoch boundary), resumed: DDP as the reference.
    fit(out, "R5_ddp", plan=None, devices=2, ckpt_path=ddp / "step=5.ckpt")
    fit(out, "R8_ddp", plan=None, devices=2, ckpt_path=ddp / "epoch=0.ckpt")
    fit(out, "R5_osdp", plan="tied_split", devices=2, ckpt_path=osdp / "step=5.ckpt")
    fit(out, "R8_osdp", plan="tied_split", devices=2, ckpt_path=osdp / "epoch=0.ckpt")
    # Another plan: other modes and other splits of the same operators.
    fit(out, "R5_other", plan="other", devices=2, ckpt_path=osdp / "step=5.ckpt")
    # One consolidated file, resumed under yet another plan.
    fit(out, "A_full", plan="tied_split", devices=2, state_dict_type="full", max_steps=5, save_every=5, record_at=(5,))
    fit(out, "R5_full", plan="mixed", devices=2, ckpt_path=out / "A_full" / "step=5.ckpt")
    # A plain Lightning DDP checkpoint resumes under OSDP (with splits): checkpoints are portable both ways (the
    # test process checks that a consolidated OSDP checkpoint is what DDP writes).
    fit(out, "R5_osdp_from_ddp", plan="other", devices=2, ckpt_path=ddp / "step=5.ckpt")
    # World size 1 -> 2: the one-rank checkpoint written by the test process before this launch.
    if (out / "W1" / "step=5.ckpt").exists():
        fit(out, "R_1to2", plan="mixed", devices=2, ckpt_path=out / "W1" / "step=5.ckpt")
    # Incompatible checkpoints: errors name the keys, raised on every rank before DCP reads anything.
    fit(out, "bad_model", plan="tied_split", devices=2, ckpt_path=osdp / "step=5.ckpt", model_kwargs={"hidden": 86})
    fit(
        out,
        "bad_optim",
        plan="tied_split",
        devices=2,
        ckpt_path=osdp / "step=5.ckpt",
        model_kwargs={"optimizer": "sgd"},
    )
    # One bit of rank 1's shard flipped after the save, its size unchanged: every rank refuses, naming the file.
    flipped = out / "flipped.ckpt"
    if _rank() == 0:
        shutil.copytree(osdp / "step=5.ckpt", flipped)
        shard = flipped / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    fit(out, "bad_bits", plan="tied_split", devices=2, ckpt_path=flipped)


def batchnorm(out: Path) -> None:
    """BatchNormCNN under an all-sharded, a mixed and an all-replicated plan: an uninterrupted run that saves a
    sharded checkpoint at the end of epoch 0 (step 4), ``last.ckpt`` a link to it, and records each rank's buffers
    there; the same run stopped there under ``state_dict_type="full"`` (one file); the sharded checkpoint
    consolidated; then the run resumed from each of the four: ``BN_{plan}_from_{kind}``."""
    bn = "BatchNormCNN"
    for plan in ("bn_sharded", "bn_mixed", "bn_replicated"):
        name = f"BN_{plan}"
        fit(out, name, plan=plan, devices=2, save_epochs=True, save_last_link=True, record_at=(4,), model_class=bn)
        full = f"{name}_full_save"
        fit(out, full, plan=plan, devices=2, state_dict_type="full", max_steps=4, save_epochs=True, model_class=bn)
        consolidated = out / f"{name}.consolidated.ckpt"
        if _rank() == 0:
            ckpt.consolidate(out / name / "epoch=0.ckpt", consolidated)
        dist.barrier()
        sources: dict[str, Path | str] = {
            "sharded": out / name / "epoch=0.ckpt",
            "full": out / full / "epoch=0.ckpt",
            "consolidated": consolidated,
            "last_link": "last",  # out/name/last.ckpt, found by Lightning as fit(ckpt_path="last") finds it
        }
        for kind, source in sources.items():
            last_in = out / name if source == "last" else None
            fit(out, f"{name}_from_{kind}", plan=plan, devices=2, ckpt_path=source, last_in=last_in, model_class=bn)


# ---------------------------------------------------------------------------------------------- kill during save
def save_loop(out: Path, path: Path) -> None:
    """Save a ~200 MB FSDP2-sharded model to ``path`` forever; version ``v`` has every parameter equal to ``v``."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(48)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    context = ckpt.CheckpointContext(world_size=1)
    version = 0
    while True:
        version += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(version))
        state = {"state_dict": ckpt.sharded_model_state(model), "global_step": version}
        ckpt.save_checkpoint(state, path, module=model, context=context)
        print(f"saved {version}", flush=True)


# ---------------------------------------------------------------------------------------------- concurrent saves
def save_concurrently(path: Path, saves: int) -> None:
    """Save a small model ``saves`` times to ``path``, sharded and full in turn, with no process group, while other
    processes do the same to the same path; every save must complete."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    context = ckpt.CheckpointContext(world_size=1)
    for i in range(saves):
        kind = "sharded" if i % 2 == 0 else "full"
        state = ckpt.sharded_model_state(model) if kind == "sharded" else ckpt.full_model_state(model)
        ckpt.save_checkpoint(
            {"state_dict": state, "global_step": i}, path, module=model, context=context, state_dict_type=kind
        )  # type: ignore[arg-type]
    print(f"saved {saves}", flush=True)


# ---------------------------------------------------------------------------------------------- timings
def bench(out: Path) -> None:
    """Save and load times of a ~7M-parameter GPT at 2 ranks (full_shard), sharded vs full, with AdamW state."""
    from lightning_osdp.apply import apply_plan

    mesh = _init_world()
    torch.manual_seed(0)
    model = TinyGPT(vocab=8192, width=288, hidden=1152, layers=4, context=128)
    n_params = sum(p.numel() for p in model.parameters())
    plan = Plan.uniform(model, "full_shard")
    root = apply_plan(model, plan, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 8192, (2, 65))
    loss = torch.nn.functional.cross_entropy(root(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    context = ckpt.CheckpointContext(world_size=dist.get_world_size(), plan=plan)
    timings: dict[str, list[float]] = {}

    def timed(label: str, fn: Any) -> Any:
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        dist.barrier()
        timings.setdefault(label, []).append(time.perf_counter() - start)
        return result

    for _ in range(5):
        for kind in ("sharded", "full"):
            path = out / f"bench_{kind}.ckpt"

            def save(kind: str = kind, path: Path = path) -> None:
                if kind == "sharded":
                    state = {
                        "state_dict": ckpt.sharded_model_state(model),
                        "optimizer_states": [ckpt.sharded_optimizer_state(model, optimizer)],
                    }
                else:
                    state = {
                        "state_dict": ckpt.full_model_state(model),
                        "optimizer_states": [ckpt.full_optimizer_state(model, optimizer)],
                    }
                ckpt.save_checkpoint(state, path, module=model, context=context, state_dict_type=kind)  # type: ignore[arg-type]

            def load(path: Path = path) -> None:
                checkpoint = ckpt.load_checkpoint(path)
                ckpt.load_model_state(model, checkpoint)
                ckpt.load_optimizer_states(model, [optimizer], checkpoint)

            timed(f"save {kind}", save)
            timed(f"load {kind}", load)
    if dist.get_rank() == 0:
        files = {f.name: f.stat().st_size for f in (out / "bench_sharded.ckpt").iterdir()}
        print(f"model: {n_params / 1e6:.2f} M parameters; sharded files {files}")
        print(f"full file: {(out / 'bench_full.ckpt').stat().st_size} bytes")
        for label, seconds in timings.items():
            runs = ", ".join(f"{s:.3f}" for s in seconds)
            print(f"{label}: median {sorted(seconds)[len(seconds) // 2]:.3f} s  (runs {runs})")


def _init_world() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    return init_device_mesh("cpu", (dist.get_world_size(),))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    mode = sys.argv[2]
    if mode == "world2":
        world2(out)
    elif mode == "batchnorm":
        batchnorm(out)
    elif mode == "save-loop":
        save_loop(out, Path(sys.argv[3]))
    elif mode == "save-concurrently":
        save_concurrently(Path(sys.argv[3]), int(sys.argv[4]))
    elif mode == "bench":
        bench(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
    finish()
