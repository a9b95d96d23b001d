"""The copy of the model that profiling runs, so that the user's model leaves profiling as it came in.

[Note: why a copy]
A profiled step runs the user's ``training_step`` several times and steps the optimizer: on the model itself that
would move its parameters and buffers (BatchNorm statistics), leave gradients behind and repeat the step's Python
side effects (lists appended, metrics updated). So profiling runs a ``copy.deepcopy`` of the model. The trainer (and
Fabric) it references are shared, not copied: ``self.trainer`` keeps working in the copy's ``training_step``.

Measured mode copies the parameters (memory: one more copy of the model). Estimated mode never materialises
them: the copy's parameters and buffers are created on the meta device and then replaced by fake tensors of the
target device (``FakeTensorMode``), tied parameters staying tied.

A model ``deepcopy`` cannot copy (a module caching a non-leaf tensor, say) is profiled in place instead, with a
warning: parameters, buffers and gradients are saved first and restored afterwards (so memory is the same), but
Python side effects of the step are not undone.
"""

from __future__ import annotations

import copy
import functools
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_osdp._compat import module_apply

__all__ = ["fake_replica", "materialize_randomly", "measured_replica", "swap_tensors"]


_SHARED = ("_trainer", "_fabric")


def _shared_referents(module: nn.Module) -> dict[int, Any]:
    # deepcopy memo entries: objects the copy references as they are.
    return {id(obj): obj for obj in (vars(module).get(attr) for attr in _SHARED) if obj is not None}


def _copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    replica = copy.deepcopy(module, memo)
    # LightningModule.__getstate__ drops the trainer (a pickled module must not drag it along): put it back.
    for attr in _SHARED:
        if attr in vars(module):
            vars(replica)[attr] = vars(module)[attr]
    _rebind_hooks(replica, memo)
    return replica


def _rebind_hooks(replica: nn.Module, memo: dict[int, Any]) -> None:
    """Point the copy's hooks at the copy.

    [Note: hooks that reference the model]
    ``deepcopy`` copies a module's hook dictionaries but not the functions in them (functions are copied by
    reference), so a hook that captured a part of the model still reaches the *user's* part from the copy:
    ``block.register_forward_hook(lambda m, i, out, adapter=adapter: out + adapter(out))``, a bound method of another
    module, a ``functools.partial``. The copy's step would then run the user's adapter, on the user's parameters: its
    gradients land in the user's model, and the profile sees neither its parameters' gradients nor its optimizer
    state nor its activations (a frozen backbone with adapters attached by hooks was under-predicted by its adapters'
    Adam state). So each hook whose default arguments, closure cells, bound ``self`` or partial arguments hold an
    object the deepcopy copied (``memo``) is rebuilt around the copies; a hook that reaches the model through a
    global name cannot be rebound, and is left as it is."""
    for mod in replica.modules():
        for name, hooks in vars(mod).items():
            if not (name.startswith("_") and "hooks" in name and isinstance(hooks, dict)):
                continue
            for key, hook in list(hooks.items()):
                if callable(hook):
                    hooks[key] = _rebound(hook, memo)


def _rebound(fn: Any, memo: dict[int, Any]) -> Any:
    """``fn`` with every object it captured that ``memo`` copied replaced by its copy (``fn`` itself if none)."""

    def swap(value: Any) -> Any:
        return memo.get(id(value), value)

    if isinstance(fn, types.MethodType):
        owner = swap(fn.__self__)
        return fn if owner is fn.__self__ else types.MethodType(fn.__func__, owner)
    if isinstance(fn, functools.partial):
        args, keywords = tuple(swap(a) for a in fn.args), {k: swap(v) for k, v in fn.keywords.items()}
        inner = _rebound(fn.func, memo)
        same = inner is fn.func and all(a is b for a, b in zip(args, fn.args, strict=True))
        if same and all(keywords[k] is v for k, v in fn.keywords.items()):
            return fn
        return functools.partial(inner, *args, **keywords)
    if not isinstance(fn, types.FunctionType):
        return fn
    defaults = tuple(swap(d) for d in fn.__defaults__) if fn.__defaults__ else fn.__defaults__
    kwdefaults = {k: swap(v) for k, v in fn.__kwdefaults__.items()} if fn.__kwdefaults__ else fn.__kwdefaults__
    cells = fn.__closure__ or ()
    closure = tuple(_rebound_cell(cell, swap) for cell in cells)
    changed = (
        any(a is not b for a, b in zip(defaults or (), fn.__defaults__ or (), strict=True))
        or any(kwdefaults[k] is not v for k, v in (fn.__kwdefaults__ or {}).items())  # type: ignore[index]
        or any(a is not b for a, b in zip(closure, cells, strict=True))
    )
    if not changed:
        return fn
    rebuilt = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, closure or None)
    rebuilt.__kwdefaults__ = kwdefaults
    rebuilt.__dict__.update(fn.__dict__)
    return functools.update_wrapper(rebuilt, fn, assigned=("__module__", "__qualname__", "__doc__"), updated=())


