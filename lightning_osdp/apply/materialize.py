"""Materialization after sharding: a model built on the meta device gets only what its plan keeps, initialized.

[Note: initialization equal to the unsharded model's]
Lightning's sharded strategies materialize a meta model with ``to_empty`` and then call ``reset_parameters()`` on
every module that has parameters or buffers of its own, in ``modules()`` order
(``lightning.fabric.utilities.init._materialize_distributed_module``). On a sharded parameter that call draws its
random numbers as a DTensor op, which on CUDA goes through DTensor's offset-based RNG, and on CPU (gloo) draws each
rank's shard from that rank's own generator: the model is then a different model on each world size and plan
(measured: every parameter of a 2-rank ``full_shard`` MLP differs from the unsharded initialization, by up to 0.78).
So OSDP initializes module by module at full size: while a module's ``reset_parameters()`` runs, its own sharded
parameters are replaced by full-size plain tensors, and afterwards each rank keeps its shard of them. The random
numbers drawn are exactly those of the unsharded model's materialization under the same seed, on every device,
plan and world size, at the cost of one module's own parameters at full size at a time (at most the largest
module of a unit, which the step gathers whole anyway). A split Linear initializes as the Linear it replaces (one
full-size Linear, cut into its slices), not as ``k`` smaller ones. A tied parameter keeps the initialization of its
first holder in ``modules()`` order (the embedding of an embedding tied to an LM head), as the eager model, which ties
the head's weight to the embedding's after both were built, does; Lightning's ``to_empty`` unties it instead.

The guarantee is the one Lightning states for its own materialization: modules initialize through
``reset_parameters()``. A module without one keeps uninitialized memory (a warning names their types); a buffer a
module computes in ``__init__`` (a rotary-embedding table, say) must be recomputed in its ``reset_parameters()``.
Initialization written elsewhere (``self.apply(init_fn)`` in the LightningModule's ``__init__``) does not run on a
meta model: define ``init_weights(self)`` on the LightningModule instead, which OSDP calls after the modules'
``reset_parameters()``, on the sharded model (whose sharded parameters are DTensors: random initializers there draw
as DTensor ops, see above).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_osdp._compat import module_apply
from lightning_osdp.apply.split import SplitLinear

__all__ = ["assign_full", "has_meta_tensors", "materialize", "meta_parameters", "still_uninitialized"]


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Within the context, every parameter a module registers is moved to the meta device; buffers stay where they
    are made. What ``trainer.init_module(empty_init=True)`` enters under ``OSDPStrategy``.

    [Note: buffers stay real]
    Building under ``torch.device("meta")`` would make buffers meta too, and a buffer a module computes in its
    ``__init__`` (a rotary-embedding table, a causal mask) and does not recompute in ``reset_parameters()`` would be
    uninitialized memory after materialization; non-persistent ones are not in any checkpoint either, so loading
    pretrained weights would not repair them. Buffers are small next to parameters: they are built for real (in
    host memory), parameters on meta (the approach of ``accelerate.init_empty_weights``). A parameter's tensor is
    made before it is registered (``nn.Parameter(torch.empty(...))``): uninitialized memory, never written, freed at
    once; initializers called in ``__init__`` after registration run on meta and cost nothing.
    """
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        param = self._parameters.get(name)
        if param is not None and not param.is_meta:
            moved = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            self._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (a model built with
    ``trainer.init_module(empty_init=True)`` or under ``torch.device("meta")``)."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def assign_full(target: Tensor, value: Tensor) -> None:
    """Write the full-size ``value`` into ``target``: all of it for a plain tensor, this rank's shard of it for a
    DTensor (the shard its placements give, computed locally: no collective)."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            local = distribute_tensor(
                value.to(device=target.device, dtype=target.dtype),
                target.device_mesh,
                target.placements,
                src_data_rank=None,
            ).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(value)


@contextmanager
def _at_full_size(module: nn.Module) -> Iterator[None]:
    """Within the context, ``module``'s own sharded parameters are full-size plain tensors; on exit each rank keeps
    its shard of what they then hold (see [Note: initialization equal to the unsharded model's])."""
    sharded = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    full = {n: torch.empty(p.shape, dtype=p.dtype, device=p.device) for n, p in sharded.items()}
    for name, tensor in full.items():
        module._parameters[name] = nn.Parameter(tensor, requires_grad=sharded[name].requires_grad)
    try:
        yield
    finally:
        for name, param in sharded.items():
            value = module._parameters[name]
            module._parameters[name] = param
            assert value is not None
            assign_full(param, value)


def _reset_split(split: SplitLinear) -> None:
    """Initialize the slices as the unsplit Linear: one full-size ``nn.Linear`` drawn, cut along its rows."""
    first = split.slices[0]
    assert isinstance(first, nn.Linear)
    device = first.weight.device
    linear = nn.Linear(
        split.in_features, split.out_features, bias=first.bias is not None, device=device, dtype=first.weight.dtype
    )
    rows = torch.tensor_split(torch.arange(split.out_features, device=device), split.k)
    for part, index in zip(split.slices, rows, strict=True):
        assert isinstance(part, nn.Linear)
        assign_full(part.weight, linear.weight.detach()[index])
        if part.bias is not None and linear.bias is not None:
            assign_full(part.bias, linear.bias.detach()[index])


def materialize(module: nn.Module, device: torch.device) -> list[str]:
    """Allocate ``module``'s meta tensors on ``device`` (each rank only its shards of sharded parameters) and initialize
    them as the unsharded model would be (see [Note: initialization equal to the unsharded model's]): every module
    with a meta tensor of its own runs its ``reset_parameters()``. Returns the names of those without one (left
    uninitialized: :func:`still_uninitialized` says which of them pretrained weights did not cover).

    Real tensors (the buffers :func:`meta_parameters` keeps, see [Note: buffers stay real]) are moved to ``device``
    as they are. Call it after the plan is applied (FSDP2 has sharded the sharded units) and before DDP wraps the
    model. A root module's ``init_weights()``, when it defines one, runs last.
    """
    on_meta = {
        id(m)
        for m in module.modules()
        if any(t.is_meta for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)))
    }
    module_apply(module, lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    inside_splits = {id(m) for split in module.modules() if isinstance(split, SplitLinear) for m in split.slices}
    initialized: set[int] = set()  # parameters a module's reset_parameters() already drew (tied ones: once)
    uninitialized: list[str] = []
    for name, submodule in module.named_modules():
        if id(submodule) in inside_splits:
            continue  # initialized by their SplitLinear
        if isinstance(submodule, SplitLinear):
            if any(id(part) in on_meta for part in submodule.slices):
                _reset_split(submodule)
            continue
        if id(submodule) not in on_meta:
            continue  # nothing of its own was on meta (real buffers, or a module built for real)
        reset = getattr(submodule, "reset_parameters", None)
        if reset is None and type(submodule).__module__.startswith("torch.nn."):
            # torch's own MultiheadAttention and Transformer spell it with an underscore.
            reset = getattr(submodule, "_reset_parameters", None)
        own = dict(submodule.named_parameters(recurse=False))
        tied = {n: p for n, p in own.items() if id(p) in initialized}
        if callable(reset):
            if own and len(tied) == len(own) and not list(submodule.buffers(recurse=False)):
                continue  # all its parameters are tied to ones already initialized (an LM head, say)
            kept = {n: p.detach().clone() for n, p in tied.items()}
            with _at_full_size(submodule):
                reset()
            with torch.no_grad():
                for n, value in kept.items():  # a tied parameter keeps the first holder's initialization
                    target = own[n]
                    (target.to_local() if isinstance(target, DTensor) else target).copy_(
                        value.to_local() if isinstance(value, DTensor) else value
                    )
            initialized.update(id(p) for p in own.values())
        else:
            uninitialized.append(name)
    init_weights = getattr(module, "init_weights", None)
    if callable(init_weights):
        init_weights()
        return []  # the model's own hook answers for what it initializes
    return uninitialized


def still_uninitialized(module: nn.Module, names: list[str], missing: set[str] | None) -> list[str]:
    """Of the modules ``names`` (left uninitialized by :func:`materialize`), the types of those with a parameter or
    buffer that pretrained weights did not fill: ``missing`` are the model's state-dict keys they lacked (``None``: no
    pretrained weights were read, so all of them). A non-persistent buffer is in no checkpoint: it counts as unfilled.
    """
    state_keys = set(module.state_dict(keep_vars=True)) if missing is not None else set()
    types: list[str] = []
    for name in names:
        sub = module.get_submodule(name)
        prefix = f"{name}." if name else ""
        own = itertools.chain(sub.named_parameters(recurse=False), sub.named_buffers(recurse=False))
        keys = [prefix + k for k, _ in own]
        unfilled = missing is None or any(k not in state_keys or k in missing for k in keys)
        if unfilled and type(sub).__name__ not in types:
            types.append(type(sub).__name__)
    return types
