"""A profile of a model on hardware that is not here, at any batch size: the dry run's half of stage 1.

[Note: rates of another device]
``lightning_osdp.profiling.profile`` in estimated mode runs one step on fake tensors and converts each operator's
FLOPs and bytes into seconds with rates it benchmarks on *this* machine, unless it is given others. A dry run
wants the figures of the GPU it plans for, so :func:`estimated_profile` gives ``profile`` the target's rates, copy
bandwidth and collectives (which set the world size), and nothing is benchmarked here. The profile is then
relabelled for the target: its device (``"cuda ..."``, so the cost model lets collectives overlap compute, as CUDA
streams do) and a description of the hardware.

[Note: batch size]
Every figure a profile holds is an affine function of the per-device batch size ``b``: saved activations, outputs
and FLOPs are proportional to ``b`` (every activation has a batch dimension; the rest, such as a positional
index, is constant), times are ``ops * latency + work / rate`` with a constant operator count, and parameters,
gradients and optimizer state do not depend on ``b`` at all. So the dry run profiles twice, at ``b`` and ``2b``,
and :class:`BatchScaledProfile` interpolates (or extrapolates) every figure that differs between the two to any
other batch size, exactly up to integer rounding, instead of tracing the model again for each size that the
batch-size search tries (``tests/test_cli.py`` checks the interpolation against a direct profile).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.hardware import HardwareFigures
from lightning_osdp.profiling import ModelProfile, ModuleProfile, ProfilingError, profile, profile_with_policy

__all__ = ["BatchScaledProfile", "estimated_profile"]

# Figures of the hardware or the run, not of the batch.
_NOT_SCALED = frozenset(
    {"world_size", "profiling_seconds", "optim_state_factor", "copy_bytes_per_second", "framework_seconds"}
)


def estimated_profile(
    model: nn.Module,
    batch: Any,
    figures: HardwareFigures,
    *,
    step: str = "auto",
    optimizer: Any = None,
    step_context: Callable[[], Any] | None = None,
    batch_source: str = "argument",
    mixed_precision: MixedPrecisionPolicy | None = None,
    world_size: int | None = None,
) -> ModelProfile:
    """Profile ``model`` (on the meta device) on ``batch`` as if it ran on the hardware of ``figures`` (see
    [Note: rates of another device]), under FSDP2's ``mixed_precision`` policy when given (see
    ``lightning_osdp/profiling/mixed_precision.py``). With ``world_size``, the profile is of that many ranks with the
    figures' two levels of the network (within a node, the collectives it was traced with; across nodes), as the dry
    run predicts.

    Raises:
        CLIError: the model's step cannot run on fake tensors (the profiler's message).
    """
    kwargs: dict[str, Any] = {
        "mode": "estimated",
        "step": step,
        "optimizer": optimizer,
        "step_context": step_context,
        "collectives": figures.collectives,
        "batch_source": batch_source,
        "rates": figures.rates,
        "copy_bytes_per_second": figures.copy_bytes_per_second,
    }
    try:
        if mixed_precision is not None:
            result = profile_with_policy(model, batch, mixed_precision, **kwargs)
        else:
            result = profile(model, batch, **kwargs)
    except ProfilingError as err:
        raise CLIError(str(err).replace("\n", " ")) from err
    result.device = figures.device
    result.info["hardware"] = figures.description
    if world_size is None:
        return result
    return dataclasses.replace(
        result,
        world_size=world_size,
        nodes=figures.nodes,
        inter_node_collectives=dict(figures.inter_node_collectives),
    )


def _affine(low: Any, high: Any, t: float, signed: bool = False) -> Any:
    value = low + (high - low) * t
    if isinstance(low, int) and isinstance(high, int):
        value = round(value)
    return value if signed else max(value, 0)


def _scaled_fields(
    obj: Any, low: Any, high: Any, t: float, skip: frozenset[str] = frozenset(), signed: bool = False
) -> dict[str, Any]:
    """``obj``'s number fields that differ between ``low`` and ``high``, at ``t`` of the way from one to the other
    (clamped at zero unless ``signed``: a loss region's figures are differences, and may be negative)."""
    changes = {}
    for f in dataclasses.fields(obj):
        a, b = getattr(low, f.name), getattr(high, f.name)
        if f.name in skip or isinstance(a, bool) or not isinstance(a, (int, float)) or a == b:
            continue
        changes[f.name] = _affine(a, b, t, signed)
    return changes


class BatchScaledProfile:
    """Profiles at any batch size from two profiles of one model (see [Note: batch size]).

    Args:
        low, high: profiles of the same model at per-device batch sizes ``low_batch < high_batch``.
    """

    def __init__(self, low: ModelProfile, low_batch: int, high: ModelProfile, high_batch: int) -> None:
        if not 0 < low_batch < high_batch:
            raise ValueError(f"need 0 < low_batch < high_batch, got {low_batch} and {high_batch}")
        if list(low.modules) != list(high.modules):
            raise ValueError("the two profiles are of different models")
        self.low, self.high = low, high
        self.low_batch, self.high_batch = low_batch, high_batch
        self._cache: dict[int, ModelProfile] = {low_batch: low, high_batch: high}

    def at(self, batch_size: int) -> ModelProfile:
        """The profile at ``batch_size`` (a new object; the two measured ones are returned as they are)."""
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        if batch_size in self._cache:
            return self._cache[batch_size]
        t = (batch_size - self.low_batch) / (self.high_batch - self.low_batch)
        modules: dict[str, ModuleProfile] = {}
        for name, low in self.low.modules.items():
            high = self.high.modules[name]
            modules[name] = dataclasses.replace(low, **_scaled_fields(low, low, high, t))
        result = dataclasses.replace(
            self.low, modules=modules, **_scaled_fields(self.low, self.low, self.high, t, skip=_NOT_SCALED)
        )
        if self.low.loss is not None and self.high.loss is not None:  # the logits and their loss grow with the batch
            result.loss = dataclasses.replace(
                self.low.loss, **_scaled_fields(self.low.loss, self.low.loss, self.high.loss, t, signed=True)
            )
        result.info = {
            **copy.deepcopy(self.low.info),
            "batch_scaling": {"batch_size": batch_size, "profiled_at": [self.low_batch, self.high_batch]},
        }
        result.batch = _batch_description(self.low.batch, self.low_batch, batch_size)
        self._cache[batch_size] = result
        return result


def _batch_description(batch: dict[str, Any], old: int, new: int) -> dict[str, Any]:
    tensors = [
        {**t, "shape": [new, *t["shape"][1:]] if t.get("shape") and t["shape"][0] == old else t.get("shape")}
        for t in batch.get("tensors", [])
    ]
    source = f"{batch.get('source', '?')}, scaled from batch {old}"
    return {**batch, "tensors": tensors, "bytes": batch.get("bytes", 0) * new // max(old, 1), "source": source}
