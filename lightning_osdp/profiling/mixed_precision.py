"""Profiling a step as FSDP2's ``MixedPrecisionPolicy`` runs it: computed in ``param_dtype``, stored in full precision.

[Note: the profile of a mixed-precision policy]
Under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (``OSDPStrategy(
mixed_precision="bf16")``) a sharded unit gathers its parameters in bf16 and every operator of its forward and
backward sees bf16 weights; what autograd keeps of a weight is FSDP2's unsharded parameter, whose storage FSDP2
frees at reshard. Profiled on the model as it is (fp32 parameters, Lightning's autocast) the step would save
autocast's bf16 copy of every weight as an *activation*: half the parameter bytes of the whole model, unsharded,
which is what makes a 13B model at batch 2 x 4,096 need 85 GiB per device where FSDP2 with the policy needs 57.

So the step is profiled with the module's floating parameters swapped for ``param_dtype`` copies
(:func:`parameters_in`): activations, times and FLOPs are those of the policy's step. The byte figures of what is
*stored* (parameters, sharded gradients, optimizer state: the model's own dtype) are then restored from the
parameters' own dtype (:func:`as_stored`), and the profile records the policy (``ModelProfile.mixed_precision``), from
which the cost model sizes what is gathered, reduced and copied (``lightning_osdp/cost_model/units.py`` [Note: bytes
per dtype under FSDP2's mixed precision]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.profiling.replica import restore_tensors, swap_tensors

__all__ = ["as_stored", "parameters_in", "policy_dtypes", "profile_with_policy"]


def policy_dtypes(policy: MixedPrecisionPolicy) -> dict[str, str]:
    """``{"param_dtype": ..., "reduce_dtype": ...}`` as ``ModelProfile.mixed_precision`` records them (a dtype the
    policy leaves unset is the parameters' own, and is not recorded)."""
    out = {}
    for key in ("param_dtype", "reduce_dtype"):
        dtype = getattr(policy, key)
        if dtype is not None:
            out[key] = str(dtype).removeprefix("torch.")
    return out


@contextmanager
def parameters_in(module: nn.Module, dtype: torch.dtype | None) -> Iterator[nn.Module]:
    """``module`` with its floating-point parameters replaced by ``dtype`` copies (buffers untouched: FSDP2's policy
    does not cast them), the originals put back on exit. ``None``: unchanged."""
    if dtype is None:
        yield module
        return

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype) if t.is_floating_point() and isinstance(t, nn.Parameter) else t

    originals = swap_tensors(module, cast)
    try:
        yield module
    finally:
        restore_tensors(module, originals)


def as_stored(profile: ModelProfile, module: nn.Module, policy: MixedPrecisionPolicy) -> ModelProfile:
    """``profile`` (traced under :func:`parameters_in`) with its parameter, gradient and optimizer-state bytes those of
    ``module``'s parameters as stored, its optimizer step timed for them, and the policy recorded (see [Note: the
    profile of a mixed-precision policy]).

    The optimizer state of a parameter has the parameter's dtype (Adam's moments, SGD's momentum) and its step moves
    bytes in proportion, so both scale as the parameters do; the per-tensor scalars (Adam's ``step``) do not.
    """
    ratio = _ratios(module, policy.param_dtype)
    modules = {}
    for name, mp in profile.modules.items():
        r = ratio.get(name, 1.0)
        if r == 1.0:
            modules[name] = mp
            continue
        modules[name] = dataclasses.replace(
            mp,
            param_bytes=round(mp.param_bytes * r),
            trainable_param_bytes=round(mp.trainable_param_bytes * r),
            grad_bytes=round(mp.grad_bytes * r),
            optim_state_bytes=round(mp.optim_state_bytes * r),
        )
    traced = sum(m.param_bytes for m in profile.modules.values())
    stored = sum(m.param_bytes for m in modules.values())
    scale = stored / traced if traced else 1.0
    optimizer = profile.optimizer_step_seconds * scale
    result = dataclasses.replace(
        profile,
        modules=modules,
        optimizer_step_seconds=optimizer,
        step_overhead_seconds=profile.step_overhead_seconds + optimizer - profile.optimizer_step_seconds,
        mixed_precision=policy_dtypes(policy),
    )
    result.info = {**profile.info, "mixed_precision": "traced with the policy's parameter dtype; bytes as stored"}
    return result


def _ratios(module: nn.Module, dtype: torch.dtype | None) -> dict[str, float]:
    """Per module name, the stored over computed bytes of the floating parameters it owns (the first module that
    ``named_modules()`` yields holding a parameter owns it, as in the profile)."""
    if dtype is None:
        return {}
    seen: set[int] = set()
    out: dict[str, float] = {}
    for name, mod in module.named_modules():
        stored = computed = 0
        for p in mod.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.is_floating_point():
                stored += p.numel() * p.element_size()
                computed += p.numel() * dtype.itemsize
            else:
                stored += p.numel() * p.element_size()
                computed += p.numel() * p.element_size()
        if computed and stored != computed:
            out[name] = stored / computed
    return out


def profile_with_policy(module: nn.Module, batch: Any, policy: MixedPrecisionPolicy, **kwargs: Any) -> ModelProfile:
    """:func:`~lightning_osdp.profiling.profile` (``module``, ``batch``, ``kwargs``) of the step as ``policy`` runs it
    (see [Note: the profile of a mixed-precision policy]): a collective when a process group is initialised, as
    ``profile`` is."""
    from lightning_osdp.profiling.profiler import profile

    with parameters_in(module, policy.param_dtype):
        traced = profile(module, batch, **kwargs)
    return as_stored(traced, module, policy)
