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

[Note: tied parameters]
A parameter shared by two modules (embedding and LM head) must live in one FSDP2 group. When the owners fall in
different units, those units are applied as one list group ``fully_shard([a, b])`` and must agree on the mode;
a tie between a unit and its own ancestor's leftovers cannot be grouped and is reported as a plan error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_osdp.apply.split import split_linear
from lightning_osdp.comm import ReleasingAllGather, reduce_scatter_comm, releases_all_gather_after_forward
from lightning_osdp.plan import ROOT, Plan, PlanError

__all__ = [
    "OSDPModule",
    "ReplicatedModule",
    "Unit",
    "apply_plan",
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

    @property
    def module(self) -> nn.Module:
        return self.root_unit.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.root_unit(*args, **kwargs)


class ReplicatedModule(DistributedDataParallel):
    """PyTorch's DDP over the plain (``no_shard``) parameters of a plan (see [Note: the replicated part runs on
    DDP]). ``.module`` is what it wraps: the model when the plan shards nothing, else the :class:`OSDPModule`
    whose DTensor parameters it ignores. ``.plan`` is the plan applied."""

    def __init__(self, module: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
        device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
        sharded = [n for n, p in module.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)]
        if sharded:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sharded)
        # Gradients as views into the communication buckets: no second copy of them (the cost model counts one).
        super().__init__(module, device_ids=device_ids, process_group=mesh.get_group(), gradient_as_bucket_view=True)
        self.plan = plan

    @property
    def sharded(self) -> OSDPModule | None:
        """The FSDP2 root of a mixed plan's sharded units; ``None`` when the plan shards nothing."""
        return self.module if isinstance(self.module, OSDPModule) else None


@dataclass(frozen=True)
class Unit:
    """One FSDP2 group as the executor applies it: the modules (names in the model), their mode and depth."""

    names: tuple[str, ...]
    mode: str

    @property
    def depth(self) -> int:
        return min(_depth(n) for n in self.names)


def plan_units(module: nn.Module, plan: Plan) -> list[Unit]:
    """Validate ``plan`` against ``module`` and return its FSDP2 groups, deepest first (the order to apply).

    Splits are expanded (a ``split=k`` decision on ``fc`` yields units ``fc.slices.0`` ... ``fc.slices.{k-1}``)
    and units whose modules share a parameter are merged into one list group. Raises :class:`PlanError` for
    unknown names, illegal splits and inconsistent tied parameters. The root ``""`` is not among the units.
    """
    plan.validate(module)
    owners = _shared_parameter_owners(module)

    # Tied parameters: owners must fall in units that can be grouped.
    parent = {name: name for name in plan.decisions}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for param_name, mods in owners.items():
        units = sorted({plan.unit_of(m) for m in mods})
        for name in mods:
            if plan.decisions.get(name) is not None and plan.decisions[name].split > 1:
                raise PlanError(
                    f"module {name!r}: cannot split a module whose parameter {param_name!r} is shared with "
                    f"{', '.join(repr(m) for m in mods if m != name)}"
                )
        if len(units) < 2:
            continue
        for a in units:
            for b in units:
                if a != b and (a == ROOT or b.startswith(a + ".")):
                    owner_a = [m for m in mods if plan.unit_of(m) == a]
                    owner_b = [m for m in mods if plan.unit_of(m) == b]
                    raise PlanError(
                        f"tied parameter {param_name!r} is used by {owner_b[0]!r} (unit {b!r}) and by "
                        f"{owner_a[0]!r} (unit {a!r}, an ancestor of {b!r}); a shared parameter must sit in one "
                        f"unit: give {owner_a[0]!r} its own decision, or remove the decision on {b!r}"
                    )
        modes = {plan.decisions[u].mode for u in units}
        if len(modes) > 1:
            detail = ", ".join(f"{u!r}={plan.decisions[u].mode}" for u in units)
            raise PlanError(
                f"tied parameter {param_name!r} is shared by units with different modes ({detail}); "
                "units that share a parameter are one FSDP group and must take the same mode"
            )
        for u in units[1:]:
            parent[find(u)] = find(units[0])

    groups: dict[str, list[str]] = {}
    for name in plan.decisions:
        if name != ROOT:
            groups.setdefault(find(name), []).append(name)

    result: list[Unit] = []
    for members in groups.values():
        decision = plan.decisions[members[0]]
        if decision.split > 1:
            (name,) = members
            k = decision.split
            names: tuple[str, ...] = tuple(f"{name}.slices.{i}" for i in range(k))
            result.extend(Unit((n,), decision.mode) for n in names)
        else:
            result.append(Unit(tuple(sorted(members)), decision.mode))
    return _bottom_up(result)


def apply_plan(
    module: nn.Module,
    plan: Plan,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
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
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_plan expects a 1-D data-parallel mesh, got {mesh}")
    units = plan_units(module, plan)
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
    if all(d.mode == "no_shard" for d in plan.decisions.values()):
        return ReplicatedModule(module, plan, mesh)
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
            reshard_after_forward=(mode == "full_shard"),
            ignored_params=set(plain),
            **kwargs,
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
    if any(p.requires_grad for p in plain):
        return ReplicatedModule(root, plan, mesh)
    return root


def _shared_parameter_owners(module: nn.Module) -> dict[str, list[str]]:
    """Parameters registered on more than one module: first name -> the modules that hold it directly."""
    by_id: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            by_id.setdefault(id(p), [])
            if mod_name not in by_id[id(p)]:
                by_id[id(p)].append(mod_name)
            first_name.setdefault(id(p), f"{mod_name}.{p_name}" if mod_name else p_name)
    return {first_name[i]: mods for i, mods in by_id.items() if len(mods) > 1}


def _depth(name: str) -> int:
    return 0 if name == ROOT else name.count(".") + 1


def _bottom_up(units: Sequence[Unit]) -> list[Unit]:
    """Order units so that every unit comes after all units nested inside any of its modules."""
    remaining = list(units)
    ordered: list[Unit] = []
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
