"""Apply a :class:`~lightning_osdp.plan.Plan` to a model: split operators, then FSDP2 per unit.

[Note: the wrapper root]
Lightning calls ``training_step`` on the LightningModule, never its ``forward``; an FSDP2 root placed on the
LightningModule would never see its root pre-forward hook fire ("mixed torch.Tensor and DTensor"). When
``strategy.model`` is not the LightningModule, Lightning routes ``training_step`` through ``strategy.model``'s
forward (``_ForwardRedirection``, as it does for DDP), so the executor returns a thin :class:`OSDPModule`
around the LightningModule and makes *that* the FSDP2 root.

The root is two levels: ``OSDPModule`` (``fully_shard``, no parameters of its own; it only carries the root
hooks) around ``_RootUnit`` (the root decision ``""``: the LightningModule's parameters that no other unit
claims, a positional-embedding ``nn.Parameter`` on the LightningModule, say; ``fully_shard``ed when the root
decision is sharded, left plain for DDP when it is ``no_shard``).

[Note: the replicated part runs on DDP]
FSDP2's ``replicate`` would run a ``no_shard`` unit, but its parameters are DTensors: every optimizer step pays
DTensor dispatch per parameter tensor, each unit adds hooks and copies its parameters in every forward, and every
unit all-reduces on its own. On the CPU benchmark an all-``no_shard`` plan ran ~10% slower than DDP under it, and
a plan with two of four blocks ``no_shard`` no faster than sharding all four. So ``no_shard`` parameters stay plain
tensors, and ``torch.nn.parallel.DistributedDataParallel`` all-reduces their gradients in buckets during backward,
exactly as Lightning's DDP strategy does (gradients as bucket views: no second copy of them):

* a plan that shards nothing is DDP over the LightningModule (:class:`ReplicatedModule` around it);
* a mixed plan ``fully_shard``s its sharded units with the plain parameters passed as ``ignored_params`` (the
  root too), and DDP wraps the FSDP2 root with the DTensor parameters on its ignore list
  (:class:`ReplicatedModule` around :class:`OSDPModule`). FSDP2 reduces its units' gradients in its own hooks,
  DDP the rest; neither touches the other's parameters;
* a plan with no trainable ``no_shard`` parameter is the FSDP2 root alone (:class:`OSDPModule`).

Which modules form one FSDP2 group (tied parameters, split slices) is decided in ``lightning_osdp/grouping.py``,
for the executor and the cost model alike.

[Note: units on two meshes]
``full_shard`` and ``shard_grad_op`` units are ``fully_shard``ed on the 1-D world mesh, ``hybrid_shard`` units on the
2-D mesh ``(replicate, shard)`` (FSDP2 reads a 2-D mesh as HSDP: ``Shard(0)`` along the shard dim, ``Replicate``
along the other; its reduction reduce-scatters within the shard group and all-reduces the result across the
replicate group). FSDP2 keeps the mesh per parameter group (``FSDPParamGroup.mesh_info``), and the root's lazy
init only collects the groups under it: units on the two meshes live under one root, which stays on the world mesh
(checked with gloo on 4 processes as 2 nodes of 2: losses and parameters match DDP, ``tests/test_hybrid.py``). DDP
still reduces the plain ``no_shard`` parameters over the world, and ignores the DTensors of both meshes.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_osdp._compat import ddp_ignore_parameters
from lightning_osdp.apply.buffers import BufferBroadcast
from lightning_osdp.apply.materialize import has_meta_tensors, materialize
from lightning_osdp.apply.recompute import recompute_modules
from lightning_osdp.apply.split import split_linear
from lightning_osdp.comm import ReleasingAllGather, reduce_scatter_comm, releases_all_gather_after_forward
from lightning_osdp.grouping import ROOT, CommunicationUnit, communication_units, tied_holders
from lightning_osdp.plan import Plan, PlanError

__all__ = [
    "OSDPModule",
    "ReplicatedModule",
    "Unit",
    "applied_root",
    "apply_plan",
    "no_gradient_sync",
    "plan_units",
]


class _RootUnit(nn.Module):
    """Holds the LightningModule; its FSDP2 unit is the plan's root decision."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class OSDPModule(nn.Module):
    """The FSDP2 root around a LightningModule (see [Note: the wrapper root]). ``.module`` is the model,
    ``.plan`` the plan applied to it."""

    def __init__(self, module: nn.Module, plan: Plan) -> None:
        super().__init__()
        self.root_unit = _RootUnit(module)
        self.plan = plan
        #: Rank 0's buffers broadcast before training forwards, when no DDP does it (see ``apply/buffers.py``).
        self.buffer_broadcast: BufferBroadcast | None = None
        #: Modules of a meta model that materialization left uninitialized (no ``reset_parameters()``).
        self.uninitialized: list[str] = []

    @property
    def module(self) -> nn.Module:
        return self.root_unit.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.root_unit(*args, **kwargs)


