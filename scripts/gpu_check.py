"""The checks ``scripts/gpu_check.sh`` runs on one CUDA device: the CUDA path of lightning_osdp at world size 1.

``python scripts/gpu_check.py --out DIR [--device cuda|cpu] [--only a,b] [--budget SECONDS]`` runs every check
below in its own process (a fresh CUDA context and allocator each, and a kill that reaches its children when it
overruns), one after another, within ``--budget`` seconds for all of them; a check that fails, errs or times out is
recorded and the next one runs. ``DIR/gpu_check.json`` holds each check's status, figures and failures, rewritten
after every check; everything printed goes to the caller (``gpu_check.sh`` tees it into ``DIR/gpu_check.log``).
Exit status: 0 all checks passed, 1 some did not, 3 no CUDA device (``--device cuda`` on a machine without one: the
JSON says so and nothing runs).

``--device cpu`` is a dry run of the same code on the CPU at small sizes: it proves the checks run to the end and
that their comparisons work, nothing about a GPU. Its figures are CPU figures, labelled so in the JSON.

The checks (see ``docs/gpu.md`` for what each figure means and the tolerances):

* ``env``: versions (Python, torch, CUDA, cuDNN, NCCL, driver, Lightning, pulp), the device, and whether pulp's CBC
  solver runs.
* ``parity``: TinyGPT (tests/models.py: tied weights, a parameter on the LightningModule, a frozen module) trained
  8 steps with ``strategy=OSDPStrategy(plan=...)`` against Lightning's single-device strategy, same seed and data,
  in 32-true, bf16-mixed, bf16-true and 16-mixed (the grad scaler path), for a plan mixing every mode and an
  all-sharded one (and in 32-true one with split Linears and the tied embedding/head as a sharded group): losses per
  step and final parameters within a relative tolerance per precision (:data:`PARITY_RTOL`), and for 16-mixed the
  same loss scale at the end.
* ``gpt124``: the example GPT at GPT-2 small's shape (124M parameters, context 1024, batch 32, bf16-mixed): the
  strategy's measured peak against ``torch.cuda.max_memory_allocated`` read around each batch by a callback, the cost
  model's predicted peak against both (within 10%) and its predicted step time against the measured one (within
  15%), for the planner's own plan (profiled on this device), all ``full_shard`` and a mixed plan; and
  ``osdp plan --hardware h200-sxm`` (the dry run on data-sheet figures) against the same measurements.
* ``hardware``: bf16, fp32 and tf32 matmul rates and memory bandwidth measured on the device (CUDA events, large
  operands) beside the ``h200-sxm`` preset's data-sheet figures and the rates a dry run uses, and beside what
  ``lightning_osdp.profiling.measure_device_rates`` (the estimated mode's own benchmark) measures.
* ``checkpoint``: a sharded checkpoint saved on the device at the end of an epoch resumes to the same losses and
  parameters as the uninterrupted run, and ``python -m lightning_osdp.checkpoint.consolidate`` turns it into one
  file that loads without OSDP, equal to the saved state.
* ``gloo2``: two processes on the one device (two single-process torchrun agents, each ``LOCAL_RANK=0``) over gloo:
  first the raw collectives FSDP2 and DDP issue, on CUDA tensors; then Lightning's DDP against OSDP with a mixed plan.

[Note: the default optimizer on CUDA]
``torch.optim.AdamW`` (and Adam, SGD) take the ``foreach`` path by default when every parameter is on CUDA, and
``torch.amp.GradScaler``/``ShardedGradScaler`` always unscale with a foreach kernel. A mixed plan puts plain tensors
(``no_shard``, under DDP) and DTensors (sharded units) in one parameter group, and DTensor refuses foreach ops over
such a list ("got mixed torch.Tensor and DTensor"). On CPU the default is the per-tensor path, so the CPU suite never
met it; the strategy now steps such groups per tensor (``lightning_osdp/apply/optimizer.py``) and 16-mixed unscales
with :class:`~lightning_osdp.precision.OSDPGradScaler`. The checks run what a user runs first (the device's default),
so they test those fixes on the device; should the error come back they record it as a failure and run again with
``foreach=False`` (:func:`run_with_foreach_fallback`), so that one defect does not hide every later figure. On the
CPU dry run the first attempt uses ``foreach=True``, which is what CUDA's default is.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The test helpers (tests/models.py, tests/distributed/*.py) and, when the package is not installed, the package.
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

#: Relative tolerance of losses (per step) and parameters (per tensor, max |a - b| / max |b|) against the
#: single-device run, per precision; see docs/gpu.md for the reasoning.
PARITY_RTOL = {"32-true": 1e-5, "bf16-mixed": 2e-2, "bf16-true": 2e-2, "16-mixed": 5e-3}
#: The cost model's targets (issue 3): peak memory within 10%, step time within 15% of measured.
MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.15
#: The strategy's peak is the allocator's over a sub-interval of the callback's: at most this much below it.
ALLOCATOR_SLACK = 0.05
#: A measured device rate this far from the rate a dry run assumes (either way) is reported as a miss.
RATE_TOLERANCE = 0.25
#: What DTensor says when a foreach operator gets plain tensors and DTensors in one list.
MIXED_TENSORS = "got mixed torch.Tensor and DTensor"
#: Below this many seconds left in the budget a check is not started.
MIN_CHECK_SECONDS = 15.0


# ============================================================================================== results
@dataclass
class Outcome:
    """What a check measured (``figures``, JSON-able), what did not hold (``failures``, one line each) and
    remarks that are neither (``notes``)."""

    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def expect(self, ok: bool, message: str) -> bool:
        if not ok:
            self.failures.append(message)
        return ok


@dataclass(frozen=True)
class Context:
    """Where a check runs: ``device`` (``"cuda"``, or ``"cpu"`` for the dry run at small sizes) and a scratch
    directory of its own."""

    device: str
    scratch: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def relative_gap(got: float, want: float) -> float:
    """``|got - want| / |want|`` (``inf`` when ``want`` is 0 and ``got`` is not)."""
    if want == 0:
        return 0.0 if got == 0 else math.inf
    return abs(got - want) / abs(want)


def tensor_gap(got: Any, want: Any) -> float:
    """``max |got - want| / max |want|`` over two tensors of one shape (0 for empty ones)."""
    import torch

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


# ============================================================================================== shared helpers
def _torch_device(ctx: Context) -> Any:
    import torch

    return torch.device("cuda", 0) if ctx.cuda else torch.device("cpu")


def device_default_foreach(ctx: Context) -> bool | None:
    """The first attempt's ``foreach``: the device's own default on CUDA (``None``: torch picks foreach), and on the
    CPU dry run ``True``, which is what that default is on CUDA (see [Note: the default optimizer on CUDA])."""
    return None if ctx.cuda else True


def run_with_foreach_fallback(
    ctx: Context, outcome: Outcome, label: str, run: Callable[[bool | None], Any]
) -> tuple[Any, bool | None]:
    """``run(foreach)`` with the device's default optimizer; if it fails because a foreach operator met plain
    tensors and DTensors, record that as a failure of ``label`` and run again with ``foreach=False``. Returns the
    result and the ``foreach`` it ran with."""
    first = device_default_foreach(ctx)
    try:
        return run(first), first
    except RuntimeError as error:
        if MIXED_TENSORS not in str(error):
            raise
        outcome.failures.append(
            f"{label}: fails with the device's default optimizer (foreach={first}): {str(error).split('!')[0]} (see "
            "[Note: the default optimizer on CUDA]); run again with foreach=False"
        )
    release_memory()  # the failed attempt's model and optimizer must not count in the next one's peak
    return run(False), False


def release_memory() -> None:
    """Collect garbage and return cached CUDA blocks, so that what an earlier run left does not count in the next
    run's allocator peak."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@functools.cache
