"""The precision plugins of :class:`~lightning_osdp.OSDPStrategy`: Lightning's own, with what a mixed plan changes.

[Note: why OSDP has precision plugins of its own]
Two things differ from Lightning's plugins under a plan that mixes replicated and sharded parameters:

* clipping: ``Precision.clip_grad_by_norm`` calls ``torch.nn.utils.clip_grad_norm_`` on the optimizer's
  parameters, whose single ``foreach`` call refuses a list mixing plain tensors (``no_shard`` parameters, DDP's) and
  DTensors (sharded ones); so does ``clip_grad_by_value``'s ``clip_grad_value_``. OSDP's plugins clip by the global
  norm over both (:func:`lightning_osdp.apply.clip_grad_norm_`), and by value part by part;
* ``16-mixed``: gradients are sharded, so an inf/NaN may sit in one rank's shard only and the ranks must agree on
  skipping the step: ``ShardedGradScaler`` all-reduces its ``found_inf``, ``GradScaler`` does not. Its unscaling
  (before every step, and before clipping) hits the same refusal of mixed lists: :class:`OSDPGradScaler` unscales
  the plain and the sharded gradients in two calls.

Lightning's FSDP strategy answers the same need with one plugin class of its own (``FSDPPrecision``, which refuses
clipping by norm) that the strategy insists on. OSDP subclasses each of Lightning's standard plugins instead, so
that everything else they do, and the ``isinstance`` checks made on them (the throughput monitor reads the compute
dtype that way), stay Lightning's. The strategy converts the plugin that ``Trainer(precision=...)`` (or
``plugins=[...]``) builds when it is assigned (:func:`osdp_precision`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Literal, cast

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer
from typing_extensions import override

from lightning_osdp.apply.clip import clip_grad_norm_, clip_grad_value_, parts_by_mesh

__all__ = [
    "OSDPDoublePrecision",
    "OSDPGradScaler",
    "OSDPHalfPrecision",
    "OSDPMixedPrecision",
    "OSDPPrecision",
    "osdp_precision",
]


class OSDPPrecision(Precision):
    """``32-true``, and the base of OSDP's other plugins: clips over plain and sharded gradients (by their global norm,
    or by value).

    Checkpoints keep the plugin's state under the name of the Lightning plugin it extends (``"MixedPrecision"``, for
    the scaler of ``16-mixed``), where Lightning keeps it: a checkpoint of a DDP run resumes under OSDP, and back.
    """

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        # Lightning has just stored `state_dict()` under this class's own name.
        own = type(self).__qualname__
        if own in checkpoint:
            checkpoint[_lightning_name(self)] = checkpoint.pop(own)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        # Lightning then looks for this class's own name, which the checkpoint does not have.
        key = _lightning_name(self)
        if type(self).__qualname__ not in checkpoint and key in checkpoint:
            self.load_state_dict(checkpoint[key])


class OSDPGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` for a plan that mixes replicated and sharded parameters: it unscales the plain and the
    DTensor gradients (those of each mesh apart) in separate calls of torch's fused check-and-unscale, which refuses
    a list mixing them."""

    @override
    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        parts = parts_by_mesh(params)  # DTensors of hybrid_shard units are on a mesh of their own
        if len(parts) < 2:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        found: dict[torch.device, torch.Tensor] = {}
        for part in parts:
            # The parent reads nothing of the optimizer but its `param_groups`.
            view = cast(Optimizer, SimpleNamespace(param_groups=[{"params": part}]))
            for device, flag in super()._unscale_grads_(view, inv_scale, found_inf, allow_fp16).items():
                # Both calls write into `found_inf` itself on its own device; copies elsewhere are summed (> 0: inf).
                previous = found.get(device)
                found[device] = flag if previous is None or previous is flag else previous + flag
        return found


class OSDPMixedPrecision(OSDPPrecision, MixedPrecision):
    """``16-mixed``/``bf16-mixed`` (``torch.autocast``). For ``16-mixed`` the gradient scaler is an
    :class:`OSDPGradScaler`; any other scaler given is replaced by one with the same settings."""

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if precision == "16-mixed":
            scaler = _sharded_scaler(scaler, device)
        super().__init__(precision, device, scaler)


class OSDPHalfPrecision(OSDPPrecision, HalfPrecision):
    """``16-true``/``bf16-true``: parameters and computation in half precision."""


class OSDPDoublePrecision(OSDPPrecision, DoublePrecision):
    """``64-true``: parameters and computation in double precision."""


def osdp_precision(plugin: Precision) -> OSDPPrecision:
    """OSDP's counterpart of one of Lightning's standard precision plugins (``plugin`` itself if it is one of OSDP's).

    Raises:
        TypeError: for any other plugin: its methods could not be kept while clipping is adapted.
    """
    if isinstance(plugin, OSDPPrecision):
        return plugin
    kind = type(plugin)
    if kind is MixedPrecision:
        assert isinstance(plugin, MixedPrecision)
        # MixedPrecision's constructor has checked it; its attribute is typed as any precision.
        precision = cast(Literal["16-mixed", "bf16-mixed"], plugin.precision)
        return OSDPMixedPrecision(precision, plugin.device, plugin.scaler)
    if kind is HalfPrecision:
        assert isinstance(plugin, HalfPrecision)
        return OSDPHalfPrecision(plugin.precision)
    if kind is DoublePrecision:
        return OSDPDoublePrecision()
    if kind is Precision:
        return OSDPPrecision()
    raise TypeError(
        f"OSDPStrategy cannot use the precision plugin {kind.__qualname__}: it works with Lightning's "
        "Precision, MixedPrecision, HalfPrecision and DoublePrecision (what Trainer(precision='32-true' | "
        "'16-mixed' | 'bf16-mixed' | '16-true' | 'bf16-true' | '64-true') builds) and with subclasses of "
        "lightning_osdp.precision's OSDPPrecision, OSDPMixedPrecision, OSDPHalfPrecision and OSDPDoublePrecision. "
        "To customise one, subclass the OSDP plugin."
    )


def _lightning_name(plugin: Precision) -> str:
    """The name of the first of Lightning's own classes among ``plugin``'s bases: the key of its checkpoint state."""
    lightning = next(c for c in type(plugin).__mro__ if c.__module__.startswith("lightning."))
    return lightning.__qualname__


def _sharded_scaler(scaler: torch.amp.GradScaler | None, device: str) -> OSDPGradScaler:
    if isinstance(scaler, OSDPGradScaler):
        return scaler
    if scaler is None:
        return OSDPGradScaler(device=device)
    extra = {"process_group": scaler.process_group} if isinstance(scaler, ShardedGradScaler) else {}
    return OSDPGradScaler(
        device=device,
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
        **extra,
    )