class ReplicatedModule(DistributedDataParallel):
    """PyTorch's DDP over the plain (``no_shard``) parameters of a plan (see [Note: the replicated part runs on
    DDP]). ``.module`` is what it wraps: the model when the plan shards nothing, else the :class:`OSDPModule`
    whose DTensor parameters it ignores. ``.plan`` is the plan applied."""

    def __init__(
        self, module: nn.Module, plan: Plan, mesh: DeviceMesh, *, find_unused_parameters: bool = False
    ) -> None:
        device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
        sharded = [n for n, p in module.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)]
        if sharded:
            ddp_ignore_parameters(module, sharded)
        # Gradients as views into the communication buckets: no second copy of them (the cost model counts one).
        super().__init__(
            module,
            device_ids=device_ids,
            process_group=mesh.get_group(),
            gradient_as_bucket_view=True,
            find_unused_parameters=find_unused_parameters,
        )
        self.plan = plan
        #: Modules of a meta model that materialization left uninitialized (no ``reset_parameters()``).
        self.uninitialized: list[str] = []

    @property
    def sharded(self) -> OSDPModule | None:
        """The FSDP2 root of a mixed plan's sharded units; ``None`` when the plan shards nothing."""
        return self.module if isinstance(self.module, OSDPModule) else None


#: The executor's name for a communication unit (see ``lightning_osdp/grouping.py``).
Unit = CommunicationUnit


def plan_units(module: nn.Module, plan: Plan) -> list[CommunicationUnit]:
    """Validate ``plan`` against ``module`` and return its sharded and replicated communication units but the root's,
    deepest first (the order to apply them).

    The units are :func:`~lightning_osdp.grouping.communication_units` of the plan and the model's tied
    parameters: splits expanded (a ``split=k`` decision on ``fc`` yields units ``fc.slices.0`` ...
    ``fc.slices.{k-1}``), decisions on holders of a tied parameter merged into one list group. Raises
    :class:`PlanError` for unknown names, illegal splits and inconsistent tied parameters.
    """
    plan.validate(module)
    units = communication_units(plan.decisions, tied_holders(module))
    return _bottom_up([u for u in units if u.names != (ROOT,)])


#: The attribute of a module ``apply_plan`` sharded that holds its root (a plain attribute, not a submodule: the root
#: holds the module, the module must not hold the root).
_ROOT_ATTRIBUTE = "_osdp_root"


def applied_root(module: nn.Module, plan: Plan | None = None) -> OSDPModule | ReplicatedModule | None:
    """The root an earlier :func:`apply_plan` made of ``module`` (``None``: not sharded yet). FSDP2 shards a module
    once: when ``plan`` is given and differs from the one applied, a :class:`PlanError` says so."""
    root: OSDPModule | ReplicatedModule | None = getattr(module, _ROOT_ATTRIBUTE, None)
    if root is not None and plan is not None and plan.decisions != root.plan.decisions:
        raise PlanError(
            "this LightningModule is already sharded under another plan (by an earlier fit); FSDP2 shards a "
            "module once: build a fresh instance (and load a checkpoint into it) to train under a new plan"
        )
    return root