def _rebound_cell(cell: types.CellType, swap: Callable[[Any], Any]) -> types.CellType:
    """``cell`` itself, or a new cell holding the copy of what it holds (an empty cell stays as it is)."""
    try:
        value = cell.cell_contents
    except ValueError:
        return cell
    new = swap(value)
    return cell if new is value else types.CellType(new)


def swap_tensors(module: nn.Module, make: Callable[[Tensor], Tensor]) -> dict[tuple[int, str, str], Tensor]:
    """Replace every parameter and buffer of ``module`` by ``make(tensor)`` (one replacement per shared tensor).

    Parameters stay ``nn.Parameter`` with their ``requires_grad``. Returns the originals, keyed for
    :func:`restore_tensors`.
    """
    made: dict[int, Tensor] = {}
    originals: dict[tuple[int, str, str], Tensor] = {}
    for mod in module.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(mod, kind)
            for key, t in list(slots.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    new = make(t)
                    made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if kind == "_parameters" else new
                originals[(id(mod), kind, key)] = t
                slots[key] = made[id(t)]
    return originals


def restore_tensors(module: nn.Module, originals: dict[tuple[int, str, str], Tensor]) -> None:
    """Undo :func:`swap_tensors`."""
    for mod in module.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(mod, kind)
            for key in list(slots):
                if (id(mod), kind, key) in originals:
                    slots[key] = originals[(id(mod), kind, key)]


def _warn_in_place(module: nn.Module, error: Exception) -> None:
    warnings.warn(
        f"profiling {type(module).__name__} in place: it cannot be deep-copied ({type(error).__name__}: {error}). "
        "Parameters, buffers and gradients are restored afterwards; other side effects of training_step are not.",
        stacklevel=4,
    )


def materialize_randomly(module: nn.Module, device: torch.device) -> None:
    """Move ``module`` to ``device``, its meta tensors allocated there: floating-point parameters drawn from N(0, 0.02),
    the others and buffers zeroed (a profile's times and bytes do not depend on the values; uninitialized memory could
    hold denormals or NaNs, which slow some kernels down). Draws from the global RNG, which profiling forks."""
    meta_params = {id(p) for p in module.parameters() if p.is_meta}
    meta_buffers = {(id(m), k) for m in module.modules() for k, b in m._buffers.items() if b is not None and b.is_meta}
    module_apply(module, lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    with torch.no_grad():
        for p in module.parameters():
            if id(p) in meta_params:
                p.normal_(0.0, 0.02) if p.is_floating_point() else p.zero_()
        for m in module.modules():
            for key, b in m._buffers.items():
                if b is not None and (id(m), key) in meta_buffers:
                    b.zero_()


@contextmanager
def measured_replica(module: nn.Module, device: torch.device | None) -> Iterator[nn.Module]:
    """A real copy of ``module`` on ``device`` (see [Note: why a copy]); a model on the meta device gets random
    values (:func:`materialize_randomly`)."""
    try:
        replica = _copy(module, _shared_referents(module))
    except Exception as error:
        _warn_in_place(module, error)
        replica = None
    if replica is not None:
        if device is not None:
            materialize_randomly(replica, device)
        yield replica
        return
    saved = swap_tensors(module, lambda t: t.detach().clone())
    grads = {id(p): p.grad for p in module.parameters()}
    for p in module.parameters():
        p.grad = None
    try:
        yield module
    finally:
        restore_tensors(module, saved)
        for p in module.parameters():
            p.grad = grads.get(id(p))


@contextmanager
def fake_replica(module: nn.Module, device: torch.device, fake_mode: Any) -> Iterator[nn.Module]:
    """A copy of ``module`` whose parameters and buffers are fake tensors on ``device`` (no memory)."""
    memo = _shared_referents(module)
    for t in [*module.parameters(), *module.buffers()]:
        # Placeholders so that deepcopy copies no data; `swap_tensors` replaces them below.
        placeholder = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            nn.Parameter(placeholder, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else placeholder
        )
    try:
        replica: nn.Module | None = _copy(module, memo)
    except Exception as error:
        _warn_in_place(module, error)
        replica = None
    target = replica if replica is not None else module
    with fake_mode:
        saved = swap_tensors(target, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))
    grads = {id(p): p.grad for p in module.parameters()} if replica is None else {}
    try:
        yield target
    finally:
        if replica is None:
            restore_tensors(module, saved)
            for p in module.parameters():
                p.grad = grads.get(id(p))