def _module_from(path: Path, name: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def suite_plans() -> dict[str, dict[str, Any]]:
    """The plans of the CPU parity suite (tests/distributed/runner.py), by name."""
    plans: dict[str, dict[str, Any]] = _module_from(ROOT / "tests" / "distributed" / "runner.py", "osdp_runner").PLANS
    return plans


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


def _optimizers_in(configured: Any) -> list[Any]:
    import torch

    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, dict):
        return _optimizers_in(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        return [o for item in configured for o in _optimizers_in(item)]
    return []


@contextmanager
def deterministic_attention(ctx: Context) -> Iterator[None]:
    """On CUDA, the math kernel of scaled-dot-product attention: the fused kernels' backward may use atomics, whose
    order changes from run to run, and a parity check must compare the strategy, not that noise."""
    if not ctx.cuda:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def make_callback_class() -> type:
    """A Lightning callback that measures each training batch from ``on_train_batch_start`` to
    ``on_train_batch_end``: wall time (the device synchronised at both ends) and, on CUDA, the allocator's peak
    (``reset_peak_memory_stats`` at the start, ``max_memory_allocated`` and the reserved peak at the end).

    The strategy resets the same counter when its step opens (in ``optimizer_step``; nothing is allocated between
    the two resets, the batch is on the device already), so this reading is the allocator's peak over the strategy's
    window and the rest of the batch (logging, callbacks): never below the strategy's figure, and equal to it when
    the strategy's window holds the batch's peak."""
    import lightning as L
    import torch

    class BatchMeter(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.allocated: list[int] = []
            self.reserved: list[int] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            device = trainer.strategy.root_device
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            device = trainer.strategy.root_device
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                self.allocated.append(int(torch.cuda.max_memory_allocated(device)))
                self.reserved.append(int(torch.cuda.memory_stats(device)["reserved_bytes.all.peak"]))
            self.seconds.append(time.perf_counter() - self._start)

    return BatchMeter


def quiet_trainer_kwargs() -> dict[str, Any]:
    return {
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }


def full_state(trainer: Any, model: Any) -> dict[str, Any]:
    """The whole model's state (the model's own keys) in fp32 on the CPU; empty on ranks other than 0 under OSDP."""
    from lightning_osdp import OSDPStrategy

    strategy = trainer.strategy
    state = strategy.full_model_state_dict() if isinstance(strategy, OSDPStrategy) else model.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


# ============================================================================================== env
def check_env(ctx: Context) -> Outcome:
    """Versions and the device; pulp's bundled CBC must run (the planner's ILP)."""
    import importlib.metadata as md
    import platform

    import torch

    out = Outcome()
    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gloo": torch.distributed.is_gloo_available(),
        "nccl": torch.distributed.is_nccl_available(),
        "install": os.environ.get("OSDP_GPU_CHECK_INSTALL", "not installed by gpu_check.sh"),
    }
    for package in ("lightning", "torchmetrics", "pulp", "jsonargparse", "rich", "PyYAML", "lightning-osdp"):
        try:
            figures[package] = md.version(package)
        except md.PackageNotFoundError:
            figures[package] = None
    import lightning_osdp

    figures["lightning_osdp_path"] = str(Path(lightning_osdp.__file__).parent)
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        figures.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            total_memory_bytes=int(props.total_memory),
            nccl_version=_nccl_version() if figures["nccl"] else None,
            device_count=torch.cuda.device_count(),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            figures["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            figures["nvidia_smi"] = f"unavailable: {err}"
    else:
        figures["device_name"] = platform.processor() or "cpu"
        figures["threads"] = torch.get_num_threads()
    import pulp

    solver = pulp.PULP_CBC_CMD(msg=False)
    figures["cbc_available"] = bool(solver.available())
    if out.expect(figures["cbc_available"], "pulp's bundled CBC solver is not available: the planner cannot solve"):
        problem = pulp.LpProblem("probe", pulp.LpMinimize)
        x = pulp.LpVariable("x", lowBound=0, cat="Integer")
        problem += x
        problem += x >= 2
        problem.solve(solver)
        out.expect(pulp.value(x) == 2, f"CBC solved min x s.t. x >= 2 as {pulp.value(x)}")
    for key, value in figures.items():
        print(f"  {key}: {value}")
    return out


def _nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


# ============================================================================================== parity
def fit_tiny(
    ctx: Context,
    precision: str,
    strategy: Any,
    *,
    foreach: bool | None,
    max_steps: int = 8,
    max_epochs: int | None = None,
    callbacks: list[Any] | None = None,
    ckpt_path: Path | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    samples: int = 64,
) -> tuple[Any, Any]:
    """One ``Trainer.fit`` of TinyGPT on ``samples`` sequences of the test data, in order, 4 per batch (seed 0);
    returns the trainer and the model."""
    import lightning as L
    from torch.utils.data import DataLoader

    from models import TinyGPT, TokenDataset

    L.seed_everything(0, workers=True, verbose=False)
    model = with_foreach(TinyGPT, foreach)()
    train = DataLoader(TokenDataset(samples), batch_size=4)
    trainer = L.Trainer(
        accelerator=ctx.device,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        max_steps=-1 if max_epochs else max_steps,
        max_epochs=max_epochs,
        enable_checkpointing=bool(callbacks and any(type(c).__name__ == "ModelCheckpoint" for c in callbacks)),
        callbacks=callbacks or [],
        default_root_dir=str(ctx.scratch),
        # OSDP is a distributed strategy: Lightning would give it a DistributedSampler, which shuffles the training
        # data (even on one rank) where the single-device run reads it in order. On one rank, both read it in order.
        use_distributed_sampler=devices * num_nodes > 1,
        # Lightning sets CUBLAS_WORKSPACE_CONFIG too late for this process; gpu_check.py sets it for the child.
        deterministic="warn",
        **quiet_trainer_kwargs(),
    )
    with deterministic_attention(ctx):
        trainer.fit(model, train, ckpt_path=ckpt_path)
    return trainer, model


def tiny_run(trainer: Any, model: Any) -> dict[str, Any]:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "losses": list(model.losses),
        "state": full_state(trainer, model),
        "scale": float(scaler.get_scale()) if scaler is not None else None,
    }


def check_parity(ctx: Context, precisions: list[str] | None = None) -> Outcome:
    """OSDP at world size 1 against Lightning's single-device strategy, per precision (default: every one the
    device runs) and plan."""
    from lightning_osdp import OSDPStrategy, Plan

    out = Outcome()
    # Every mode in one model (a replicated root, full_shard, shard_grad_op, a sharded Linear inside a replicated
    # block, a sharded frozen module) and all-sharded; split Linears only in 32-true: a split changes the matmuls'
    # shapes and so their rounding, which in half precision is more than the strategy's own effect (see docs/gpu.md).
    plans = {"mixed": suite_plans()["mixed"], "sharded": suite_plans()["full_shard"]}
    split = {"split": suite_plans()["tied_split"]}
    if precisions is None:
        precisions = list(PARITY_RTOL) if ctx.cuda else [p for p in PARITY_RTOL if p != "16-mixed"]
        if not ctx.cuda:
            out.notes.append("16-mixed needs CUDA (the grad scaler): not run on the CPU dry run")
    out.figures["plans"] = {name: Plan(p).summary() for name, p in {**plans, **split}.items()}
    runs: dict[str, Any] = {}
    for precision in precisions:
        rtol = PARITY_RTOL[precision]
        # The reference runs with the optimizer path the OSDP run ended up with (foreach and per-tensor AdamW round
        # differently), made when first needed.
        references: dict[bool | None, dict[str, Any]] = {}
        for name, plan in {**plans, **(split if precision == "32-true" else {})}.items():
            label = f"{precision}/{name}"
            try:
                got, foreach = run_with_foreach_fallback(
                    ctx,
                    out,
                    label,
                    lambda fe, plan=plan, precision=precision: tiny_run(
                        *fit_tiny(ctx, precision, OSDPStrategy(plan=Plan(plan)), foreach=fe)
                    ),
                )
            except Exception as error:
                out.failures.append(f"{label}: training failed: {type(error).__name__}: {str(error).splitlines()[0]}")
                runs[label] = {"error": f"{type(error).__name__}: {error}"[:500]}
                print(f"  {label}: ERROR {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
                continue
            if foreach not in references:
                references[foreach] = tiny_run(*fit_tiny(ctx, precision, "auto", foreach=foreach))
            reference = references[foreach]
            gaps = compare_runs(got, reference)
            row = {
                **gaps,
                "rtol": rtol,
                "foreach": foreach,
                "scale": got["scale"],
                "reference_scale": reference["scale"],
            }
            runs[label] = row
            ok = out.expect(
                gaps["loss_rel"] <= rtol and gaps["param_rel"] <= rtol,
                f"{label}: losses within {gaps['loss_rel']:.2e} and parameters within {gaps['param_rel']:.2e} "
                f"({gaps['worst_param']}) of the single-device run; tolerance {rtol:.0e}",
            )
            if precision == "16-mixed":
                ok &= out.expect(
                    got["scale"] == reference["scale"],
                    f"{label}: loss scale {got['scale']} at the end against {reference['scale']} single-device",
                )
            print(
                f"  {label}: {'ok' if ok else 'MISS'} loss {gaps['loss_rel']:.2e} params {gaps['param_rel']:.2e} "
                f"(tol {rtol:.0e}, foreach={foreach}, {gaps['steps']} steps)",
                flush=True,
            )
    out.figures["runs"] = runs
    return out


# ============================================================================================== gpt124
@dataclass(frozen=True)
class GPTShape:
    """The GPT run of ``gpt124``: GPT-2 small's shape on CUDA, a small one on the CPU dry run."""

    model: dict[str, Any]
    batch: int
    steps: int
    precision: str
    skip: int  # steps left out of the median step time (lazy init, optimizer state, allocator warm-up)


GPT_CUDA = GPTShape(
    model={"vocab_size": 50304, "context_length": 1024, "width": 768, "depth": 12, "heads": 12},
    batch=32,
    steps=12,
    precision="bf16-mixed",
    skip=3,
)
GPT_CPU = GPTShape(
    model={"vocab_size": 256, "context_length": 64, "width": 64, "depth": 2, "heads": 4},
    batch=4,
    steps=8,
    precision="32-true",
    skip=3,
)


def _gpt_data(shape: GPTShape) -> Any:
    import torch
    from torch.utils.data import DataLoader

    tokens = torch.randint(
        0,
        shape.model["vocab_size"],
        (shape.batch * (shape.steps + 2), shape.model["context_length"] + 1),
        generator=torch.Generator().manual_seed(0),
    )
    return DataLoader(tokens, batch_size=shape.batch)  # windows of context + 1 tokens, as GPTModule takes them


def _gpt_class() -> type:
    return _module_from(ROOT / "examples" / "gpt" / "gpt.py", "osdp_example_gpt").GPTModule  # type: ignore[no-any-return]


def fit_gpt(ctx: Context, shape: GPTShape, plan: Any, foreach: bool | None) -> tuple[dict[str, Any], Any, Any]:
    """Train the GPT ``shape.steps`` steps under ``OSDPStrategy(plan=plan)`` (``None``: the planner's plan);
    returns the strategy's and the callback's measurements, the profile (planner only) and the plan. Nothing of the
    run stays alive afterwards: what it left allocated would count in the next run's peak."""
    import lightning as L

    from lightning_osdp import OSDPStrategy

    release_memory()
    L.seed_everything(0, verbose=False)
    strategy = OSDPStrategy(plan=plan, plan_out=ctx.scratch / "gpt_plan.json")
    model = with_foreach(_gpt_class(), foreach)(**shape.model, lr_schedule="constant")
    meter = make_callback_class()()
    trainer = L.Trainer(
        accelerator=ctx.device,
        devices=1,
        strategy=strategy,
        precision=shape.precision,
        max_steps=shape.steps,
        enable_checkpointing=False,
        callbacks=[meter],
        default_root_dir=str(ctx.scratch),
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, _gpt_data(shape))
    monitor = strategy.monitor
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "plan": strategy.plan.summary(),
        "strategy_peak_bytes": strategy.peak_memory_bytes,
        "strategy_step_seconds": monitor.step_time(skip=shape.skip),
        "strategy_step_seconds_all": [m.seconds for m in monitor.measurements],
        "callback_step_seconds": statistics.median(meter.seconds[shape.skip :]),
        "allocator_peak_bytes": max(meter.allocated) if meter.allocated else None,
        "reserved_peak_bytes": max(meter.reserved) if meter.reserved else None,
        "foreach": foreach,
    }
    if ctx.cuda:
        import torch

        result["device_bytes"] = int(torch.cuda.get_device_properties(0).total_memory)
    check = strategy.prediction_check
    if check is not None:  # the strategy's own check (the planner's plan only), after its first 4 steps
        result["strategy_check"] = {"ok": check.ok, "memory_ratio": check.memory_ratio, "time_ratio": check.time_ratio}
    profile, used = strategy.profile, strategy.plan
    del model, trainer, strategy, monitor
    release_memory()
    return result, profile, used


def _profile_figures(profile: Any) -> dict[str, Any]:
    from dataclasses import asdict

    from lightning_osdp.cost_model import CostModelConfig

    info = profile.info or {}
    modules = sum(m.fwd_seconds + m.bwd_seconds for m in profile.modules.values())
    resolved = asdict(CostModelConfig().resolve(profile))
    return {
        "mode": profile.mode,
        "device": profile.device,
        "plain_step_seconds": info.get("measured_step_seconds"),
        "module_seconds_sum": modules,
        "unattributed_seconds": info.get("unattributed_seconds"),
        "step_overhead_seconds": profile.step_overhead_seconds,
        "optimizer_step_seconds": profile.optimizer_step_seconds,
        "measured_copy_bytes_per_second": info.get("copy_bytes_per_second"),
        "profiling_seconds": profile.profiling_seconds,
        "cost_model_config": resolved,
    }


def _judge_gpt(ctx: Context, out: Outcome, label: str, run: dict[str, Any], prediction: Any) -> None:
    """The figures of one GPT run against each other and against ``prediction``."""
    strategy_peak, allocator_peak = run["strategy_peak_bytes"], run["allocator_peak_bytes"]
    measured_step = run["strategy_step_seconds"]
    units = prediction.units
    run["predicted"] = {
        "peak_bytes": prediction.peak_bytes,
        "peak_at": prediction.peak_at,
        "peak_parts": prediction.peak.as_dict(),
        "step_seconds": prediction.step_seconds,
        "compute_seconds": prediction.compute_seconds,
        "exposed_seconds": prediction.exposed_seconds,
        "copies_seconds": sum(u.time.copies for u in units),
        "optimizer_seconds": sum(u.time.optimizer for u in units),
        "overhead_seconds": sum(u.time.overhead for u in units),
    }
    memory_ratio = prediction.peak_bytes / strategy_peak if strategy_peak else None
    time_ratio = prediction.step_seconds / measured_step if measured_step else None
    run["ratios"] = {"predicted_peak/strategy_peak": memory_ratio, "predicted_step/measured_step": time_ratio}
    if allocator_peak:
        run["ratios"]["allocator_peak/strategy_peak"] = allocator_peak / strategy_peak
        run["ratios"]["predicted_peak/allocator_peak"] = prediction.peak_bytes / allocator_peak
        run["ratios"]["allocator_peak/device_bytes"] = allocator_peak / run["device_bytes"]
        out.expect(
            strategy_peak <= allocator_peak <= strategy_peak * (1 + ALLOCATOR_SLACK),
            f"{label}: the strategy's peak {_gib(strategy_peak)} is not the allocator's "
            f"{_gib(allocator_peak)} (expected equal, or up to {ALLOCATOR_SLACK:.0%} below it)",
        )
        out.expect(
            relative_gap(prediction.peak_bytes, allocator_peak) <= MEMORY_TOLERANCE,
            f"{label}: predicted peak {_gib(prediction.peak_bytes)} against the allocator's "
            f"{_gib(allocator_peak)} (x{prediction.peak_bytes / allocator_peak:.3f}; target within "
            f"{MEMORY_TOLERANCE:.0%})",
        )
    if memory_ratio is not None:
        out.expect(
            abs(memory_ratio - 1) <= MEMORY_TOLERANCE,
            f"{label}: predicted peak {_gib(prediction.peak_bytes)} against the strategy's measured "
            f"{_gib(strategy_peak)} (x{memory_ratio:.3f}; target within {MEMORY_TOLERANCE:.0%})",
        )
    if time_ratio is not None and ctx.cuda:
        out.expect(
            abs(time_ratio - 1) <= TIME_TOLERANCE,
            f"{label}: predicted step {prediction.step_seconds * 1e3:.1f} ms against measured "
            f"{measured_step * 1e3:.1f} ms (x{time_ratio:.3f}; target within {TIME_TOLERANCE:.0%}; prediction: "
            f"compute {prediction.compute_seconds * 1e3:.1f} ms, copies "
            f"{run['predicted']['copies_seconds'] * 1e3:.1f} ms, optimizer "
            f"{run['predicted']['optimizer_seconds'] * 1e3:.1f} ms, overhead "
            f"{run['predicted']['overhead_seconds'] * 1e3:.1f} ms)",
        )
    print(
        f"  {label}: {run['plan']}; peak strategy {_gib(strategy_peak)}, allocator {_gib(allocator_peak)}, "
        f"predicted {_gib(prediction.peak_bytes)} at {prediction.peak_at!r}; step measured "
        f"{measured_step * 1e3:.1f} ms, predicted {prediction.step_seconds * 1e3:.1f} ms",
        flush=True,
    )


def _gib(value: float | None) -> str:
    from lightning_osdp.budget import format_bytes

    return "n/a" if value is None else format_bytes(value)


def check_gpt124(ctx: Context) -> Outcome:
    """The example GPT at GPT-2 small's shape: measured and predicted peak memory and step time, per plan."""
    import torch

    from lightning_osdp import Plan
    from lightning_osdp.cost_model import predict
    from lightning_osdp.plan import default_units

    out = Outcome()
    shape = GPT_CUDA if ctx.cuda else GPT_CPU
    out.figures["shape"] = {**shape.model, "batch": shape.batch, "steps": shape.steps, "precision": shape.precision}
    if not ctx.cuda:
        out.notes.append("CPU dry run: a small GPT in 32-true; step times are not judged (a shared CPU)")
    runs: dict[str, Any] = {}
    # 1. The planner's own plan: the strategy profiles the model on this device and solves.
    try:
        runs["planner"], profile, plan = fit_gpt(ctx, shape, None, None)
    except Exception as error:
        out.failures.append(f"planner: training failed: {type(error).__name__}: {str(error).splitlines()[0]}")
        runs["planner"] = {"error": traceback.format_exc()[-2000:]}
        profile = plan = None
    if profile is not None and plan is not None:
        out.figures["profile"] = _profile_figures(profile)
        _judge_gpt(ctx, out, "planner", runs["planner"], predict(profile, plan, 1))
    # 2. Fixed plans, predicted from the same profile: FSDP2 everywhere, and half the blocks sharded.
    with torch.device("meta"):
        blocks = default_units(_gpt_class()(**shape.model))
    fixed = {
        "full_shard": {"": "full_shard", **{b: "full_shard" for b in blocks}},
        "mixed": {
            "": "no_shard",
            **{b: ("full_shard" if i < len(blocks) // 2 else "no_shard") for i, b in enumerate(blocks)},
        },
    }
    for name, decisions in fixed.items() if profile is not None else ():
        try:
            (run, _, _), _ = run_with_foreach_fallback(
                ctx, out, f"gpt/{name}", lambda fe, decisions=decisions: fit_gpt(ctx, shape, Plan(decisions), fe)
            )
        except Exception as error:
            out.failures.append(f"gpt/{name}: training failed: {type(error).__name__}: {str(error).splitlines()[0]}")
            runs[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            continue
        runs[name] = run
        _judge_gpt(ctx, out, name, run, predict(profile, Plan(decisions), 1))
    out.figures["runs"] = runs
    # 3. The dry run a user makes before renting the machine: data-sheet figures, fake tensors.
    out.figures["dry_run"] = dry = _dry_run(ctx, shape)
    if "error" not in dry and ctx.cuda and "error" not in runs["planner"]:
        measured = runs["planner"]
        dry["peak/allocator_peak"] = dry["predicted_peak_bytes"] / measured["allocator_peak_bytes"]
        dry["step/measured_step"] = dry["predicted_step_seconds"] / measured["strategy_step_seconds"]
        out.expect(
            abs(dry["peak/allocator_peak"] - 1) <= MEMORY_TOLERANCE,
            f"osdp plan --hardware h200-sxm predicts a peak of {_gib(dry['predicted_peak_bytes'])} against "
            f"{_gib(measured['allocator_peak_bytes'])} measured (x{dry['peak/allocator_peak']:.3f}; memory does not "
            "depend on the hardware figures)",
        )
        out.notes.append(
            f"dry run on the h200-sxm preset: step {dry['predicted_step_seconds'] * 1e3:.1f} ms predicted against "
            f"{measured['strategy_step_seconds'] * 1e3:.1f} ms measured (x{dry['step/measured_step']:.2f}); "
            "data-sheet figures are approximations, so this ratio is reported, not judged"
        )
    elif "error" in dry:
        out.failures.append(f"osdp plan --hardware h200-sxm failed: {dry['error'][:300]}")
    return out


def _dry_run(ctx: Context, shape: GPTShape) -> dict[str, Any]:
    """``osdp plan --hardware h200-sxm`` for the same model, batch and precision, in a fresh process."""
    plan_file = ctx.scratch / "dry_plan.json"
    args = [
        sys.executable,
        "-m",
        "lightning_osdp.cli",
        "plan",
        "--model",
        "examples/gpt/gpt.py:GPTModule",
        "--init-args",
        json.dumps({**shape.model, "lr_schedule": "constant"}),
        "--world-size",
        "1",
        "--hardware",
        "h200-sxm",
        "--batch-size",
        str(shape.batch),
        "--precision",
        shape.precision,
        "--no-search",
        "--out",
        str(plan_file),
    ]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240)
    print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n", flush=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip() or f"exit status {proc.returncode}"}
    info = json.loads(plan_file.read_text()).get("info", {})
    return {
        "command": " ".join(args[1:]),
        "seconds": time.perf_counter() - start,
        "predicted_peak_bytes": info["predicted_peak_bytes"],
        "predicted_step_seconds": info["predicted_step_seconds"],
    }


# ============================================================================================== hardware
def _seconds_per_call(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 3) -> float:
    """Mean seconds of ``fn`` over ``repeats`` back-to-back calls: CUDA events around the batch on CUDA (the host
    queues the calls ahead of the device, so launch latency hides behind the kernels, as in a training step),
    ``perf_counter`` on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats


def measure_rates(ctx: Context) -> dict[str, float]:
    """Matmul FLOP/s (bf16, fp32 without TF32, TF32) on square operands and memory bandwidth (a copy: bytes read
    plus written; a sum: bytes read) on large buffers."""
    import torch

    device = _torch_device(ctx)
    n = 8192 if ctx.cuda else 512
    rates: dict[str, float] = {}
    previous = torch.get_float32_matmul_precision()
    try:
        for label, dtype, precision in (
            ("bf16_matmul_flops", torch.bfloat16, "highest"),
            ("fp32_matmul_flops", torch.float32, "highest"),
            ("tf32_matmul_flops", torch.float32, "high"),
        ):
            if label == "tf32_matmul_flops" and not ctx.cuda:
                continue
            torch.set_float32_matmul_precision(precision)
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            c = torch.empty(n, n, device=device, dtype=dtype)
            repeats = 20 if dtype == torch.bfloat16 else 5
            rates[label] = 2.0 * n**3 / _seconds_per_call(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), device, repeats)
            del a, b, c
    finally:
        torch.set_float32_matmul_precision(previous)
    nbytes = (2 << 30) if ctx.cuda else (64 << 20)
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty_like(source)
    rates["copy_bytes_per_second"] = 2 * nbytes / _seconds_per_call(lambda: target.copy_(source), device, 10)
    rates["read_bytes_per_second"] = nbytes / _seconds_per_call(lambda: source.sum(), device, 10)
    return rates


def check_hardware(ctx: Context) -> Outcome:
    """Measured rates beside the h200-sxm preset's data-sheet figures and the rates a dry run uses."""
    import torch

    from lightning_osdp.cli.hardware import MATMUL_EFFICIENCY_FP32, MATMUL_EFFICIENCY_HALF, get_hardware
    from lightning_osdp.profiling import measure_copy_bandwidth, measure_device_rates

    out = Outcome()
    measured = measure_rates(ctx)
    out.figures["measured"] = measured
    device = _torch_device(ctx)
    own = {
        "bf16": measure_device_rates(device, torch.bfloat16).to_dict(),
        "fp32": measure_device_rates(device, torch.float32).to_dict(),
        "copy_bytes_per_second_64MiB": measure_copy_bandwidth(device, 64 << 20),
    }
    out.figures["lightning_osdp_measure_device_rates"] = own
    hw = get_hardware("h200-sxm")
    half, single = hw.figures(1, "bf16-mixed"), hw.figures(1, "32-true")
    out.figures["preset"] = {
        "name": hw.name,
        "gpu": hw.gpu,
        "source": hw.source,
        "data_sheet": {
            "bf16_matmul_flops": hw.half_flops,
            "fp32_matmul_flops": hw.fp32_flops,
            "memory_bytes_per_second": hw.memory_bytes_per_second,
            "memory_bytes": hw.memory_bytes,
        },
        "dry_run_uses": {
            "bf16_matmul_flops": half.rates.matmul_flops_per_second,
            "fp32_matmul_flops": single.rates.matmul_flops_per_second,
            "memory_bytes_per_second": half.rates.memory_bytes_per_second,
            "copy_bytes_per_second": half.copy_bytes_per_second,
        },
        "efficiencies": {"matmul_half": MATMUL_EFFICIENCY_HALF, "matmul_fp32": MATMUL_EFFICIENCY_FP32},
    }
    memory_used = half.rates.memory_bytes_per_second
    bf16_used, fp32_used = half.rates.matmul_flops_per_second, single.rates.matmul_flops_per_second
    # (figure, measured, data sheet, what a dry run on the preset uses, unit)
    rows = [
        ("bf16 matmul TFLOP/s", measured["bf16_matmul_flops"], hw.half_flops, bf16_used, 1e12),
        ("fp32 matmul TFLOP/s", measured["fp32_matmul_flops"], hw.fp32_flops, fp32_used, 1e12),
        ("DRAM GB/s (copy r+w)", measured["copy_bytes_per_second"], hw.memory_bytes_per_second, memory_used, 1e9),
        ("DRAM GB/s (read)", measured["read_bytes_per_second"], hw.memory_bytes_per_second, memory_used, 1e9),
    ]
    print(f"  {'figure':<22}{'measured':>12}{'data sheet':>12}{'dry run':>12}{'meas/dry':>10}", flush=True)
    for label, value, sheet, used, unit in rows:
        print(f"  {label:<22}{value / unit:>12.1f}{sheet / unit:>12.1f}{used / unit:>12.1f}{value / used:>10.2f}")
    if "tf32_matmul_flops" in measured:
        tf32 = measured["tf32_matmul_flops"] / 1e12
        print(f"  tf32 matmul TFLOP/s    {tf32:>12.1f}  (float32_matmul_precision 'high'; Lightning keeps 'highest')")
    print(
        f"  lightning_osdp.profiling.measure_device_rates: bf16 {own['bf16']['matmul_flops_per_second'] / 1e12:.1f} "
        f"TFLOP/s, fp32 {own['fp32']['matmul_flops_per_second'] / 1e12:.1f} TFLOP/s, memory "
        f"{own['bf16']['memory_bytes_per_second'] / 1e9:.1f} GB/s; measure_copy_bandwidth(64 MiB) "
        f"{own['copy_bytes_per_second_64MiB'] / 1e9:.1f} GB/s",
        flush=True,
    )
    if not ctx.cuda:
        out.notes.append("CPU dry run: rates of this CPU; the preset's figures are shown, not compared")
        return out
    name = torch.cuda.get_device_name(0)
    if "H200" not in name:
        out.notes.append(f"the device is {name!r}, not an H200: the h200-sxm preset does not describe it")
        return out
    for label, value, _, used, _ in rows[:3]:
        out.expect(
            abs(value / used - 1) <= RATE_TOLERANCE,
            f"{label}: measured {value:.4g} against the {used:.4g} a dry run on h200-sxm uses "
            f"(x{value / used:.2f}; within {RATE_TOLERANCE:.0%} expected)",
        )
    for dtype, key in (("bf16", "bf16_matmul_flops"), ("fp32", "fp32_matmul_flops")):
        ratio = own[dtype]["matmul_flops_per_second"] / measured[key]
        out.expect(
            ratio >= 1 - RATE_TOLERANCE,
            f"measure_device_rates (the estimated mode's benchmark) rates the {dtype} matmul at "
            f"{own[dtype]['matmul_flops_per_second'] / 1e12:.1f} TFLOP/s, x{ratio:.2f} of the large-operand rate: "
            "its operands (32 to 768 square) are launch-bound on this device",
        )
    return out


# ============================================================================================== checkpoint
def check_checkpoint(ctx: Context) -> Outcome:
    """Save a sharded checkpoint on the device at the end of epoch 0, resume it, consolidate it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_osdp import OSDPStrategy, Plan
    from lightning_osdp import checkpoint as ckpt

    from models import TinyGPT

    out = Outcome()
    recorder_module = _module_from(ROOT / "tests" / "distributed" / "checkpoint_runner.py", "osdp_checkpoint_runner")
    plan = recorder_module.PLANS["tied_split"]
    folder = ctx.scratch / "checkpoints"

    # 20 samples, 4 per batch: 5 steps per epoch, 2 epochs. The checkpoint is the end of epoch 0 (step 5): resumed
    # mid-epoch, Lightning would read the epoch's data from its start again (the loader keeps no state), and so would
    # a run stopped by max_steps rather than max_epochs (seen with Lightning 2.6.6 on CPU: after one batch the
    # resumed run starts a new epoch).
    def run(foreach: bool | None) -> dict[str, Any]:
        tag = f"foreach{foreach}"
        saver = ModelCheckpoint(folder / tag, filename="{epoch}", save_on_train_epoch_end=True, save_top_k=-1)
        whole_recorder = recorder_module.Recorder((5,))
        strategy = OSDPStrategy(plan=Plan(plan))
        _, model = fit_tiny(
            ctx, "32-true", strategy, foreach=foreach, max_epochs=2, callbacks=[saver, whole_recorder], samples=20
        )
        path = folder / tag / "epoch=0.ckpt"
        resumed_recorder = recorder_module.Recorder()
        strategy = OSDPStrategy(plan=Plan(plan))
        _, resumed_model = fit_tiny(
            ctx,
            "32-true",
            strategy,
            foreach=foreach,
            max_epochs=2,
            callbacks=[resumed_recorder],
            ckpt_path=path,
            samples=20,
        )
        return {
            "path": path,
            "foreach": foreach,
            "whole": {"losses": model.losses, "states": whole_recorder.states},
            "resumed": {"losses": resumed_model.losses, "states": resumed_recorder.states},
            "class": with_foreach(TinyGPT, foreach),
        }

    result, _ = run_with_foreach_fallback(ctx, out, "checkpoint (mixed plan)", run)
    path: Path = result["path"]
    whole, resumed = result["whole"], result["resumed"]
    out.figures["sharded"] = ckpt.is_sharded_checkpoint(path)
    out.expect(out.figures["sharded"], f"{path} is not a sharded checkpoint directory")
    if path.is_dir():
        out.figures["files"] = sorted(p.name for p in path.iterdir())
    # Resume: the losses after step 5, and the states at the restore and at the end.
    tail = whole["losses"][5:]
    out.figures["resume"] = gaps = {
        "steps_after_resume": len(resumed["losses"]),
        "loss_rel": max((relative_gap(a, b) for a, b in zip(resumed["losses"], tail, strict=False)), default=math.inf),
        "start_param_rel": max(
            tensor_gap(resumed["states"]["start"]["model"][k], v) for k, v in whole["states"][5]["model"].items()
        ),
        "end_param_rel": max(
            tensor_gap(resumed["states"]["end"]["model"][k], v) for k, v in whole["states"]["end"]["model"].items()
        ),
    }
    out.expect(len(resumed["losses"]) == len(tail), f"resumed run took {len(resumed['losses'])} steps, not {len(tail)}")
    out.expect(
        gaps["start_param_rel"] == 0.0,
        f"the parameters restored from the checkpoint differ from the saved ones by {gaps['start_param_rel']:.2e}",
    )
    out.expect(
        gaps["loss_rel"] <= PARITY_RTOL["32-true"] and gaps["end_param_rel"] <= PARITY_RTOL["32-true"],
        f"the resumed run ends {gaps['end_param_rel']:.2e} (parameters) and {gaps['loss_rel']:.2e} (losses) from the "
        f"uninterrupted one; tolerance {PARITY_RTOL['32-true']:.0e}",
    )
    # Consolidate in a fresh process without a process group, then load with plain Lightning.
    single = ctx.scratch / "consolidated.ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_osdp.checkpoint.consolidate", str(path), str(single)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out.figures["consolidate"] = {"returncode": proc.returncode, "stdout": proc.stdout.strip()[-300:]}
    if out.expect(proc.returncode == 0, f"consolidate failed: {proc.stderr.strip()[-500:]}"):
        loaded = result["class"].load_from_checkpoint(single, map_location="cpu")
        saved = whole["states"][5]["model"]
        state = loaded.state_dict()
        gap = max(tensor_gap(state[k], v) for k, v in saved.items())
        out.figures["consolidated_param_rel"] = gap
        out.expect(set(state) == set(saved), "the consolidated file's keys are not the model's own")
        out.expect(gap == 0.0, f"the consolidated parameters differ from the saved ones by {gap:.2e}")
    print(f"  resume {gaps}; consolidated {out.figures.get('consolidated_param_rel')}", flush=True)
    return out


# ============================================================================================== gloo2
def probe_collectives(device: Any) -> dict[str, str]:
    """The collectives FSDP2 and DDP issue, on ``device`` tensors over the default (gloo) group of 2 ranks: each
    ``"ok"``, ``"wrong: ..."`` or ``"error: ..."``."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    found: dict[str, str] = {}

    def attempt(name: str, fn: Callable[[], tuple[Any, Any]]) -> None:
        try:
            got, want = fn()
            found[name] = "ok" if torch.equal(got.cpu(), want) else f"wrong: {got.cpu().tolist()} != {want.tolist()}"
        except Exception as error:
            found[name] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"

    def all_reduce(op: Any) -> tuple[Any, Any]:
        t = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(t, op=op)
        total = world * (world + 1) / 2
        return t, torch.full((4,), total / world if op == dist.ReduceOp.AVG else total)

    def all_gather_into_tensor() -> tuple[Any, Any]:
        out = torch.empty(4 * world, device=device)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=device))
        return out, torch.arange(world, dtype=torch.float32).repeat_interleave(4)

    def reduce_scatter_tensor() -> tuple[Any, Any]:
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, torch.arange(2.0 * world, device=device) * (rank + 1), op=dist.ReduceOp.AVG)
        scale = sum(range(1, world + 1)) / world
        return out, torch.arange(2.0 * rank, 2.0 * rank + 2) * scale

    def broadcast() -> tuple[Any, Any]:
        t = torch.full((3,), float(rank), device=device)
        dist.broadcast(t, src=0)
        return t, torch.zeros(3)

    attempt("all_reduce_sum", lambda: all_reduce(dist.ReduceOp.SUM))
    attempt("all_reduce_avg", lambda: all_reduce(dist.ReduceOp.AVG))
    attempt("all_gather_into_tensor", all_gather_into_tensor)
    attempt("reduce_scatter_tensor_avg", reduce_scatter_tensor)
    attempt("broadcast", broadcast)
    dist.barrier()
    return found