def apply_plan(
    module: nn.Module,
    plan: Plan,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    hybrid_mesh: DeviceMesh | None = None,
    find_unused_parameters: bool = False,
    device: torch.device | None = None,
) -> OSDPModule | ReplicatedModule:
    """Shard ``module`` in place as ``plan`` says and return the module to train: the FSDP2 root
    :class:`OSDPModule` around it, within a :class:`ReplicatedModule` (DDP) when some trainable parameters are
    ``no_shard`` (see [Note: the replicated part runs on DDP]).

    Args:
        module: the model (a LightningModule, or any ``nn.Module``); modules named in ``plan`` with
            ``split > 1`` are replaced by :class:`~lightning_osdp.split.SplitLinear`.
        plan: the decisions; validated first, nothing is modified when it is invalid.
        mesh: the 1-D data-parallel device mesh.
        mp_policy: FSDP2 mixed-precision policy for every unit (default: none; Lightning's precision plugin
            casts).
        hybrid_mesh: the 2-D mesh ``(replicate, shard)`` of the ``hybrid_shard`` units (see [Note: units on two
            meshes] and ``lightning_osdp/topology.py``); needed only when the plan has such units.
        find_unused_parameters: DDP's option of the same name for the replicated part: needed when a step's backward
            leaves some replicated parameters without a gradient (``toggle_optimizer`` in manual optimization, a
            branch not taken); FSDP2's units need nothing (a unit that got no gradient reduces nothing).
        device: where a model with parameters on the meta device is materialized once sharded (each rank allocates
            its shards, and replicated parameters whole: ``apply/materialize.py``); needed only for such a model.
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_plan expects a 1-D data-parallel mesh, got {mesh}")
    if any(d.mode == "hybrid_shard" for d in plan.decisions.values()):
        if hybrid_mesh is None:
            raise PlanError(
                "the plan has hybrid_shard decisions, which shard within a group of ranks and replicate across the "
                "groups: pass apply_plan(..., hybrid_mesh=...) a 2-D DeviceMesh with dims ('replicate', 'shard') "
                "(OSDPStrategy builds it from the nodes and its shard_group_size)"
            )
        if hybrid_mesh.ndim != 2 or hybrid_mesh.size() != mesh.size():
            raise ValueError(
                f"apply_plan expects hybrid_mesh to be a 2-D mesh (replicate, shard) over the {mesh.size()} ranks of "
                f"mesh, got {hybrid_mesh}"
            )
    units = plan_units(module, plan)
    meta = has_meta_tensors(module)
    if meta and device is None:
        raise ValueError(
            "apply_plan(..., device=...) is needed for a model on the meta device: where to materialize it"
        )
    if all(d.mode == "no_shard" for d in plan.decisions.values()) and not any(
        p.requires_grad for p in module.parameters()
    ):
        # DDP refuses such a module in its constructor; say why in the plan's terms, before anything is modified.
        raise PlanError(
            "the plan replicates the whole model (every decision no_shard, which runs on DDP), but the model has no "
            "trainable parameters (none has requires_grad=True), so there is nothing for DDP to synchronise: "
            "unfreeze the parameters to train, or shard a unit to run the frozen model on several ranks"
        )
    for name, decision in plan.decisions.items():
        if decision.split > 1:
            split_linear(module, name, decision.split)
    # Before FSDP2 and DDP: their hooks then sit around the checkpointed forward (see apply/recompute.py).
    recompute_modules(module, {name: d.recompute for name, d in plan.decisions.items() if d.recomputes})
    if all(d.mode == "no_shard" for d in plan.decisions.values()):
        uninitialized = materialize(module, device) if meta and device is not None else []
        replicated = ReplicatedModule(module, plan, mesh, find_unused_parameters=find_unused_parameters)
        replicated.uninitialized = uninitialized
        object.__setattr__(module, _ROOT_ATTRIBUTE, replicated)
        return replicated
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    # Bottom-up: a no_shard unit's parameters (those no deeper sharded unit took) stay plain, and every later
    # fully_shard is told to leave them to DDP.
    plain: set[nn.Parameter] = set()
    reduce_scatter = reduce_scatter_comm(mesh.get_group())
    release = releases_all_gather_after_forward(mesh.device_type)

    def shard(target: nn.Module, others: list[nn.Module], mode: str, *, releases: bool = True) -> None:
        fully_shard(
            [target, *others] if others else target,
            reshard_after_forward=mode in ("full_shard", "hybrid_shard"),
            ignored_params=set(plain),
            **{**kwargs, **({"mesh": hybrid_mesh} if mode == "hybrid_shard" else {})},
        )
        if reduce_scatter is not None:
            target.set_custom_reduce_scatter(reduce_scatter)  # type: ignore[operator]
        if release and releases:
            all_gather = ReleasingAllGather()
            target.set_custom_all_gather(all_gather)  # type: ignore[operator]
            for module_ in (target, *others):
                module_.register_forward_hook(lambda *_: all_gather.release())

    for unit in units:
        targets = [module.get_submodule(n) for n in unit.names]
        if unit.mode == "no_shard":
            plain.update(p for t in targets for p in t.parameters() if not isinstance(p, DTensor))
        else:
            shard(targets[0], targets[1:], unit.mode)
    root = OSDPModule(module, plan)
    root_mode = plan.decisions[ROOT].mode if ROOT in plan.decisions else "no_shard"
    if root_mode == "no_shard":
        plain.update(p for p in module.parameters() if not isinstance(p, DTensor))
    else:
        # Its forward is the whole step: it ends with the root's, which frees the buffer anyway.
        shard(root.root_unit, [], root_mode, releases=False)
    shard(root, [], "shard_grad_op", releases=False)  # parameter-less: only the root hooks
    uninitialized = materialize(module, device) if meta and device is not None else []
    if any(p.requires_grad for p in plain):
        # DDP broadcasts the buffers of the whole model.
        replicated = ReplicatedModule(root, plan, mesh, find_unused_parameters=find_unused_parameters)
        replicated.uninitialized = uninitialized
        object.__setattr__(module, _ROOT_ATTRIBUTE, replicated)
        return replicated
    root.buffer_broadcast = BufferBroadcast(module, mesh.get_group())
    root.buffer_broadcast.attach(root)
    root.uninitialized = uninitialized
    object.__setattr__(module, _ROOT_ATTRIBUTE, root)
    return root


@contextmanager
def no_gradient_sync(model: OSDPModule | ReplicatedModule) -> Generator[None, None, None]:
    """No gradient reduction while the context is open (accumulating micro-batches): DDP's ``no_sync`` for the
    replicated part, FSDP2's ``set_requires_gradient_sync(False)`` for the sharded units; both keep unsharded
    gradients until the last micro-batch. As under DDP, the forwards run in it do not broadcast buffers afterwards."""
    sharded = model.sharded if isinstance(model, ReplicatedModule) else model
    broadcast = sharded.buffer_broadcast if sharded is not None else None
    with model.no_sync() if isinstance(model, ReplicatedModule) else nullcontext():
        if sharded is not None:
            sharded.set_requires_gradient_sync(False)  # type: ignore[operator]
        if broadcast is not None:
            broadcast.require_backward_grad_sync = False
        try:
            yield
        finally:
            if sharded is not None:
                sharded.set_requires_gradient_sync(True)  # type: ignore[operator]
            if broadcast is not None:
                broadcast.require_backward_grad_sync = True


def _bottom_up(units: Sequence[CommunicationUnit]) -> list[CommunicationUnit]:
    """Order units so that every unit comes after all units nested inside any of its modules."""
    remaining = list(units)
    ordered: list[CommunicationUnit] = []
    while remaining:
        ready = [
            u
            for u in remaining
            if not any(v is not u and any(n.startswith(m + ".") for n in v.names for m in u.names) for v in remaining)
        ]
        ready.sort(key=lambda u: (-u.depth, u.names))
        ordered.extend(ready)
        remaining = [u for u in remaining if u not in ready]
    return ordered
