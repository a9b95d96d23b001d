"""The dry run against every published FSDP/HSDP run of ``benchmarks/published_runs.json``, calibrated and checked
leave-one-source-out.

For each published run this builds the model of its shape on the meta device (``examples/llama``'s Llama for Llama
shapes, ``examples/gpt``'s GPT for MosaicML's MPT, whose blocks are GPT's: LayerNorm, a GELU MLP of 4x, a tied
embedding, learned positions), profiles it on fake tensors with the built-in figures of its GPU and network, as
``osdp plan`` does (``cli.estimate.estimated_profile``), and predicts the published configuration's fixed plan
(every block and the root in the published sharding mode, every block recomputed as published; no solve) with the
cost model (``cost_model.predict``). The prediction per GPU is the published micro-batch's tokens over the
micro-batch's step, the optimizer's step spread over the accumulation steps. What a row says beyond a plan is modelled
here: its attention kernel (``hardware.py``'s ``ATTENTION_KERNEL_SPEED``), torchtitan's selective policy
(:func:`_with_published_policy`), the fused kernels it runs ([Note: fused kernels]), how it accumulates gradients
([Note: accumulation as the source runs it]) and the precision of its loss.

Calibration. The calibrated constants are ``TRAINING_MATMUL_EFFICIENCY`` (``lightning_osdp/cli/hardware.py`` [Note: a
training step is not a microbenchmark]): the share of the published matmul and attention ceilings a training step
reaches, one per GPU generation (Hopper, Ampere). Every profile time is ``a + b / efficiency`` (operators' latency and
memory-bound work, plus FLOPs at the rate), so each run is traced twice (at efficiency 1 and 1/2) and its profile at
any other efficiency follows exactly, as ``cli.estimate.BatchScaledProfile`` does for the batch size (up to operators
that change sides of the roofline between the two, whose bytes are small). The cost model is run exactly at efficiency
1 and 0.6 and linearly interpolated in ``1 / efficiency`` between them to search the grid (the script prints how far
that is from the exact prediction at the chosen values); every figure in the tables is exact. Each generation's
efficiency is the grid value with the least mean absolute log error of throughput over the calibrating runs on that
generation, each source one vote ([Note: one vote per source]; ``--weight-by run``: each run one vote, the earlier
estimator); the script prints each source's own value beside it. "all" calibrates on every eager run, "held out"
predicts each source's runs with the values calibrated on the other sources' eager runs only. Runs whose step was
compiled (torch.compile) or hand-fused are predicted with their fused kernels ([Note: fused kernels]) and reported but
not calibrated on: ``osdp plan`` traces a model's eager step, so its constants are fitted where that trace is the
step. ``--calibrate-memory`` adds the memory-bound operators' share of the DRAM bandwidth (``MEMORY_EFFICIENCY``, else
kept at its assumed value), traced a third time at half of it and interpolated bilinearly.

Memory. Beside the allocated peak, the reserved peak and the device total of ``cost_model/device_memory.py``, and
whether the run fits its card on the device total; a published memory figure is compared with the quantity it is (the
``memory_kind`` of its row).

Run from the repository root: ``python benchmarks/calibration.py`` (two traces and a few predictions per run: 1 to
5 minutes on 2 busy cores; ``--only ID,ID`` for the runs whose id contains one of them); ``--out
FILE`` writes the rows as JSON. It prints the markdown tables that docs/benchmarks.md keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
import unittest.mock
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "llama"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from lightning_osdp.cli.estimate import estimated_profile
from lightning_osdp.cli.hardware import (
    ATTENTION_KERNEL_SPEED,
    MEMORY_EFFICIENCY,
    TRAINING_MATMUL_EFFICIENCY,
    HardwareFigures,
    get_hardware,
    get_network,
)
from lightning_osdp.cost_model import predict
from lightning_osdp.cost_model.device_memory import DeviceMemory, plan_device_memory
from lightning_osdp.options import BF16_POLICY
from lightning_osdp.plan import Plan
from lightning_osdp.profiling import ModelProfile

from llama import apply_rotary as _EAGER_ROTARY

RUNS_FILE = Path(__file__).resolve().with_name("published_runs.json")
GIB = 2**30
#: The values the calibration chooses among: matmul and attention's share of their published ceilings, and the
#: memory-bound operators' share of the DRAM bandwidth.
MATMUL_GRID = tuple(round(0.60 + 0.025 * i, 3) for i in range(17))  # 0.60 .. 1.00
#: With ``--calibrate-memory`` only (see the module docstring); otherwise memory stays at MEMORY_EFFICIENCY.
MEMORY_GRID = tuple(round(0.30 + 0.05 * i, 2) for i in range(13))  # 0.30 .. 0.90
#: The corners each run is predicted at exactly; the grid between them is interpolated (see the module docstring).
MATMUL_CORNERS = (1.0, 0.6)
MEMORY_CORNERS = (MEMORY_EFFICIENCY, 0.3)
_SHARDINGS = ("full_shard", "hybrid_shard", "shard_grad_op")
_RECOMPUTE = ("none", "selective", "full")
_PRECISIONS = ("bf16-fsdp", "bf16-mixed", "bf16-true")
_MODELS = ("llama", "gpt")
#: How the published step ran: the dry run traces the eager step, so only ``"eager"`` runs calibrate it.
_STEPS = ("eager", "torch.compile", "fused kernels")
#: Which operators a run's selective recomputation keeps (see :func:`_with_published_policy`).
_SELECTIVE_POLICIES = ("osdp", "torchtitan")
#: How a run accumulates gradients over its micro-batches (see [Note: accumulation as the source runs it]).
_ACCUMULATIONS = ("reduce_each", "no_sync")
#: The gradients' reduction dtype where it differs from the parameters' (``reduce_dtype`` of a row).
_REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: torchtitan's policy recomputes every second ``mm`` of a block: in its Llama's call order (``wq``, ``wk``, ``wv``,
#: ``wo``, ``w1``, ``w3``, ``w2``) the 2nd, 4th and 6th.
_TORCHTITAN_RECOMPUTED = ("attention.wk", "attention.wo", "feed_forward.w3")
_REQUIRED = (
    "id", "source", "citation", "model", "shape", "hardware", "nodes", "gpus_per_node", "micro_batch", "grad_accum",
    "seq_len", "precision", "recompute", "sharding", "step", "tokens_per_second_per_gpu",
)  # fmt: skip


@dataclass(frozen=True)
class PublishedRun:
    """One row of ``published_runs.json`` (see its fields there; ``tokens_per_second_per_gpu`` as published)."""

    id: str
    source: str
    citation: str
    model: str
    shape: dict[str, Any]
    hardware: str
    nodes: int
    gpus_per_node: int
    micro_batch: int
    grad_accum: int
    seq_len: int
    precision: str
    recompute: str
    sharding: str
    step: str
    tokens_per_second_per_gpu: float
    network: str | None = None
    mfu: float | None = None
    mfu_convention: str | None = None
    memory_gib: float | None = None
    memory_kind: str | None = None
    attention: str = "flash-attention-2"
    selective_policy: str = "osdp"
    fused: tuple[str, ...] = ()
    accumulation: str = "reduce_each"
    reduce_dtype: str | None = None
    loss_precision: str = "float32"
    recompute_stops_early: bool = True
    notes: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def calibrates(self) -> bool:
        """Whether the run's step is the eager step ``osdp plan`` traces (compiled or hand-fused steps are predicted
        with their fused kernels and reported, not calibrated on)."""
        return self.step == "eager"


def load_runs(path: Path = RUNS_FILE) -> list[PublishedRun]:
    """The published runs of ``path``, checked: every required field, known values, a citation per row."""
    data = json.loads(Path(path).read_text())
    runs = []
    for i, raw in enumerate(data["runs"]):
        missing = [k for k in _REQUIRED if raw.get(k) in (None, "")]
        if missing:
            raise ValueError(f"{path}: run {i} ({raw.get('id', '?')}) lacks {', '.join(missing)}")
        run = PublishedRun(**{**raw, "fused": tuple(raw.get("fused", ()))})
        for field, value, known in (
            ("model", run.model, _MODELS),
            ("sharding", run.sharding, _SHARDINGS),
            ("recompute", run.recompute, _RECOMPUTE),
            ("precision", run.precision, _PRECISIONS),
            ("step", run.step, _STEPS),
            ("attention", run.attention, tuple(ATTENTION_KERNEL_SPEED)),
            ("selective_policy", run.selective_policy, _SELECTIVE_POLICIES),
            ("accumulation", run.accumulation, _ACCUMULATIONS),
            ("reduce_dtype", run.reduce_dtype, (None, *_REDUCE_DTYPES)),
            ("loss_precision", run.loss_precision, ("float32", "logits")),
        ):
            if value not in known:
                raise ValueError(f"{path}: run {run.id}: {field} {value!r} is not one of {', '.join(known)}")
        unknown = [k for k in run.fused if k not in _FUSED_KERNELS or (k in _LLAMA_ONLY and run.model != "llama")]
        if unknown:
            raise ValueError(
                f"{path}: run {run.id}: fused kernels {unknown} are not modelled (known: {', '.join(_FUSED_KERNELS)}; "
                f"{', '.join(_LLAMA_ONLY)} for Llama only)"
            )
        if not isinstance(run.recompute_stops_early, bool):
            raise ValueError(f"{path}: run {run.id}: recompute_stops_early must be true or false")
        if run.reduce_dtype is not None and run.precision == "bf16-mixed":
            raise ValueError(f"{path}: run {run.id}: reduce_dtype is for FSDP's policies (bf16-fsdp, bf16-true)")
        if run.attention == "cudnn" and generation(run) != "hopper":
            raise ValueError(f"{path}: run {run.id}: cuDNN's attention speed is measured on Hopper only")
        if run.shape.get("context_length") != run.seq_len:
            raise ValueError(f"{path}: run {run.id}: shape's context_length differs from seq_len {run.seq_len}")
        if run.tokens_per_second_per_gpu <= 0 or run.micro_batch < 1 or run.grad_accum < 1:
            raise ValueError(f"{path}: run {run.id}: throughput, micro_batch and grad_accum must be positive")
        runs.append(run)
    ids = [r.id for r in runs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate run ids")
    return runs


def build_model(run: PublishedRun) -> torch.nn.Module:
    """The run's model on the meta device (its parameters in bf16 under ``bf16-true``), with the run's fused kernels
    (see :data:`_FUSED_KERNELS`)."""
    with torch.device("meta"):
        if run.model == "llama":
            from llama import FeedForward, LlamaModule, RMSNorm

            module: torch.nn.Module = LlamaModule(**run.shape)
            for sub in module.modules():
                if "rmsnorm" in run.fused and isinstance(sub, RMSNorm):
                    sub.forward = functools.partial(_fused_rms_norm_forward, sub)  # type: ignore[method-assign]
                if "swiglu" in run.fused and isinstance(sub, FeedForward):
                    sub.forward = functools.partial(_fused_swiglu_forward, sub)  # type: ignore[method-assign]
            if "cross_entropy" in run.fused:
                module._loss = functools.partial(_loss_with_fused_cross_entropy, module)  # type: ignore[method-assign]
            elif run.loss_precision == "logits":
                module._loss = functools.partial(_loss_in_the_logits_dtype, module)  # type: ignore[method-assign]
        else:
            from gpt import GPTModule

            module = GPTModule(**run.shape)
            if "cross_entropy" in run.fused:
                module._step = functools.partial(_step_with_fused_cross_entropy, module)  # type: ignore[method-assign]
    return _precision_plugin(run).convert_module(module) if run.precision == "bf16-true" else module


# [Note: fused kernels]
# Some published runs replace the reference model's eager operators by fused kernels (the row's ``fused``): torchtitan's
# 2024 A100 runs normalise with its Triton ``fused_rmsnorm`` (``norm_type = "fused_rmsnorm"`` in
# ``train_configs/llama_13b.toml`` and ``llama3_8b.toml`` of the commits that published them); TinyLlama with
# flash-attn's fused RMSNorm, rotary and cross-entropy and xformers' SwiGLU (``lit_gpt/config.py`` ``tiny_LLaMA_1b``:
# ``_norm_class="FusedRMSNorm"``, ``_mlp_class="LLaMAMLP"`` whose forward is ``xformers.ops.SwiGLU``;
# ``lit_gpt/model.py`` ``apply_rotary_emb_func``, flash-attn's rotary; ``pretrain/tinyllama.py``
# ``FusedCrossEntropyLoss``); llm-foundry's MPT with flash-attn's cross-entropy (its default ``loss_fn:
# fused_crossentropy``). A compiled step fuses the same chains (KempnerForge's ``torch.compile(model)``, see the runs'
# notes): Inductor emits one kernel for the pointwise and reduction operators between two matrix products, so the
# RMSNorm, the rotary embedding and SwiGLU's ``silu(a) * b`` each become one kernel, as the hand-written ones are
# (PyTorch 2 paper, Ansel et al., ASPLOS 2024, section 4: "fusion of pointwise, reduction and scatter operators").
#
# Such a kernel changes two things the dry run must see. What it keeps for backward: a fused RMSNorm keeps its input
# and one fp32 inverse root per row, where the eager ``examples/llama`` RMSNorm keeps the fp32 copy of its input and
# the fp32 normalised values (autograd's saved tensors of ``float``, ``pow``, ``mul``); a fused cross-entropy keeps the
# logits as they are and one log-sum-exp per row, where the eager loss keeps the fp32 logits and their log-softmax; a
# fused rotary keeps nothing of its input (its backward is the rotation by the opposite angle); fused SwiGLU keeps its
# two inputs. And its time: the eager operators each read their inputs from and write their outputs to the device's
# memory (the reference RMSNorm: six passes over the activation, four of them over fp32 values), where the fused
# kernel reads its inputs and writes its outputs once. So each fused kernel is an operator of its own
# (``torch.library.custom_op``), forward and backward, with autograd saving what the kernel saves: the tracer
# charges an operator without a FLOP formula at the bytes of its tensor arguments and results
# (``profiling/tracer.py``), which for a fused kernel is exactly one pass over its inputs and outputs at the memory
# rate. The eager operators inside each one give the values on real tensors (``tests/test_calibration.py`` checks them
# and their gradients against the reference model's operators).
_FUSED_KERNELS = ("rmsnorm", "cross_entropy", "rotary", "swiglu")
_LLAMA_ONLY = ("rmsnorm", "rotary", "swiglu")


@torch.library.custom_op("osdp_calibration::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * rstd).type_as(x) * weight, rstd


@_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("osdp_calibration::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    normed = x.float() * rstd
    grad_weight = (grad.float() * normed.type_as(x).float()).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
    g = grad.float() * weight.float()
    grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
    return grad_x.type_as(x), grad_weight


@_rms_norm_backward.register_fake
def _(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx: Any, grad: torch.Tensor, _grad_rstd: torch.Tensor) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    return (*_rms_norm_backward(grad, x, weight, rstd), None)


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``examples/llama``'s RMSNorm as one fused kernel (see [Note: fused kernels])."""
    return _rms_norm(x, weight, eps)[0]