def gloo2_worker(ctx: Context) -> None:
    """One of the two processes of ``gloo2`` (under torchrun, 2 agents of 1 process: ``LOCAL_RANK=0`` on both,
    so both train on ``cuda:0``). Writes ``scratch/gloo2.rank{R}.pt``."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_osdp import OSDPStrategy, Plan

    # The group Lightning's strategies then find and use, so that the probe runs on the same group.
    dist.init_process_group("gloo")
    device = _torch_device(ctx)
    if ctx.cuda:
        torch.cuda.set_device(device)
    rank = dist.get_rank()
    result: dict[str, Any] = {"probe": probe_collectives(device), "runs": {}, "failures": []}
    outcome = Outcome()

    def fit(name: str, foreach: bool | None) -> dict[str, Any]:
        strategy: Any
        if name == "ddp":
            strategy = DDPStrategy(process_group_backend="gloo")
        else:
            strategy = OSDPStrategy(plan=Plan(suite_plans()["mixed"]), process_group_backend="gloo")
        meter = make_callback_class()()
        trainer, model = fit_tiny(
            ctx, "32-true", strategy, foreach=foreach, callbacks=[meter], devices=1, num_nodes=2, max_steps=8
        )
        run = tiny_run(trainer, model)
        run.update(
            step_seconds=statistics.median(meter.seconds[2:]) if len(meter.seconds) > 2 else None,
            allocator_peak_bytes=max(meter.allocated) if meter.allocated else None,
            foreach=foreach,
        )
        return run

    # The mixed plan first: DDP then runs with the optimizer path it ended up with (see check_parity).
    foreach = device_default_foreach(ctx)
    try:
        result["runs"]["mixed"], foreach = run_with_foreach_fallback(
            ctx, outcome, "gloo2/mixed", lambda fe: fit("mixed", fe)
        )
    except Exception as error:
        result["failures"].append(f"gloo2/mixed: training failed: {type(error).__name__}: {str(error)[:300]}")
    try:
        result["runs"]["ddp"] = fit("ddp", foreach)
    except Exception as error:
        result["failures"].append(f"gloo2/ddp: training failed: {type(error).__name__}: {str(error)[:300]}")
    result["failures"] += outcome.failures
    torch.save(result, ctx.scratch / f"gloo2.rank{rank}.pt")


def check_gloo2(ctx: Context) -> Outcome:
    """Two processes on the one device over gloo: raw collectives on device tensors, then DDP against a mixed plan."""
    import socket

    import torch

    out = Outcome()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**fresh_world_env(), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(Path(__file__).resolve()),
                "--worker",
                "gloo2",
                "--device",
                ctx.device,
                "--scratch",
                str(ctx.scratch),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    outputs = []
    deadline = time.monotonic() + CHECKS["gloo2"].timeout - 20
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun passes it on to its workers, which run in sessions of their own (a SIGKILL of
            # the agent would leave them running).
            for a in agents:
                a.terminate()
            outputs.append(agent.communicate(timeout=30)[0] + "\n(timed out)")
    for node, text in enumerate(outputs):
        print(f"  --- agent {node} (last lines) ---\n" + "\n".join(text.splitlines()[-25:]), flush=True)
    out.figures["returncodes"] = [a.returncode for a in agents]
    results = []
    for rank in range(2):
        path = ctx.scratch / f"gloo2.rank{rank}.pt"
        if not path.exists():
            out.failures.append(f"rank {rank} wrote no result (agent exit status {agents[rank].returncode})")
            return out
        results.append(torch.load(path, weights_only=False))
    out.figures["collectives_on_" + ctx.device + "_over_gloo"] = results[0]["probe"]
    for name, status in results[0]["probe"].items():
        out.expect(status == "ok", f"{name} on {ctx.device} tensors over gloo: {status}")
    failures = {f for r in results for f in r["failures"]}
    out.failures += sorted(failures)
    runs = {}
    for rank, result in enumerate(results):
        if "mixed" not in result["runs"] or "ddp" not in result["runs"]:
            continue
        mixed, ddp = result["runs"]["mixed"], result["runs"]["ddp"]
        gaps = compare_runs(mixed, ddp) if rank == 0 else compare_runs({**mixed, "state": {}}, {**ddp, "state": {}})
        runs[f"rank{rank}"] = {
            **gaps,
            "rtol": PARITY_RTOL["32-true"],
            "foreach": mixed["foreach"],
            "step_seconds": {"ddp": ddp["step_seconds"], "mixed": mixed["step_seconds"]},
            "allocator_peak_bytes": {"ddp": ddp["allocator_peak_bytes"], "mixed": mixed["allocator_peak_bytes"]},
        }
        out.expect(
            gaps["loss_rel"] <= PARITY_RTOL["32-true"] and gaps["param_rel"] <= PARITY_RTOL["32-true"],
            f"rank {rank}: the mixed plan ends {gaps['param_rel']:.2e} (parameters) and {gaps['loss_rel']:.2e} "
            f"(losses) from DDP over gloo; tolerance {PARITY_RTOL['32-true']:.0e}",
        )
    out.figures["runs"] = runs
    print(f"  probe {results[0]['probe']}\n  runs {runs}", flush=True)
    return out


# ============================================================================================== the runner
@dataclass(frozen=True)
class CheckSpec:
    run: Callable[[Context], Outcome]
    timeout: float  # seconds, before the total budget clips it
    deterministic: bool = False  # CUBLAS_WORKSPACE_CONFIG for reproducible cuBLAS reductions


CHECKS: dict[str, CheckSpec] = {
    "env": CheckSpec(check_env, 60),
    "parity": CheckSpec(check_parity, 150, deterministic=True),
    "gpt124": CheckSpec(check_gpt124, 200),
    "hardware": CheckSpec(check_hardware, 90),
    "checkpoint": CheckSpec(check_checkpoint, 100, deterministic=True),
    "gloo2": CheckSpec(check_gloo2, 150, deterministic=True),
}


def run_one(name: str, ctx: Context, part: Path) -> int:
    """Run check ``name`` in this process; write its result to ``part`` (JSON)."""
    import warnings

    warnings.filterwarnings("ignore")
    began = time.perf_counter()
    try:
        outcome = CHECKS[name].run(ctx)
        status = "fail" if outcome.failures else "pass"
        result = {"status": status, "figures": outcome.figures, "failures": outcome.failures, "notes": outcome.notes}
    except Exception as error:
        result = {
            "status": "error",
            "failures": [f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"],
            "traceback": traceback.format_exc()[-4000:],
        }
        print(result["traceback"], flush=True)
    result["seconds"] = time.perf_counter() - began
    result["device"] = ctx.device
    part.write_text(json.dumps(result, indent=1, default=_jsonable))
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return repr(value)


#: What torch.distributed and Lightning read to join an existing world.
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def fresh_world_env() -> dict[str, str]:
    """This process's environment without the variables of a distributed world it may be in: each check starts a
    world of its own (a ``MASTER_PORT`` inherited from a caller that still listens on it would collide)."""
    return {k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES}


def _run_child(name: str, ctx: Context, part: Path, timeout: float) -> str | None:
    """Check ``name`` in a child process of its own session; ``None``, or why it has no result."""
    env = dict(fresh_world_env(), PYTHONUNBUFFERED="1")
    if CHECKS[name].deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    args = [sys.executable, str(Path(__file__).resolve()), "--check", name, "--part", str(part)]
    args += ["--device", ctx.device, "--scratch", str(ctx.scratch)]
    child = subprocess.Popen(args, cwd=ROOT, env=env, start_new_session=True)
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The check and everything it started: SIGTERM first, which torchrun agents pass on to their workers (in
        # sessions of their own, out of reach of this group), then SIGKILL.
        os.killpg(child.pid, signal.SIGTERM)
        _wait_for_group(child.pid, 15.0)
        with suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return f"timed out after {timeout:.0f} s"
    finally:
        with suppress(ProcessLookupError):  # a check's leftovers (a worker that outlived its agent)
            os.killpg(child.pid, signal.SIGKILL)
    if not part.exists():
        return f"exited with status {child.returncode} without a result"
    return None


def _wait_for_group(group: int, seconds: float) -> None:
    """Wait until no process of process group ``group`` is left, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        with suppress(ChildProcessError):
            os.waitpid(-group, os.WNOHANG)  # reap our own child, which would otherwise linger as a zombie
        time.sleep(0.2)


