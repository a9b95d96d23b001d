"""What the GPU tests (``tests/gpu/test_gpu_*.py``) share: the device parameter, the tolerances, one TinyGPT fit,
the comparison of two runs, the batch meter, and the retry with ``foreach=False`` (see
[Note: the default optimizer on CUDA]).

A test takes its device as a parameter, :data:`DEVICES`: ``cuda`` (marked ``cuda``, skipped without a CUDA device)
and, where the check's logic does not depend on the device, ``cpu``, the same test at small sizes, marked ``slow``:
it proves the test runs to the end and its comparisons work, nothing about a GPU. Figures go through pytest's
``record_property``; ``scripts/gpu_check.py``, loaded as a pytest plugin by ``scripts/gpu_check.sh``, writes them
into ``gpu_check.json``.

[Note: the default optimizer on CUDA]
``torch.optim.AdamW`` (and Adam, SGD) take the ``foreach`` path by default when every parameter is on CUDA, and
``torch.amp.GradScaler``/``ShardedGradScaler`` always unscale with a foreach kernel. A mixed plan puts plain tensors
(``no_shard``, under DDP) and DTensors (sharded units) in one parameter group, and DTensor refuses foreach ops over
such a list ("got mixed torch.Tensor and DTensor"). On CPU the default is the per-tensor path, so the CPU suite never
met it; the strategy steps such groups per tensor (``lightning_osdp/apply/optimizer.py``) and 16-mixed unscales with
:class:`~lightning_osdp.precision.OSDPGradScaler` (``test_gpu_defaults.py`` reproduces both on the CPU). The tests run
what a user runs first (the device's default), so they test those fixes on the device; should the error come back,
:func:`run_with_default_optimizer` runs the case again with ``foreach=False`` so that its figures are still recorded,
and the test fails on it afterwards. On the CPU the first attempt uses ``foreach=True``, which CUDA's default is.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
#: Skips a test without a CUDA device; a CUDA test carries it and the ``cuda`` marker.
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
#: The marks of a test parameter that needs a CUDA device.
CUDA = (pytest.mark.cuda, NEEDS_CUDA)
#: A check on the GPU, and the same check at small sizes on the CPU (see the module docstring).
DEVICES = [pytest.param("cuda", marks=CUDA), pytest.param("cpu", marks=pytest.mark.slow)]

#: Relative tolerance of losses (per step) and parameters (per tensor, max |a - b| / max |b|) against the reference
#: run, per precision; docs/gpu.md gives the reasoning.
PARITY_RTOL = {"32-true": 1e-5, "bf16-mixed": 2e-2, "bf16-true": 2e-2, "16-mixed": 5e-3}
#: The cost model's targets (issue 3): peak memory within 10%, step time within 15% of measured.
MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.15
#: The strategy's peak is the allocator's over a sub-interval of the callback's: at most this much below it.
ALLOCATOR_SLACK = 0.05
#: A measured device rate this far from the rate a dry run assumes (either way) is a miss.
RATE_TOLERANCE = 0.25
#: What DTensor says when a foreach operator gets plain tensors and DTensors in one list.
MIXED_TENSORS = "got mixed torch.Tensor and DTensor"

T = TypeVar("T")


# ============================================================================================== comparisons
def relative_gap(got: float, want: float) -> float:
    """``|got - want| / |want|`` (``inf`` when ``want`` is 0 and ``got`` is not)."""
    if want == 0:
        return 0.0 if got == 0 else math.inf
    return abs(got - want) / abs(want)


def tensor_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` over two tensors of one shape (0 for empty ones)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} against {tuple(want.shape)}")
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(torch.finfo(torch.float32).tiny))


def compare_runs(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """Largest relative gaps between two runs' ``losses`` (per step) and ``state`` (per tensor; the key sets must
    be equal), with the tensor where the parameter gap is largest."""
    if len(got["losses"]) != len(want["losses"]) or not want["losses"]:
        raise ValueError(f"the runs took {len(got['losses'])} and {len(want['losses'])} steps")
    missing = sorted(set(got["state"]) ^ set(want["state"]))
    if missing:
        raise ValueError(f"state-dict keys differ: {missing[:5]}")
    loss = max(relative_gap(a, b) for a, b in zip(got["losses"], want["losses"], strict=True))
    gaps = {key: tensor_gap(got["state"][key], value) for key, value in want["state"].items()}
    worst = max(gaps, key=lambda k: gaps[k]) if gaps else ""
    return {"loss_rel": loss, "param_rel": gaps.get(worst, 0.0), "worst_param": worst, "steps": len(want["losses"])}


def gib(value: float | None) -> str:
    from lightning_osdp.budget import format_bytes

    return "n/a" if value is None else format_bytes(value)


# ============================================================================================== the device
def release_memory() -> None:
    """Collect garbage and return cached CUDA blocks, so that what an earlier run left does not count in the next
    run's allocator peak."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextmanager
def deterministic_cuda() -> Iterator[None]:
    """Reproducible cuBLAS reductions (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS makes its handle, so before a
    file's first matmul) for a parity file, and torch's deterministic-algorithms flag (which ``Trainer(deterministic=
    ...)`` sets for the whole process) as it was afterwards. cuBLAS keeps its handle: the timed tests run in processes
    of their own (``scripts/gpu_check.sh`` runs each file as its own pytest)."""
    previous = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    flags = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        if previous is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = previous