@torch.library.custom_op("osdp_calibration::cross_entropy", mutates_args=())
def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(logits.float(), dim=-1)
    return lse - logits.gather(-1, targets[:, None]).squeeze(-1).float(), lse


@_cross_entropy.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return rows, torch.empty_like(rows)


@torch.library.custom_op("osdp_calibration::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(
    grad: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    # flash-attn's kernel writes the gradient in the logits' dtype, with no float32 copy of them: a new tensor here
    # (its default), where TinyLlama's ``inplace_backward=True`` writes over the logits (a little less memory).
    probabilities = torch.exp(logits.float() - lse[:, None])
    probabilities.scatter_add_(-1, targets[:, None], torch.full_like(probabilities[:, :1], -1.0))
    return (probabilities * grad[:, None]).to(logits.dtype)


@_cross_entropy_backward.register_fake
def _(grad: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(logits)


def _cross_entropy_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits, targets = inputs
    ctx.save_for_backward(logits, output[1], targets)


def _cross_entropy_grad(ctx: Any, grad: torch.Tensor, _grad_lse: torch.Tensor) -> tuple[Any, ...]:
    logits, lse, targets = ctx.saved_tensors
    return _cross_entropy_backward(grad, logits, lse, targets), None


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


def fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (rows) against ``targets`` as one fused kernel (see [Note: fused kernels])."""
    return _cross_entropy(logits, targets)[0].mean()


@torch.library.custom_op("osdp_calibration::rotary", mutates_args=())
def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _EAGER_ROTARY(x, cos, sin)


@_rotary.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _rotary_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _rotary_grad(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    cos, sin = ctx.saved_tensors
    return _rotary(grad, cos, -sin), None, None


_rotary.register_autograd(_rotary_grad, setup_context=_rotary_setup)


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``examples/llama``'s ``apply_rotary`` as one fused kernel (see [Note: fused kernels])."""
    return _rotary(x, cos, sin)


@torch.library.custom_op("osdp_calibration::swiglu", mutates_args=())
def _swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(a) * b


@_swiglu.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(a)


@torch.library.custom_op("osdp_calibration::swiglu_backward", mutates_args=())
def _swiglu_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = a.float()
    sigmoid = torch.sigmoid(h)
    silu = h * sigmoid
    grad_a = grad.float() * b.float() * sigmoid * (1 + h * (1 - sigmoid))
    return grad_a.type_as(a), (grad.float() * silu).type_as(b)


@_swiglu_backward.register_fake
def _(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(a), torch.empty_like(b)


def _swiglu_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = ctx.saved_tensors
    return _swiglu_backward(grad, a, b)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def fused_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` as one fused kernel (see [Note: fused kernels])."""
    return _swiglu(a, b)


def _fused_rms_norm_forward(norm: Any, x: torch.Tensor) -> torch.Tensor:
    return fused_rms_norm(x, norm.weight, norm.eps)


def _fused_swiglu_forward(ffn: Any, x: torch.Tensor) -> torch.Tensor:
    return ffn.w2(fused_swiglu(ffn.w1(x), ffn.w3(x)))


def _step_with_fused_cross_entropy(module: Any, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``examples/gpt``'s step (``GPTModule._step``: loss, logits, targets) with the fused cross-entropy."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = module(inputs)
    return fused_cross_entropy(logits.flatten(0, 1), targets.flatten()), logits, targets


def _loss_with_fused_cross_entropy(module: Any, batch: torch.Tensor) -> torch.Tensor:
    """``examples/llama``'s loss (``LlamaModule._loss``) with the fused cross-entropy."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = module(inputs)
    return fused_cross_entropy(logits.flatten(0, 1), targets.flatten())


def _loss_in_the_logits_dtype(module: Any, batch: torch.Tensor) -> torch.Tensor:
    """``examples/llama``'s loss without its float32 copy of the logits (``loss_precision: logits``): the
    cross-entropy of the logits as the model returns them, as KempnerForge's ``scripts/train.py`` computes it
    (``F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))`` on a bf16 model's logits)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    return torch.nn.functional.cross_entropy(module(inputs).flatten(0, 1), targets.flatten())


def _precision_plugin(run: PublishedRun) -> Any:
    """Lightning's plugin of the run's precision: autocast over fp32 parameters (under FSDP2's bf16 policy for
    ``bf16-fsdp``), or bf16 parameters throughout (``bf16-true``)."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    return HalfPrecision("bf16-true") if run.precision == "bf16-true" else MixedPrecision("bf16-mixed", "cpu")


def figures_of(
    run: PublishedRun, efficiency: float | None = None, memory: float = MEMORY_EFFICIENCY
) -> HardwareFigures:
    """The built-in figures of the run's GPUs, nodes and network, matmuls at ``efficiency`` of their ceilings (default:
    the code's for the GPU's generation) and memory-bound operators at ``memory`` of the DRAM bandwidth, attention on
    the run's kernel."""
    network = get_network(run.network) if run.network else None
    hardware = get_hardware(run.hardware)
    return hardware.figures(
        run.world_size,
        "bf16-mixed",
        nodes=run.nodes,
        network=network,
        training_efficiency=efficiency,
        memory_efficiency=memory,
        attention_kernel=run.attention,
    )


def trace(run: PublishedRun, module: torch.nn.Module, efficiency: float, memory: float) -> ModelProfile:
    """The estimated profile of one micro-batch of ``run`` at these rates, with the figures' two network levels."""
    figures = figures_of(run, efficiency, memory)
    batch = torch.zeros((run.micro_batch, run.seq_len + 1), dtype=torch.int64, device="meta")
    with _rotary_of(run):
        profile = _traced(run, module, batch, figures)
    if run.accumulation == "no_sync" and run.grad_accum > 1:
        profile = _accumulating_without_sync(run, profile)
    if run.recompute == "selective" and run.selective_policy == "torchtitan":
        profile = _with_published_policy(run, module, profile, figures.rates)
    if not run.recompute_stops_early:
        profile = _replaying_whole_forward(profile)
    return profile


def _replaying_whole_forward(profile: ModelProfile) -> ModelProfile:
    """``profile`` as a recomputation that runs the block's whole forward again prices it: torch before 2.1, whose
    non-reentrant checkpoint had no early stop, or a reentrant one (``lightning_osdp/profiling/replay.py`` [Note: the
    recomputation stops at the last saved tensor])."""
    modules = {n: dataclasses.replace(m, recompute_replay_seconds=None) for n, m in profile.modules.items()}
    return dataclasses.replace(profile, modules=modules)


def _rotary_of(run: PublishedRun) -> contextlib.AbstractContextManager[Any]:
    """``examples/llama``'s attention with the fused rotary kernel while tracing a run that has it."""
    if "rotary" not in run.fused:
        return contextlib.nullcontext()
    import llama

    return unittest.mock.patch.object(llama, "apply_rotary", fused_rotary)


def _traced(run: PublishedRun, module: torch.nn.Module, batch: torch.Tensor, figures: HardwareFigures) -> ModelProfile:
    return estimated_profile(
        module,
        batch,
        figures,
        optimizer=torch.optim.AdamW,
        step_context=_precision_plugin(run).train_step_context,
        mixed_precision=_policy(run),
        world_size=run.world_size,
    )


def _policy(run: PublishedRun) -> MixedPrecisionPolicy | None:
    """FSDP2's mixed-precision policy of the run: bf16 compute with gradients reduced in the row's ``reduce_dtype``
    where it has one (KempnerForge's ``default_mp_policy`` over bf16 parameters, float32; Fabric's FSDP ``bf16-mixed``
    over fp32 parameters, bfloat16), else OSDP's bf16 policy (float32 reductions) over fp32 parameters
    (``bf16-fsdp``), else none."""
    if run.reduce_dtype is not None:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=_REDUCE_DTYPES[run.reduce_dtype])
    return BF16_POLICY if run.precision == "bf16-fsdp" else None


# [Note: accumulation as the source runs it]
# Two sources accumulate gradients differently. Composer (llm-foundry) runs FSDP1 with gradients reduced every
# micro-batch (its tables' rows say so): a micro-batch is predicted as a step of its own, the optimizer's step spread
# over the accumulation (``accumulation: reduce_each``, the default). KempnerForge skips the reduction on all but the
# last micro-batch (``kempnerforge/training/grad.py`` ``maybe_no_sync`` at 01b461a: FSDP2's
# ``set_requires_gradient_sync(False)``), so every GPU keeps the *unsharded* gradient of the whole model from the first
# micro-batch's backward to the last one's and reduce-scatters it once (``accumulation: no_sync``): this is OSDP's own
# accumulation (``cost_model/timeline.py`` [Note: gradient accumulation]), so the whole step is predicted with the
# profile's ``gradient_accumulation`` and divided by its micro-batches. What FSDP2 keeps is in the policy's
# ``reduce_dtype``: after a backward without sync ``FSDPParam.to_accumulated_grad_if_needed`` (torch
# ``distributed/fsdp/_fully_shard/_fsdp_param.py``) replaces the bf16 gradient by a ``reduce_dtype`` copy, and
# KempnerForge's policy reduces in float32 over bf16 parameters (``default_mp_policy``), so the held gradient is 4
# bytes a parameter where the cost model counts the parameters' dtype (``ModuleProfile.grad_bytes``, which in the cost
# model sizes only the held gradients): those bytes are scaled by the two dtypes' ratio here. For the 8B over 4 GPUs
# that is 29.9 GiB a GPU the first calibration did not see (published 61.1 GiB allocated against 41.6 predicted).
# TinyLlama accumulates under Fabric's ``no_backward_sync`` (``pretrain/tinyllama.py``), FSDP1's ``no_sync``, which
# holds the unsharded gradients in the policy's dtype (Fabric's FSDP ``bf16-mixed``: bf16 parameters, reductions and
# buffers, so ``reduce_dtype: bfloat16``) over fp32 parameters: half the stored gradient bytes.
def _accumulating_without_sync(run: PublishedRun, profile: ModelProfile) -> ModelProfile:
    """``profile`` as ``run`` accumulates without sync (see [Note: accumulation as the source runs it])."""
    ratio = 1.0  # grad_bytes are of the stored parameters (bf16 under bf16-true, fp32 otherwise)
    if run.reduce_dtype is not None:
        stored = torch.bfloat16 if run.precision == "bf16-true" else torch.float32
        ratio = _REDUCE_DTYPES[run.reduce_dtype].itemsize / stored.itemsize
    modules = {n: dataclasses.replace(m, grad_bytes=round(m.grad_bytes * ratio)) for n, m in profile.modules.items()}
    return dataclasses.replace(profile, modules=modules, gradient_accumulation=run.grad_accum)


def _with_published_policy(
    run: PublishedRun, module: torch.nn.Module, profile: ModelProfile, rates: Any
) -> ModelProfile:
    """``profile`` with each block's selective figures moved from OSDP's policy (every matrix product's output kept,
    ``apply/recompute.py`` [Note: selective recomputation]) to torchtitan's, which its published runs use: the outputs
    of the 2nd, 4th and 6th ``mm`` (``wk``, ``wo``, ``w3``) are not kept (bf16, one value per output feature and
    token) and their products run again in the replay, at the rates' price of their shapes."""
    from lightning_osdp.profiling.tracer import ComputeKernel

    tokens = run.micro_batch * run.seq_len
    modules = dict(profile.modules)
    for name, figures in profile.modules.items():
        if figures.selective_kept_bytes is None or figures.selective_replay_seconds is None:
            continue
        dropped, seconds = 0, 0.0
        for linear_name in _TORCHTITAN_RECOMPUTED:
            linear = module.get_submodule(f"{name}.{linear_name}")
            assert isinstance(linear, torch.nn.Linear), f"{name}.{linear_name}"
            out_bytes = 2 * tokens * linear.out_features
            flops = 2 * tokens * linear.in_features * linear.out_features
            operand_bytes = 2 * (tokens * linear.in_features + linear.in_features * linear.out_features) + out_bytes
            dropped += out_bytes
            seconds += rates.matmul_op_seconds + rates.kernel_seconds(ComputeKernel("matmul", flops, operand_bytes))
        modules[name] = dataclasses.replace(
            figures,
            selective_kept_bytes=figures.selective_kept_bytes - dropped,
            selective_replay_seconds=figures.selective_replay_seconds + seconds,
        )
    return dataclasses.replace(profile, modules=modules)


@dataclass
class TracedRun:
    """A run's model and its profiles at three points of the rates, from which :meth:`profile` gives any other."""

    run: PublishedRun
    module: torch.nn.Module
    base: ModelProfile  # matmuls at MATMUL_CORNERS[0], memory at MEMORY_CORNERS[0]
    slower_matmuls: ModelProfile  # matmuls at half the base rate
    slower_memory: ModelProfile | None  # memory-bound operators at half the base rate (None: memory not varied)
    seconds: float

    def profile(self, efficiency: float, memory: float) -> ModelProfile:
        """The profile at these rates: every time is ``a + b / efficiency + c / memory`` (see the module docstring)."""
        x = MATMUL_CORNERS[0] / efficiency - 1.0  # 0 at the base, 1 at half its rate
        y = MEMORY_CORNERS[0] / memory - 1.0
        slower_memory = self.slower_memory
        if slower_memory is None:
            if y:
                raise ValueError(f"{self.run.id} was traced at memory {MEMORY_CORNERS[0]} only, not {memory}")
            slower_memory = self.base
        modules = {}
        for name, m in self.base.modules.items():
            dx = _delta(m, self.slower_matmuls.modules[name])
            dy = _delta(m, slower_memory.modules[name])
            modules[name] = dataclasses.replace(m, **_combined(m, dx, dy, x, y))
        skip = frozenset({"world_size", "profiling_seconds", "optim_state_factor", "copy_bytes_per_second"})
        dx, dy = _delta(self.base, self.slower_matmuls, skip), _delta(self.base, slower_memory, skip)
        figures = figures_of(self.run, efficiency, memory)
        return dataclasses.replace(
            self.base,
            modules=modules,
            rates=figures.rates,
            copy_bytes_per_second=figures.copy_bytes_per_second,
            **_combined(self.base, dx, dy, x, y),
        )


def _delta(base: Any, other: Any, skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """The float fields of ``other`` that differ from ``base``'s, as differences."""
    deltas = {}
    for f in dataclasses.fields(base):
        a, b = getattr(base, f.name), getattr(other, f.name)
        if f.name not in skip and isinstance(a, float) and isinstance(b, float) and a != b:
            deltas[f.name] = b - a
    return deltas


def _combined(base: Any, dx: dict[str, float], dy: dict[str, float], x: float, y: float) -> dict[str, float]:
    return {name: getattr(base, name) + dx.get(name, 0.0) * x + dy.get(name, 0.0) * y for name in {*dx, *dy}}


def trace_run(run: PublishedRun, *, memory_axis: bool = False) -> TracedRun:
    """Trace ``run`` at the base rates and with matmuls at half of them (and, with ``memory_axis``, with memory-bound
    operators at half of theirs)."""
    start = time.perf_counter()
    module = build_model(run)
    e, m = MATMUL_CORNERS[0], MEMORY_CORNERS[0]
    base, slower_matmuls = trace(run, module, e, m), trace(run, module, e / 2, m)
    slower_memory = trace(run, module, e, m / 2) if memory_axis else None
    return TracedRun(run, module, base, slower_matmuls, slower_memory, time.perf_counter() - start)


def published_plan(run: PublishedRun, module: torch.nn.Module) -> Plan:
    """The published configuration as a plan: the root and every default unit (block) in the run's sharding mode,
    the blocks recomputed as published."""
    return Plan.uniform(module, run.sharding, recompute=run.recompute)  # type: ignore[arg-type]  # checked on load


@dataclass(frozen=True)
class RowPrediction:
    """The dry run's figures for one published run at one efficiency."""

    tokens_per_second_per_gpu: float
    step_seconds: float
    memory: DeviceMemory
    card_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory.fits(self.card_bytes)


def predict_run(traced: TracedRun, efficiency: float, memory: float) -> RowPrediction:
    """The dry run of the published configuration at these rates."""
    run = traced.run
    profile = traced.profile(efficiency, memory)
    figures = figures_of(run, efficiency, memory)
    plan = published_plan(run, traced.module)
    prediction = predict(profile, plan, figures.topology)
    parts = prediction.step_parts
    if (
        profile.gradient_accumulation > 1
    ):  # the whole accumulating step (see [Note: accumulation as the source runs it])
        micro_step = prediction.step_seconds / profile.gradient_accumulation
    else:  # every micro-batch runs forward, backward and its reductions; the optimizer steps once
        micro_step = prediction.step_seconds - parts.get("optimizer", 0.0) * (1.0 - 1.0 / run.grad_accum)
    memory_figures = plan_device_memory(prediction, plan, figures.topology)
    return RowPrediction(
        run.micro_batch * run.seq_len / micro_step, micro_step, memory_figures, figures.memory_bytes or 0
    )


@dataclass(frozen=True)
class Corners:
    """A run's micro-batch step predicted exactly at the four corners of the rates; between them, bilinear in the
    inverse rates (``step`` is nearly ``a + b / efficiency + c / memory`` where communication hides)."""

    run: PublishedRun
    steps: dict[tuple[float, float], float]

    def tokens_per_second_per_gpu(self, efficiency: float, memory: float) -> float:
        (e0, e1), (m0, m1) = MATMUL_CORNERS, MEMORY_CORNERS
        x = (1 / efficiency - 1 / e0) / (1 / e1 - 1 / e0)
        y = (1 / memory - 1 / m0) / (1 / m1 - 1 / m0)
        s = self.steps
        if (e0, m1) not in s:  # traced without the memory axis
            if y:
                raise ValueError(f"{self.run.id} was predicted at memory {m0} only, not {memory}")
            step = s[e0, m0] * (1 - x) + s[e1, m0] * x
        else:
            step = s[e0, m0] * (1 - x) * (1 - y) + s[e1, m0] * x * (1 - y) + s[e0, m1] * (1 - x) * y + s[e1, m1] * x * y
        return self.run.micro_batch * self.run.seq_len / step

    def ratio(self, efficiency: float, memory: float) -> float:
        return self.tokens_per_second_per_gpu(efficiency, memory) / self.run.tokens_per_second_per_gpu


def corners_of(traced: TracedRun) -> Corners:
    """The exact predictions at the corners of the rates (of matmuls only, if the run was traced without the memory
    axis)."""
    memory = MEMORY_CORNERS if traced.slower_memory is not None else MEMORY_CORNERS[:1]
    steps = {(e, m): predict_run(traced, e, m).step_seconds for e in MATMUL_CORNERS for m in memory}
    return Corners(traced.run, steps)


#: The matmul efficiencies of the GPU generations (in this order) and the memory-bound share of the DRAM bandwidth.
Rates = tuple[float, float, float]
GENERATIONS = ("hopper", "ampere")


def generation(run: PublishedRun) -> str:
    """The run's GPU generation (``Hardware.generation``)."""
    return get_hardware(run.hardware).generation


def efficiency_of(run: PublishedRun, rates: Rates) -> float:
    """The matmul efficiency ``rates`` give the run's GPU."""
    return rates[GENERATIONS.index(generation(run))]


# [Note: one vote per source]
# The calibrated efficiency is the share of the published ceilings a training stack reaches, and what sets it is the
# stack: the source's code, kernels, library versions, cluster and power settings, which all runs of a source share.
# So the runs of one source are not independent measurements of it: their errors at any efficiency move together
# (on Hopper, llm-foundry's 2023-24 runs imply a smaller share than torchtitan's 2024 and KempnerForge's 2026 ones;
# the script prints each source's own values), and the spread between sources is several times the uncertainty of
# any one source's value. Counting runs would let the source with most rows set the constant (llm-foundry has most
# of the eager Hopper runs) and hold the other stacks to it. So each source weighs the same: a generation's error is
# the mean over its sources of the mean absolute log error of each source's runs, as a random-effects average weighs
# studies when the spread between them dwarfs each one's own uncertainty (DerSimonian and Laird, 1986), and as the
# validation already treats sources as the units it holds out. Under an absolute error this lands at the middle
# source where the sources disagree. ``--weight-by run`` gives the earlier estimator (each run one vote).
_WEIGHTINGS = ("source", "run")


def calibration_error(
    corners: dict[str, Corners], runs: list[PublishedRun], rates: Rates, weight_by: str = "source"
) -> float:
    """The mean absolute log error of throughput of ``runs`` at ``rates``, each source weighing the same (the mean
    over sources of their runs' mean) or, with ``weight_by="run"``, each run (see [Note: one vote per source])."""
    if weight_by not in _WEIGHTINGS:
        raise ValueError(f"weight_by {weight_by!r} is not one of {', '.join(_WEIGHTINGS)}")
    groups: dict[str, list[float]] = {}
    for r in runs:
        error = abs(math.log(corners[r.id].ratio(efficiency_of(r, rates), rates[2])))
        groups.setdefault(r.source if weight_by == "source" else r.id, []).append(error)
    return statistics.fmean(statistics.fmean(errors) for errors in groups.values())


def calibrate(
    corners: dict[str, Corners],
    runs: list[PublishedRun],
    memory_grid: tuple[float, ...] = (MEMORY_EFFICIENCY,),
    weight_by: str = "source",
) -> Rates:
    """Per GPU generation, the grid's matmul efficiency with the least mean absolute log error of throughput over the
    eager runs of ``runs`` on that generation, each source weighing the same (see :attr:`PublishedRun.calibrates`
    and [Note: one vote per source]; a generation without any takes the value that is best over all of them), at the
    memory share of the grid whose total error is least."""
    eager = [r for r in runs if r.calibrates]
    if not eager:
        raise ValueError("no eager run to calibrate on")

    def error(subset: list[PublishedRun], e: float, m: float) -> float:
        return calibration_error(corners, subset, (e, e, m), weight_by)

    best: tuple[float, Rates] | None = None
    for m in memory_grid:
        shared = min(MATMUL_GRID, key=lambda e: error(eager, e, m))
        chosen = []
        for g in GENERATIONS:
            own = [r for r in eager if generation(r) == g]
            chosen.append(min(MATMUL_GRID, key=lambda e: error(own, e, m)) if own else shared)
        rates: Rates = (chosen[0], chosen[1], m)
        total = calibration_error(corners, eager, rates, weight_by)
        if best is None or total < best[0]:
            best = (total, rates)
    assert best is not None
    return best[1]


def implied_efficiency(corners: Corners, memory: float = MEMORY_EFFICIENCY) -> float:
    """The matmul efficiency at which the run's prediction equals its published throughput (the step is linear in
    ``1 / efficiency`` between the corners), without the grid's rounding."""
    (e0, e1), m0 = MATMUL_CORNERS, MEMORY_CORNERS[0]
    if memory != m0:
        raise ValueError(f"implied efficiency at memory {m0} only, not {memory}")
    run = corners.run
    published_step = run.micro_batch * run.seq_len / run.tokens_per_second_per_gpu
    s0, s1 = corners.steps[e0, m0], corners.steps[e1, m0]
    x = (published_step - s0) / (s1 - s0)
    return 1.0 / (1.0 / e0 + x * (1.0 / e1 - 1.0 / e0))


def summary(
    runs: list[PublishedRun],
    corners: dict[str, Corners],
    ratio: Callable[[PublishedRun, Rates], float] | None = None,
    memory_grid: tuple[float, ...] = (MEMORY_EFFICIENCY,),
    weight_by: str = "source",
) -> list[dict[str, Any]]:
    """Per source: the rates calibrated on all runs and without the source, and the median and worst absolute
    throughput error of the source's runs at each, by ``ratio`` (predicted over published; default: the corners'
    interpolation)."""
    ratio = ratio or (lambda run, rates: corners[run.id].ratio(efficiency_of(run, rates), rates[2]))
    everything = calibrate(corners, runs, memory_grid, weight_by)
    rows = []
    for source in sorted({r.source for r in runs}):
        own = [r for r in runs if r.source == source]
        others = [r for r in runs if r.source != source]
        # One source only, or no other eager run: nothing to hold out.
        held = calibrate(corners, others, memory_grid, weight_by) if any(r.calibrates for r in others) else everything
        row: dict[str, Any] = {"source": source, "runs": len(own), "rates_all": everything, "rates_held_out": held}
        for key, rates in (("all", everything), ("held_out", held)):
            errors = [abs(ratio(r, rates) - 1.0) for r in own]
            row[f"median_error_{key}"] = statistics.median(errors)
            row[f"worst_error_{key}"] = max(errors)
        rows.append(row)
    return rows


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _rates(rates: Rates) -> str:
    return f"Hopper {rates[0]:.3f}, Ampere {rates[1]:.3f}, memory {rates[2]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="only the runs whose id contains one of these comma-separated texts")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    parser.add_argument(
        "--calibrate-memory",
        action="store_true",
        help="calibrate the memory-bound operators' share of the DRAM bandwidth too (a second constant)",
    )
    parser.add_argument(
        "--weight-by",
        choices=_WEIGHTINGS,
        default="source",
        help="what weighs the same in the calibration: each source (default) or each run (the earlier estimator; "
        "see [Note: one vote per source])",
    )
    args = parser.parse_args()
    memory_grid = MEMORY_GRID if args.calibrate_memory else (MEMORY_EFFICIENCY,)
    only = args.only.split(",") if args.only else []
    runs = [r for r in load_runs() if not only or any(text in r.id for text in only)]
    traced: dict[str, TracedRun] = {}
    corners: dict[str, Corners] = {}
    for run in runs:
        traced[run.id] = trace_run(run, memory_axis=args.calibrate_memory)
        corners[run.id] = corners_of(traced[run.id])
        print(f"# {run.id}: traced in {traced[run.id].seconds:.0f} s", file=sys.stderr)
    exact: dict[tuple[str, float, float], RowPrediction] = {}

    def at(run: PublishedRun, rates: Rates) -> RowPrediction:
        key = (run.id, efficiency_of(run, rates), rates[2])
        if key not in exact:
            exact[key] = predict_run(traced[run.id], *key[1:])
        return exact[key]

    def ratio(run: PublishedRun, rates: Rates) -> float:
        return at(run, rates).tokens_per_second_per_gpu / run.tokens_per_second_per_gpu

    by_source = summary(runs, corners, ratio, memory_grid, args.weight_by)
    everything: Rates = by_source[0]["rates_all"]
    held = {s["source"]: s["rates_held_out"] for s in by_source}
    code: Rates = (TRAINING_MATMUL_EFFICIENCY["hopper"], TRAINING_MATMUL_EFFICIENCY["ampere"], MEMORY_EFFICIENCY)
    ceiling: Rates = (1.0, 1.0, MEMORY_EFFICIENCY)
    worst_interpolation = max(
        abs(corners[r.id].ratio(efficiency_of(r, everything), everything[2]) / ratio(r, everything) - 1) for r in runs
    )
    print(
        f"Calibrated on all eager runs, one vote per {args.weight_by}: matmuls and attention at {_rates(everything)} "
        f"(the code's: {_rates(code)}); "
        f"grids {MATMUL_GRID[0]}-{MATMUL_GRID[-1]} and {memory_grid[0]}-{memory_grid[-1]}; the interpolation between "
        f"the corners is within {worst_interpolation:.1%} of the exact prediction there.\n"
    )
    print(
        "Each source's own share of the ceilings (the efficiency at which each eager run's prediction equals its "
        "published throughput; [Note: one vote per source]):\n"
    )
    print("| generation | source | eager runs | implied efficiency: geometric mean | lowest - highest |")
    print("|---|---|---|---|---|")
    for g in GENERATIONS:
        for source in sorted({r.source for r in runs}):
            own = [
                implied_efficiency(corners[r.id])
                for r in runs
                if r.calibrates and (r.source, generation(r)) == (source, g)
            ]
            if own:
                mean = math.exp(statistics.fmean(math.log(e) for e in own))
                print(f"| {g.title()} | {source} | {len(own)} | {mean:.3f} | {min(own):.3f} - {max(own):.3f} |")
    print()
    print(
        "| source | runs | calibrated on all | held out: calibrated without the source | median error, all | "
        "worst, all | median error, held out | worst, held out |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s in by_source:
        print(
            f"| {s['source']} | {s['runs']} | {_rates(s['rates_all'])} | {_rates(s['rates_held_out'])} | "
            f"{s['median_error_all']:.1%} | {s['worst_error_all']:.1%} | {s['median_error_held_out']:.1%} | "
            f"{s['worst_error_held_out']:.1%} |"
        )
    print()
    print(
        "| run | GPUs | batch | AC | sharding | step | published tok/s/GPU | at the ceilings (ratio) | calibrated, all "
        "(ratio) | held out (ratio) | allocated / reserved / device GiB | published GiB | fits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for run in runs:
        top, cal, ho = at(run, ceiling), at(run, everything), at(run, held[run.source])
        pub = run.tokens_per_second_per_gpu
        memory = cal.memory
        published_memory = f"{run.memory_gib:.1f} ({run.memory_kind})" if run.memory_gib else "-"
        print(
            f"| {run.id} | {run.nodes} x {run.gpus_per_node} {run.hardware} | {run.micro_batch} x {run.seq_len}"
            f"{f' (x{run.grad_accum})' if run.grad_accum > 1 else ''} | {run.recompute} | {run.sharding} | "
            f"{run.step} | "
            f"{pub:,.0f} | {top.tokens_per_second_per_gpu:,.0f} ({top.tokens_per_second_per_gpu / pub:.2f}) | "
            f"{cal.tokens_per_second_per_gpu:,.0f} ({cal.tokens_per_second_per_gpu / pub:.2f}) | "
            f"{ho.tokens_per_second_per_gpu:,.0f} ({ho.tokens_per_second_per_gpu / pub:.2f}) | "
            f"{_gib(memory.allocated)} / {_gib(memory.reserved)} / {_gib(memory.device_total)} | {published_memory} | "
            f"{'yes' if cal.fits else 'no'} |"
        )
        out.append(
            {
                "id": run.id,
                "source": run.source,
                "published_tokens_per_second_per_gpu": pub,
                "predicted_at_ceilings": top.tokens_per_second_per_gpu,
                "predicted_calibrated": cal.tokens_per_second_per_gpu,
                "predicted_held_out": ho.tokens_per_second_per_gpu,
                "allocated_gib": memory.allocated / GIB,
                "reserved_gib": memory.reserved / GIB,
                "device_total_gib": memory.device_total / GIB,
                "published_memory_gib": run.memory_gib,
                "fits": cal.fits,
                "corner_steps": [[e, m, step] for (e, m), step in corners[run.id].steps.items()],
            }
        )
    if args.out:
        args.out.write_text(json.dumps({"summary": by_source, "runs": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