def run_all(
    out_dir: Path, device: str, names: list[str], budget: float, *, min_seconds: float = MIN_CHECK_SECONDS
) -> int:
    """Every check in ``names``, each in its own process, within ``budget`` seconds (a check is not started with
    less than ``min_seconds`` left); writes ``out_dir/gpu_check.json`` after each one. Returns the exit status (see
    the module docstring)."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "gpu_check.json"
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device,
        "dry_run": device == "cpu",
        "budget_seconds": budget,
        "checks": {},
    }
    if device == "cuda" and not torch.cuda.is_available():
        report["status"] = "no CUDA device"
        report["message"] = (
            f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no CUDA device: nothing was checked. "
            "On a GPU machine, check nvidia-smi and that torch is a CUDA build; for a dry run of the checks on the "
            "CPU, pass --device cpu (gpu_check.sh: GPU_CHECK_DEVICE=cpu)."
        )
        report_path.write_text(json.dumps(report, indent=1))
        print(f"gpu_check: {report['message']}", flush=True)
        return 3
    deadline = time.monotonic() + budget
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        for name in names:
            remaining = deadline - time.monotonic()
            timeout = min(CHECKS[name].timeout, remaining)
            print(
                f"\n===== {name} ({'dry run on the CPU' if device == 'cpu' else device}, up to {timeout:.0f} s)",
                flush=True,
            )
            if timeout < min_seconds:
                report["checks"][name] = {"status": "skipped", "failures": [f"out of time budget ({budget:.0f} s)"]}
            else:
                scratch = Path(tmp) / name
                scratch.mkdir()
                part = Path(tmp) / f"{name}.json"
                began = time.perf_counter()
                why = _run_child(name, Context(device, scratch), part, timeout)
                if why is None:
                    report["checks"][name] = json.loads(part.read_text())
                else:
                    status = "timeout" if why.startswith("timed out") else "error"
                    report["checks"][name] = {
                        "status": status,
                        "failures": [why],
                        "seconds": time.perf_counter() - began,
                    }
            result = report["checks"][name]
            print(
                f"===== {name}: {result['status'].upper()}" + "".join(f"\n  - {f}" for f in result["failures"]),
                flush=True,
            )
            report_path.write_text(json.dumps(report, indent=1, default=_jsonable))
    statuses = {name: r["status"] for name, r in report["checks"].items()}
    report["status"] = "pass" if all(s == "pass" for s in statuses.values()) else "fail"
    report_path.write_text(json.dumps(report, indent=1, default=_jsonable))
    print("\n===== summary")
    for name, result in report["checks"].items():
        print(
            f"  {name:<11} {result['status']:<8} {result.get('seconds', 0):7.1f} s  {len(result['failures'])} failures"
        )
    print(f"gpu_check: {report['status']}; figures in {report_path}", flush=True)
    return 0 if report["status"] == "pass" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where gpu_check.json goes")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of the checks")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all checks together")
    parser.add_argument("--check", choices=list(CHECKS), help=argparse.SUPPRESS)  # one check, in this process
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["gloo2"], help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        gloo2_worker(Context(args.device, args.scratch))
        from clean_exit import finish

        finish()
    if args.check:
        return run_one(args.check, Context(args.device, args.scratch), args.part)
    if args.out is None:
        parser.error("--out DIR is required")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    return run_all(args.out, args.device, names, args.budget)


if __name__ == "__main__":
    sys.exit(main())