@contextmanager
def deterministic_attention(device: str) -> Iterator[None]:
    """On CUDA, the math kernel of scaled-dot-product attention: the fused kernels' backward may use atomics, whose
    order changes from run to run, and a parity test must compare the strategy, not that noise."""
    if device != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


# ============================================================================================== the optimizer
def default_foreach(device: str) -> bool | None:
    """The first attempt's ``foreach``: the device's own default on CUDA (``None``: torch picks foreach), ``True`` on
    the CPU, which is what that default is on CUDA (see [Note: the default optimizer on CUDA])."""
    return None if device == "cuda" else True


def run_with_default_optimizer(device: str, run: Callable[[bool | None], T]) -> tuple[T, bool | None, str | None]:
    """``run(foreach)`` with the device's default optimizer; if a foreach operator meets plain tensors and DTensors,
    ``run(False)``. Returns the result, the ``foreach`` it ran with and the first attempt's error (``None``: none)."""
    first = default_foreach(device)
    try:
        return run(first), first, None
    except RuntimeError as error:
        if MIXED_TENSORS not in str(error):
            raise
        why = (
            f"fails with the device's default optimizer (foreach={first}): {str(error).split('!')[0]} (see "
            "[Note: the default optimizer on CUDA]); ran again with foreach=False"
        )
    release_memory()  # the failed attempt's model and optimizer must not count in the next one's peak
    return run(False), False, why


def with_foreach(cls: type, foreach: bool | None) -> type:
    """``cls`` whose optimizers run with ``foreach`` (``None``: torch's default for the parameters' device). The
    optimizers read ``group["foreach"]`` at every step, so setting it after ``configure_optimizers`` is enough."""

    class WithForeach(cls):  # type: ignore[misc,valid-type]
        def configure_optimizers(self) -> Any:
            configured = super().configure_optimizers()
            for optimizer in _optimizers_in(configured):
                for group in optimizer.param_groups:
                    group["foreach"] = foreach
            return configured

    WithForeach.__name__ = WithForeach.__qualname__ = f"{cls.__name__}Foreach{foreach}"
    return WithForeach


def _optimizers_in(configured: Any) -> list[torch.optim.Optimizer]:
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, dict):
        return _optimizers_in(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        return [o for item in configured for o in _optimizers_in(item)]
    return []


# ============================================================================================== training
class BatchMeter(L.Callback):
    """Each training batch from ``on_train_batch_start`` to ``on_train_batch_end``: wall time (the device
    synchronised at both ends) and, on CUDA, the allocator's peak (``reset_peak_memory_stats`` at the start,
    ``max_memory_allocated`` and the reserved peak at the end).

    The strategy resets the same counter when its step opens (nothing is allocated between the two resets, the batch
    is on the device already), so this reading is the allocator's peak over the strategy's window and the rest of the
    batch (logging, callbacks): never below the strategy's figure, and equal to it when the strategy's window holds
    the batch's peak."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.allocated: list[int] = []
        self.reserved: list[int] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.allocated.append(int(torch.cuda.max_memory_allocated(device)))
            self.reserved.append(int(torch.cuda.memory_stats(device)["reserved_bytes.all.peak"]))
        self.seconds.append(time.perf_counter() - self._start)


QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def full_state(trainer: L.Trainer, model: L.LightningModule) -> dict[str, torch.Tensor]:
    """The whole model's state (the model's own keys) in fp32 on the CPU; empty on ranks other than 0 under OSDP."""
    from lightning_osdp import OSDPStrategy

    strategy = trainer.strategy
    state = strategy.full_model_state_dict() if isinstance(strategy, OSDPStrategy) else model.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def fit_tiny(
    device: str,
    scratch: Path,
    precision: str,
    strategy: Any,
    *,
    foreach: bool | None,
    max_steps: int = 8,
    max_epochs: int | None = None,
    callbacks: list[L.Callback] | None = None,
    ckpt_path: Path | None = None,
    num_nodes: int = 1,
    samples: int = 64,
) -> tuple[L.Trainer, L.LightningModule]:
    """One ``Trainer.fit`` of TinyGPT (tests/models.py: tied weights, a parameter on the LightningModule, a frozen
    module) on ``samples`` sequences of the test data, in order, 4 per batch (seed 0), on one device of each of
    ``num_nodes`` processes; returns the trainer and the model."""
    from torch.utils.data import DataLoader

    from models import TinyGPT, TokenDataset

    L.seed_everything(0, workers=True, verbose=False)
    model = with_foreach(TinyGPT, foreach)()
    callbacks = callbacks or []
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        max_steps=-1 if max_epochs else max_steps,
        max_epochs=max_epochs,
        enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        callbacks=callbacks,
        default_root_dir=str(scratch),
        # OSDP is a distributed strategy: Lightning would give it a DistributedSampler, which shuffles the training
        # data (even on one rank) where the single-device run reads it in order. On one rank, both read it in order.
        use_distributed_sampler=num_nodes > 1,
        deterministic="warn",
        **QUIET,
    )
    with deterministic_attention(device):
        trainer.fit(model, DataLoader(TokenDataset(samples), batch_size=4), ckpt_path=ckpt_path)
    return trainer, model


def tiny_run(trainer: L.Trainer, model: L.LightningModule) -> dict[str, Any]:
    """A fit's losses, full state and final loss scale (16-mixed; else ``None``)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "losses": list(model.losses),
        "state": full_state(trainer, model),
        "scale": float(scaler.get_scale()) if scaler is not None else None,
    }
