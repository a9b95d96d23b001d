"""The optimizer of the profiled step: which one, rebuilt on the profiled copy, and the bytes of its state.

[Note: counting optimizer state]
For the optimizer types whose state is known, the state is computed from the type and the hyperparameters of
each parameter's group, per parameter that has a gradient (an optimizer skips parameters without one):

* ``Adam`` / ``AdamW``: ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``), each the size
  and dtype of the parameter, so 2 (3) bytes per parameter byte; plus ``step``, a 0-dim float32 tensor
  (float64 when that is the default dtype and the optimizer is not fused): 4 bytes per parameter tensor.
* ``SGD``: one ``momentum_buffer`` the size of the parameter when ``momentum != 0``; nothing otherwise.

The per-parameter-size part is ``optim_state_bytes`` (it shards with the parameter); the 0-dim part is
``optim_scalar_bytes`` (every rank keeps one per parameter tensor it holds, sharded or not).

Any other optimizer type (a subclass included: it may keep more) is counted from a real instance: the profiled
step runs it once on the profiled copy of the model (real tensors in measured mode, fake tensors in estimated
mode) and its ``state`` is measured, 0-dim tensors apart. When its step cannot run on fake tensors, it runs on a
small real proxy parameter (64 x 64, per dtype) and the state per parameter byte found there is applied to every
parameter: exact for optimizers whose state is elementwise, an estimate for factored ones (Adafactor).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import SGD, Adam, AdamW, Optimizer

from lightning_osdp._compat import disable_current_modes, tree_leaves
from lightning_osdp.profiling.errors import ProfilingError
from lightning_osdp.profiling.parameters import owner_of_parameters

__all__ = [
    "OptimizerSpec",
    "OptimizerState",
    "configured_optimization",
    "is_known",
    "optimizers_from_lightning_module",
    "rebuild_optimizers",
    "state_copies",
    "state_from_instance",
    "state_from_proxy",
    "state_from_rule",
]

#: What ``profile(optimizer=...)`` accepts: instances built on the model's parameters (what
#: ``configure_optimizers`` returns), an optimizer class (built with its defaults), or a factory called with the
#: list of trainable parameters.
OptimizerSpec = Optimizer | Sequence[Optimizer] | type[Optimizer] | Callable[[list[nn.Parameter]], Optimizer]


@dataclass
class OptimizerState:
    """State bytes per owning module: the part that scales with the parameter, and the 0-dim part."""

    tensor_bytes: dict[str, int] = field(default_factory=dict)
    scalar_bytes: dict[str, int] = field(default_factory=dict)
    source: str = "rule"

    def add(self, owner: str, tensor: int, scalar: int) -> None:
        self.tensor_bytes[owner] = self.tensor_bytes.get(owner, 0) + tensor
        self.scalar_bytes[owner] = self.scalar_bytes.get(owner, 0) + scalar

    @property
    def total_tensor_bytes(self) -> int:
        return sum(self.tensor_bytes.values())


def _unwrap(optimizer: Any) -> Any:
    # Lightning's LightningOptimizer wraps the real one.
    return getattr(optimizer, "optimizer", optimizer) if type(optimizer).__name__ == "LightningOptimizer" else optimizer


def optimizers_from_lightning_module(module: nn.Module) -> list[Optimizer]:
    """The optimizers ``configure_optimizers()`` builds (schedulers and monitor settings dropped)."""
    return configured_optimization(module)[0]


def configured_optimization(module: nn.Module) -> tuple[list[Optimizer], list[Any]]:
    """The optimizers and the learning-rate schedulers ``configure_optimizers()`` builds, in Lightning's order (monitor
    settings dropped). The schedulers are what a manual ``training_step``'s ``self.lr_schedulers()`` gets while it is
    profiled: they belong to these optimizers, not to the ones the profiled copy steps."""
    try:
        conf = module.configure_optimizers()  # type: ignore[operator]
    except Exception as error:
        raise ProfilingError(
            f"{type(module).__name__}.configure_optimizers() failed while profiling ({type(error).__name__}: "
            f"{error}); pass profile(optimizer=...) (an optimizer instance, class or factory)"
        ) from error
    found: list[Optimizer] = []
    schedulers: list[Any] = []

    def scheduler(item: Any) -> None:
        item = item.get("scheduler") if isinstance(item, dict) else item
        if item is not None:
            schedulers.append(item)

    def collect(item: Any) -> None:
        item = _unwrap(item)
        if isinstance(item, Optimizer):
            found.append(item)
        elif isinstance(item, dict):
            collect(item.get("optimizer"))
            scheduler(item.get("lr_scheduler"))
        elif isinstance(item, (list, tuple)):
            # ([optimizers], [schedulers]).
            if len(item) == 2 and isinstance(item[0], (list, tuple)) and isinstance(item[1], (list, tuple)):
                collect(item[0])
                for sub in item[1]:
                    scheduler(sub)
            else:
                for sub in item:
                    collect(sub)

    collect(conf)
    return found, schedulers


def _constructor_kwargs(cls: type[Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    # `defaults` may hold entries the constructor does not take (AdamW's `decoupled_weight_decay`).
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted}


def rebuild_optimizers(
    spec: OptimizerSpec | None,
    param_names: dict[int, str],
    work: nn.Module,
    model_name: str = "the model",
    *,
    partial: bool = False,
) -> list[Optimizer]:
    """Optimizers of the same types and hyperparameters as ``spec``, over ``work``'s parameters.

    ``work`` is the copy of the user's model that profiling runs (the same module names); ``param_names`` maps
    ``id()`` of each of the user's parameters to its name, so that an instance built on the user's parameters is
    rebuilt on the copy's parameters of the same names. ``partial``: ``work`` lacks some of the model's parameters (a
    copy with its repeated blocks cut, ``repeats.py``), which the rebuilt optimizers leave out.
    """
    trainable: list[nn.Parameter] = []
    seen: set[int] = set()
    for p in work.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            trainable.append(p)
    if spec is None or not trainable:
        return []
    if isinstance(spec, type):
        if not issubclass(spec, Optimizer):
            raise ProfilingError(f"optimizer class {spec.__name__} is not a torch.optim.Optimizer")
        cls: type[Optimizer] = spec
        return [_build(cls.__name__, lambda: cls(trainable))]  # type: ignore[call-arg]
    if isinstance(spec, (list, tuple)) or isinstance(_unwrap(spec), Optimizer):
        instances = [_unwrap(o) for o in (spec if isinstance(spec, (list, tuple)) else [spec])]
        strangers = [type(o).__name__ for o in instances if not isinstance(o, Optimizer)]
        if strangers:
            raise ProfilingError(f"optimizer list holds {strangers}, not torch Optimizers")
        by_name = dict(work.named_parameters(remove_duplicate=False))
        mapping = {key: by_name[name] for key, name in param_names.items() if not partial or name in by_name}
        absent = {key for key, name in param_names.items() if name not in by_name}
        return [_rebuild(optimizer, mapping, model_name, absent=absent) for optimizer in instances]
    if callable(spec):
        factory = spec
        return [_build(getattr(factory, "__name__", "optimizer factory"), lambda: factory(trainable))]
    raise ProfilingError(f"optimizer must be an Optimizer, a list of them, a class or a factory, not {spec!r}")


def _rebuild(
    optimizer: Optimizer,
    mapping: dict[int, nn.Parameter],
    model_name: str,
    *,
    absent: set[int] | frozenset[int] = frozenset(),
) -> Optimizer:
    groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if id(p) not in absent]  # the model's, cut from the copy
        missing = [i for i, p in enumerate(params) if id(p) not in mapping]
        if missing:
            raise ProfilingError(
                f"{type(optimizer).__name__} holds parameters that are not {model_name}'s "
                f"(group entries {missing[:5]}): profiling can only replay an optimizer over the model"
            )
        hyperparameters = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyperparameters, "params": [mapping[id(p)] for p in params]})
    cls = type(optimizer)
    kwargs = _constructor_kwargs(cls, optimizer.defaults)
    return _build(cls.__name__, lambda: cls(groups, **kwargs))


def _build(what: str, make: Callable[[], object]) -> Optimizer:
    try:
        optimizer = make()
    except Exception as error:
        raise ProfilingError(
            f"cannot build a {what} over the profiled copy of the model ({type(error).__name__}: {error}); "
            "pass profile(optimizer=...) a factory `params -> optimizer`"
        ) from error
    if not isinstance(optimizer, Optimizer):
        raise ProfilingError(f"{what} returned {type(optimizer).__name__}, not a torch Optimizer")
    return optimizer


def _scalar_step_bytes(group: dict[str, Any]) -> int:
    # torch.optim's `_get_scalar_dtype`: float64 only when that is the default dtype and the step is not fused.
    return 8 if torch.get_default_dtype() == torch.float64 and not group.get("fused") else 4


def _rule(optimizer: Optimizer, group: dict[str, Any]) -> tuple[int, int] | None:
    """(state tensors the size of the parameter, 0-dim state bytes) per parameter, for the known types."""
    if type(optimizer) in (Adam, AdamW):
        return (3 if group.get("amsgrad") else 2), _scalar_step_bytes(group)
    if type(optimizer) is SGD:
        return (1 if group.get("momentum", 0) != 0 else 0), 0
    return None


def is_known(optimizer: Optimizer) -> bool:
    """Whether the state of ``optimizer`` is computed from its type (see [Note: counting optimizer state])."""
    return all(_rule(optimizer, g) is not None for g in optimizer.param_groups)


def state_copies(optimizers: Iterable[Optimizer]) -> float:
    """State bytes per trainable parameter byte, from the types alone (an unknown type is assumed to keep 2)."""
    copies = 0.0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            rule = _rule(optimizer, group)
            copies = max(copies, 2.0 if rule is None else float(rule[0]))
    return copies


def state_from_rule(optimizers: Iterable[Optimizer], module: nn.Module, state: OptimizerState) -> list[Optimizer]:
    """Add the state of the known optimizers (over parameters that have a gradient now); return the others."""
    owner = owner_of_parameters(module)
    unknown = []
    for optimizer in optimizers:
        if not is_known(optimizer):
            unknown.append(optimizer)
            continue
        for group in optimizer.param_groups:
            rule = _rule(optimizer, group)
            assert rule is not None
            copies, scalar = rule
            for p in group["params"]:
                if p.grad is not None:
                    state.add(owner[id(p)], copies * p.numel() * p.element_size(), scalar)
    return unknown


def _storage_key(t: Tensor) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return id(t)


def _storage_bytes(t: Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def state_from_instance(optimizers: Iterable[Optimizer], module: nn.Module, state: OptimizerState) -> None:
    """Add the state the optimizers hold now (after a step), measured tensor by tensor."""
    owner = owner_of_parameters(module)
    seen: set[int] = set()
    for optimizer in optimizers:
        for p, entry in optimizer.state.items():
            if not isinstance(p, Tensor) or id(p) not in owner:
                continue
            tensor = scalar = 0
            for v in tree_leaves(entry):
                if not isinstance(v, Tensor) or _storage_key(v) in seen:
                    continue
                seen.add(_storage_key(v))
                if v.dim() == 0:
                    scalar += _storage_bytes(v)
                else:
                    tensor += _storage_bytes(v)
            state.add(owner[id(p)], tensor, scalar)


def state_from_proxy(optimizers: Iterable[Optimizer], module: nn.Module, state: OptimizerState) -> None:
    """Add the state of optimizers that cannot step here, scaled from a step on a small real proxy parameter."""
    owner = owner_of_parameters(module)
    for optimizer in optimizers:
        cls = type(optimizer)
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            per_dtype: dict[torch.dtype, tuple[float, int]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype not in per_dtype:
                    per_dtype[p.dtype] = _proxy_factor(cls, hyper, optimizer.defaults, p.dtype)
                factor, scalar = per_dtype[p.dtype]
                state.add(owner[id(p)], round(factor * p.numel() * p.element_size()), scalar)
    state.source = "proxy"


def _proxy_factor(
    cls: type[Optimizer], hyper: dict[str, Any], defaults: dict[str, Any], dtype: torch.dtype
) -> tuple[float, int]:
    # Real tensors: the fake mode (and profiling's operator tracing) of the failed step are set aside.
    with disable_current_modes():
        return _real_proxy_factor(cls, hyper, defaults, dtype)


def _real_proxy_factor(
    cls: type[Optimizer], hyper: dict[str, Any], defaults: dict[str, Any], dtype: torch.dtype
) -> tuple[float, int]:
    proxy = nn.Parameter(torch.randn(64, 64, dtype=torch.float32).to(dtype))
    proxy.grad = torch.randn_like(proxy)
    kwargs = _constructor_kwargs(cls, defaults)
    optimizer = _build(cls.__name__, lambda: cls([{**hyper, "params": [proxy]}], **kwargs))
    optimizer.step()
    holder = nn.Module()
    holder.register_parameter("p", proxy)
    measured = OptimizerState()
    state_from_instance([optimizer], holder, measured)
    return measured.tensor_bytes.get("", 0) / (proxy.numel() * proxy.element_size()), measured.scalar_bytes.get("", 0)
