"""How a plan executes, as the cost model sees it: global units, segments of units, and free modules.

[Note: the execution structure]
Walking the modules in forward order (depth first, children in the order they first ran), a plan cuts the
model into:

* **global units**: the root unit ``""`` (parameters no other decision covers; FSDP2's root encloses the whole
  step) and every list group of tied parameters (``fully_shard([wte, lm_head])``, gathered from the first
  holder's forward to the last holder's, so in practice for the whole forward and backward). Their
  parameters are gathered for the whole step.
* **segments**: each top-level decided module (its nearest decided ancestor is the root) with its subtree, in
  forward order. Decisions nested inside (a Linear of a block, or the ``k`` slices of a split Linear) are the
  segment's inner units, simulated event by event.
* **free runs**: modules outside every segment (embeddings, final norm, containers): their activations and
  compute, with no unit events of their own (their parameters are in a global unit).

[Note: modules called from another subtree]
The walk follows the module tree, and a module runs inside its parent's forward in the tree's order. Not every
module does: an adapter attached to a backbone's block by a forward hook is registered beside the backbone
(``model.adapters.0``) and runs inside it, between two of its blocks. Walked after the backbone (its first run is
after the backbone's), its activations would be counted from the backbone's end in forward, and freed before the
backbone's backward in backward, where they are alive until the backward reaches the block it ran after: a frozen
GPT-2 with hooked adapters measured 4-8% above the walk. The profile records each module's caller (the innermost
module running when it was first called; for a container, its first descendant's): a child whose caller lies in a
sibling's subtree is walked just before that sibling instead. Its activations are then counted from before the
sibling's forward to after its backward, a bound above what is alive at each instant (by the part of them made
later, or freed earlier, than the walk says), never below. A module called from several places (a rotary embedding
the blocks share) is placed by its first call: before the blocks, its activations counted through all of them.

Everything about one segment depends only on that segment's decisions; what passes between segments is a few
buffers (a pending all-gather output, a prefetched one, a pending reduce-scatter input). That is what lets the
solver choose each segment's option independently and still model the chain exactly (see ``timeline.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_osdp.cost_model.config import ResolvedConfig
from lightning_osdp.cost_model.network import Network, as_topology
from lightning_osdp.cost_model.units import (
    ParamSpec,
    UnitBytes,
    UnitTime,
    module_params,
    split_params,
    unit_bytes,
)
from lightning_osdp.grouping import ROOT, communication_units, covering_decision, slice_name
from lightning_osdp.plan import MODES, Decision, Plan
from lightning_osdp.profiling.model_profile import LossMemory, ModelProfile, ModuleProfile
from lightning_osdp.topology import Topology

__all__ = [
    "FreeRun",
    "Layout",
    "LocalUnit",
    "ModelInfo",
    "Node",
    "OutsideModules",
    "Segment",
    "Structure",
    "build_segment",
    "build_structure",
    "free_run",
    "global_unit",
    "layout",
]


class ModelInfo:
    """What the cost model reads from a profile, indexed once: forward order, tree, parameters per module.

    ``world_size`` is the ranks (on one node, or the profile's ranks per node: see
    :func:`~lightning_osdp.cost_model.network.as_topology`) or a :class:`~lightning_osdp.topology.Topology`."""

    def __init__(self, profile: ModelProfile, world_size: int | Topology, config: ResolvedConfig) -> None:
        if not isinstance(world_size, Topology) and world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if ROOT not in profile.modules:
            raise ValueError("the profile has no root module ''")
        self.profile = profile
        self.topology = as_topology(world_size, profile)
        self.world_size = self.topology.world_size
        self.network = Network(profile, self.topology)
        self.config = config
        #: Micro-batches per optimizer step: each runs every module's forward and backward, and so its time (see
        #: ``timeline.py`` [Note: gradient accumulation]).
        self.micro_batches = max(profile.gradient_accumulation, 1)
        #: Backward passes per micro-batch (a manually optimized GAN's: 2): DDP all-reduces its buckets in each.
        self.backward_passes = max(profile.step_calls.backwards, 1) if profile.step_calls is not None else 1
        self.modules = _repeated(profile.modules, self.micro_batches)
        ran: dict[str, int] = {}
        for i, name in enumerate(profile.forward_order):
            ran.setdefault(name, i)
        registration = {name: i for i, name in enumerate(profile.modules)}
        big = len(registration) + len(ran) + 1
        # A container whose own forward never runs (an ``nn.ModuleList`` of blocks) runs when its first descendant
        # does: without this, the blocks would sort after the head that runs after them.
        first_run: dict[str, int] = {}
        caller: dict[str, str | None] = {}  # its own, or that of its descendant that ran first
        for name in reversed(list(profile.modules)):
            below = [c for c in profile.modules[name].children if c in first_run]
            first_run[name] = min([ran.get(name, big), *(first_run[c] for c in below)])
            earliest = min(below, key=lambda c: first_run[c], default=None)
            own = profile.modules[name].caller if name in ran else None
            caller[name] = own if own is not None or earliest is None else caller[earliest]

        def children(parent: str, mp: ModuleProfile) -> list[str]:
            # Children in the order they (or their first descendant) first ran; modules never seen running after
            # those, as registered; a child called from inside a sibling's subtree, just before that sibling (see
            # [Note: modules called from another subtree]).
            kids = [c for c in mp.children if c in profile.modules]

            def key(name: str) -> tuple[int, int, int, int]:
                first, by = first_run[name], caller[name]
                if by is not None and by != parent:
                    for sibling in kids:
                        if sibling != name and (by == sibling or by.startswith(sibling + ".")):
                            return (first_run[sibling], 0, first, registration[name])
                return (first, 1, first, registration[name])

            return sorted(kids, key=key)

        self.children: dict[str, list[str]] = {name: children(name, mp) for name, mp in profile.modules.items()}
        self.order: list[str] = []
        stack = [ROOT]
        while stack:
            name = stack.pop()
            self.order.append(name)
            stack.extend(reversed(self.children[name]))
        self.pos = {name: i for i, name in enumerate(self.order)}
        # An embedding tied to an output Linear has its weight cast by autocast there (units.py [Note: bytes per dtype
        # under FSDP2's mixed precision]).
        tied_names = {n for group in profile.tied for n in group}
        self.params: dict[str, list[ParamSpec]] = {
            n: module_params(
                mp,
                compute_itemsize=config.param_itemsize,
                reduce_itemsize=config.reduce_itemsize,
                cast_by_autocast=True if n in tied_names else None,
            )
            for n, mp in profile.modules.items()
        }
        #: DDP's bucket as this model fills it: every trainable byte when they take less than one bucket, since a
        #: step all-reduces at least once (see :func:`unit_time`).
        trainable = sum(mp.trainable_param_bytes for mp in profile.modules.values())
        self.ddp_bucket_bytes = max(min(config.ddp_bucket_bytes, trainable), 1)
        self.optim_tensor = {n: float(mp.optim_state_bytes) for n, mp in profile.modules.items()}
        self.optim_scalar = {n: float(getattr(mp, "optim_scalar_bytes", 0) or 0) for n, mp in profile.modules.items()}
        self.leaves = [n for n in self.order if not self.children[n]]
        prev_out: dict[str, int] = {}
        last = 0
        for n in self.leaves:
            prev_out[n] = last
            last = profile.modules[n].output_bytes
        self.input_bytes = prev_out
        # Units whose first module runs no later than the first module with trainable parameters take the model's
        # raw input, which needs no gradient: FSDP2 registers no post-backward hook for them, and their gradients
        # are reduced in the root's final callback, after the whole backward.
        trainable_pos = [self.pos[n] for n, mp in profile.modules.items() if mp.trainable_param_bytes > 0]
        self.first_trainable_pos = min(trainable_pos, default=len(self.order))
        self.tied = [list(group) for group in profile.tied]
        #: per module, the gradient bytes its backward sums into a tied parameter's existing gradient (see
        #: ``Node.grad_sum``): the holder that runs first in forward, and so last in backward
        self.grad_sum: dict[str, int] = {}
        for group in self.tied:
            holders = [h for h in group if h in self.modules]
            if len(holders) < 2:
                continue
            summing = min(holders, key=lambda h: self.pos[h])
            tied_bytes = max(self.modules[h].param_bytes for h in holders)  # counted at its first holder
            self.grad_sum[summing] = self.grad_sum.get(summing, 0) + 2 * tied_bytes

    def subtree(self, name: str) -> list[str]:
        """``name`` and its descendants, in forward order."""
        out: list[str] = []
        stack = [name]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(self.children[n]))
        return out

    def shard_ranks(self, mode: str) -> int:
        """Ranks a unit of ``mode`` shards its parameters over: its shard group for ``hybrid_shard``, else the world
        (a ``no_shard`` unit shards nothing; the figure is then unused)."""
        return self.topology.shard_size if mode == "hybrid_shard" else self.world_size

    def is_descendant(self, name: str, ancestor: str) -> bool:
        return ancestor == ROOT or name.startswith(ancestor + ".")

    def splittable(self, name: str) -> int:
        """The largest split factor module ``name`` admits (1 when it cannot be split): an ``nn.Linear`` that ran,
        owns its weight (not a tied holder) and has no children; slices are cut along ``out_features``."""
        mp = self.modules.get(name)
        if mp is None or mp.type != "Linear" or self.children[name] or not mp.param_shapes:
            return 1
        if any(name in group for group in self.tied):
            return 1
        if mp.fwd_seconds <= 0 and mp.output_bytes <= 0 and mp.fwd_flops <= 0:
            return 1  # never called as a module (MultiheadAttention's out_proj): no hooks would fire
        weights = [s for s in mp.param_shapes if len(s) == 2]
        if len(weights) != 1:
            return 1
        return int(weights[0][0])


@dataclass
class Node:
    """A module in a segment's forward, with what the model counts for it.

    Attributes:
        name: the module.
        unit: the index of the unit whose decision is this module (``None``: no decision here).
        act: bytes its own forward code saves for backward.
        out: bytes of its output.
        inp: bytes of its input, as the previous module's output (the backward's transient input gradient).
        grad: bytes of the gradients of its own parameters.
        owner: the index of the unit owning its parameters.
        fwd, bwd: its own forward and backward seconds.
        recompute: its decision recomputes it (activation checkpointing), wholly or selectively.
        selective: under selective recomputation, what its subtree's forward keeps for backward beyond its inputs
            (``ModuleProfile.selective_kept_bytes``: the kept operators' outputs); ``None``: full recomputation.
        selective_forward: under selective recomputation, the largest live bytes its forward adds
            (``selective_forward_bytes``; ``None``: not measured).
        selective_seconds: under selective recomputation, the seconds its replay runs in backward
            (``selective_replay_seconds``).
        fwd_peak: run without recomputation, the largest live bytes its forward adds, saved tensors, temporaries and
            output included (``ModuleProfile.forward_peak_bytes``, measured for blocks; ``None``: not measured).
        full_replay: under full recomputation, the seconds its replay runs in backward
            (``ModuleProfile.recompute_replay_seconds``: its forward up to its last saved tensor); ``None``: not
            measured, the whole subtree's forward.
        kept: under recomputation, the bytes of its inputs the checkpoint keeps (``ModuleProfile.input_bytes``).
        kept_saved: the part of ``kept`` its own subtree saves again when it recomputes (``input_saved_bytes``).
        recompute_forward: under recomputation, the largest live bytes its forward adds, output included
            (``ModuleProfile.recompute_forward_bytes``, measured; ``None``: not measured).
        grad_sum: transient bytes of its backward beyond its gradients: the holder of a tied parameter whose backward
            runs last adds its gradient to the one the other holders produced, out of place (the existing sum, the
            new gradient and their sum alive at once: twice the parameter beyond the one gradient counted).
        bwd_extra: what its own backward was measured to hold beyond its output's gradient and its parameters'
            gradients (``ModuleProfile.backward_transient_bytes``; 0: not measured): the walk's transient is the
            larger of it and ``inp``.
        children: the modules it calls, in forward order.
    """

    name: str
    unit: int | None
    act: int
    out: int
    inp: int
    grad: int
    owner: int | None
    fwd: float
    bwd: float
    children: list[Node] = field(default_factory=list)
    recompute: bool = False
    kept: int = 0
    kept_saved: int = 0
    recompute_forward: int | None = None
    grad_sum: int = 0
    selective: int | None = None
    selective_forward: int | None = None
    selective_seconds: float = 0.0
    full_replay: float | None = None
    fwd_peak: int | None = None
    bwd_extra: int = 0

    def saved(self) -> int:
        """Bytes a forward of this subtree saves for backward (a recomputed descendant keeps only its inputs and,
        selectively recomputed, its kept operators' outputs)."""
        return self.act + sum(c.checkpoint_kept() if c.recompute else c.saved() for c in self.children)

    def checkpoint_kept(self) -> int:
        """Under recomputation, what its forward keeps for backward: its inputs, and the kept operators' outputs
        when selective."""
        return self.kept + (self.selective or 0)

    def replay_seconds(self) -> float:
        """Under recomputation, the forward seconds run again in backward: the replay of a selective one, else the
        subtree's forward up to its last saved tensor (the whole forward when that was not measured)."""
        if self.selective is not None:
            return self.selective_seconds
        return self.forward_seconds() if self.full_replay is None else self.full_replay

    def forward_seconds(self) -> float:
        """Forward seconds of this subtree: what recomputing it costs."""
        return self.fwd + sum(c.forward_seconds() for c in self.children)


@dataclass(frozen=True)
class OutsideModules:
    """What a step holds outside every module's forward, from the profile (see ``timeline.py`` [Note: the loss in
    the timeline]).

    Attributes:
        loss: the measured memory of the loss region (``None``: a profile from before it was measured).
        correction: bytes a run measured above its plan's prediction (``ModelProfile.measured_peak_correction``).
        held_gradients: the unsharded gradients every unit holds between the micro-batches of an accumulating step
            (``timeline.py`` [Note: gradient accumulation]); 0 without accumulation.
    """

    loss: LossMemory | None = None
    correction: int = 0
    held_gradients: int = 0


@dataclass
class LocalUnit:
    """One FSDP2 unit of a segment (or a global unit) with its figures under its mode. The root unit also carries
    what the step holds outside every module (``outside``): its forward is the whole ``training_step``."""

    names: tuple[str, ...]
    decision_name: str
    mode: str
    split: int
    bytes: UnitBytes
    time: UnitTime
    deferred: bool
    outside: OutsideModules | None = None


@dataclass
class Segment:
    """One segment under one choice of decisions (see [Note: the execution structure])."""

    entry: str
    decisions: dict[str, Decision]
    root: Node
    units: list[LocalUnit]
    #: see :func:`segment_bounds` (set by :func:`build_structure`)
    bounds: tuple[int, int] = (0, 0)


@dataclass
class FreeRun:
    """Consecutive modules outside every segment."""

    nodes: list[Node]


@dataclass
class Structure:
    """A plan's execution structure: global units, then items (segments and free runs) in forward order."""

    globals: list[LocalUnit]
    items: list[Segment | FreeRun]
    compute_seconds: float
    extra_activation_bytes: int
    last_output_bytes: int
    buffer_bytes: int
    #: the largest all-gather output a global unit could leave pending (sharded whole)
    globals_bound_pending: int = 0


def _repeated(modules: dict[str, ModuleProfile], micro_batches: int) -> dict[str, ModuleProfile]:
    """``modules`` with the times of ``micro_batches`` forward and backward passes (their bytes are one's)."""
    if micro_batches == 1:
        return modules
    return {
        name: dataclasses.replace(
            mp,
            fwd_seconds=mp.fwd_seconds * micro_batches,
            bwd_seconds=mp.bwd_seconds * micro_batches,
            selective_replay_seconds=(
                None if mp.selective_replay_seconds is None else mp.selective_replay_seconds * micro_batches
            ),
            recompute_replay_seconds=(
                None if mp.recompute_replay_seconds is None else mp.recompute_replay_seconds * micro_batches
            ),
        )
        for name, mp in modules.items()
    }


def unit_time(
    info: ModelInfo, b: UnitBytes, compute: float, *, before_compute: bool = False, after_compute: bool = False
) -> UnitTime:
    """Communication, copies, optimizer and overhead seconds of a unit (see the cost model's time model).

    Each collective runs on its group of the topology (``network.py``): ``full_shard`` and ``shard_grad_op`` gather and
    reduce-scatter over the world, ``hybrid_shard`` within its shard group and then all-reduces its gradient shard
    across the replicate group, DDP all-reduces over the world.

    ``before_compute``: the unit's gathers run before any compute of the step can hide them (the root's: its
    all-gather is the step's first work, and its backward one follows the loss at once); ``after_compute``: its
    reduction runs after the whole backward (FSDP2's final callback, ``LocalUnit.deferred``), which waits for it.
    Those collectives are exposed whatever the unit's compute (``UnitTime.unoverlapped``). Collectives that compute
    hides cost that compute the share of the device their kernels hold while they run
    (``ResolvedConfig.collective_compute_share``: ``UnitTime.contention``)."""
    cfg, ws, net, topo = info.config, info.world_size, info.network, info.topology
    copy = cfg.copy_bytes_per_second
    if b.param_count == 0:
        return UnitTime(compute=compute)
    sync = cfg.collective_sync_seconds if ws > 1 else 0.0
    unoverlapped = 0.0
    micro_batches = info.micro_batches  # ``compute`` is already theirs; gathers and hooks run in each
    if b.sharded:
        group = topo.shard_group if b.mode == "hybrid_shard" else topo.world
        call_sync = sync if group.size > 1 else 0.0
        gathers = micro_batches * (2 if b.reshards_after_forward else 1)
        comm = gathers * (net.seconds("all_gather", b.flat, group) + call_sync)
        if before_compute:
            unoverlapped += comm
        # The copy-out runs on the compute stream; the all-gather copy-in and the reduce-scatter copy-in run on
        # FSDP2's side streams and hide, after the collectives, in what compute is left (config.py [Note: the
        # target's figures]; on CPU nothing overlaps).
        copies = gathers * (b.params + b.gathered) / copy
        side = gathers * b.params / copy
        if b.trainable:
            reduction = net.seconds("reduce_scatter", b.reduce_input, group) + call_sync
            copies += b.reduce_input / copy
            side += b.reduce_input / copy
            if b.mode == "hybrid_shard" and topo.replicas > 1:
                # FSDP2 all-reduces the reduce-scatter output (the sharded gradient) in place across the groups.
                reduction += net.seconds("all_reduce", b.grad, topo.replicate_group) + sync
            comm += reduction
            if after_compute:
                unoverlapped += reduction
        copies -= min(side, max(0.0, cfg.overlap * compute - (comm - unoverlapped)))
    else:
        # DDP: the unit's gradients share buckets with other no_shard units' and are all-reduced a bucket at a
        # time; the call's latency (and the ranks' synchronisation) is paid once per bucket, so a unit pays the
        # share of it its bytes fill. A model whose gradients fill less than a bucket still all-reduces once per
        # step: its bucket is what it has (``ModelInfo.ddp_bucket_bytes``), so that replicating it whole pays one
        # call. Autograd's gradients are copied into the buckets; the parameters are plain tensors (no DTensor
        # dispatch in the optimizer, no FSDP2 hooks). A step of several backward passes (manual optimization)
        # all-reduces in each: with ``find_unused_parameters`` (which such steps need) the reducer marks what a pass
        # does not reach ready with zero gradients, so every pass reduces every bucket.
        comm = 0.0
        passes = info.backward_passes
        if b.trainable and ws > 1:
            fit_bytes = net.seconds("all_reduce", b.bucket, topo.world)
            alpha = net.fit("all_reduce", topo.world).alpha_seconds
            comm = passes * (fit_bytes - alpha + (alpha + sync) * b.bucket / info.ddp_bucket_bytes)
        copies = passes * b.bucket / copy
        hidden = min(comm, cfg.overlap * compute)
        return UnitTime(
            communication=comm,
            exposed=comm - hidden,
            copies=copies,
            optimizer=b.bucket * cfg.optimizer_seconds_per_byte,
            compute=compute,
            contention=cfg.collective_compute_share * hidden,
        )
    if ws <= 1:
        comm = unoverlapped = 0.0
    hidden = min(comm - unoverlapped, cfg.overlap * compute)
    exposed = comm - hidden
    # Host work (hooks; DTensor dispatch of the optimizer) costs what the device work it overlaps does not hide.
    optimizer = b.grad * cfg.optimizer_seconds_per_byte
    dispatch = b.n_trainable * cfg.optimizer_seconds_per_tensor
    hooks = micro_batches * (cfg.unit_overhead_seconds + b.n_params * cfg.tensor_overhead_seconds)
    return UnitTime(
        communication=comm,
        exposed=exposed,
        copies=copies,
        optimizer=optimizer + max(0.0, dispatch - cfg.host_overlap * optimizer),
        overhead=max(0.0, hooks - cfg.host_overlap * compute),
        compute=compute,
        unoverlapped=unoverlapped,
        contention=cfg.collective_compute_share * hidden,
    )


def _optim_bytes(info: ModelInfo, names: Sequence[str]) -> tuple[float, float]:
    return sum(info.optim_tensor[n] for n in names), sum(info.optim_scalar[n] for n in names)


def _make_unit(
    info: ModelInfo,
    names: tuple[str, ...],
    decision_name: str,
    mode: str,
    params: list[ParamSpec],
    optim: tuple[float, float],
    compute: float,
    *,
    split: int = 1,
    deferred: bool,
) -> LocalUnit:
    b = unit_bytes(params, mode, info.shard_ranks(mode), optim_tensor_bytes=optim[0], optim_scalar_bytes=optim[1])
    time = unit_time(info, b, compute, before_compute=decision_name == ROOT, after_compute=deferred)
    return LocalUnit(names, decision_name, mode, split, b, time, deferred)


def global_unit(info: ModelInfo, name: str, holders: Sequence[str], covered: Sequence[str], mode: str) -> LocalUnit:
    """A global unit (the root, or a tied list group) covering the own parameters of ``covered``."""
    params = [p for n in covered for p in info.params[n]]
    compute = sum(info.modules[n].fwd_seconds + info.modules[n].bwd_seconds for n in covered)
    unit = _make_unit(info, tuple(holders), name, mode, params, _optim_bytes(info, covered), compute, deferred=True)
    if name == ROOT:
        profile = info.profile
        held = sum(m.grad_bytes for m in profile.modules.values()) if profile.gradient_accumulation > 1 else 0
        unit.outside = OutsideModules(profile.loss, profile.measured_peak_correction, held)
    return unit


def build_segment(
    info: ModelInfo,
    entry: str,
    decisions: Mapping[str, Decision],
    *,
    excluded: frozenset[str] = frozenset(),
) -> Segment:
    """The segment rooted at ``entry`` under ``decisions`` (names inside the subtree of ``entry``, which must be
    decided). Modules in ``excluded`` keep their parameters in a global unit (tied list groups)."""
    if entry not in decisions:
        raise ValueError(f"segment {entry!r} needs a decision on its entry module")
    builder = _SegmentBuilder(info, entry, decisions, excluded)
    return Segment(entry, dict(decisions), builder.node(entry), builder.units)


class _SegmentBuilder:
    """The units of one segment under its decisions, then its module tree with each module's unit and figures."""

    def __init__(
        self, info: ModelInfo, entry: str, decisions: Mapping[str, Decision], excluded: frozenset[str]
    ) -> None:
        self.info = info
        self.excluded = excluded
        self.decisions = decisions
        self.members = info.subtree(entry)
        self.cover = {name: covering_decision(decisions, name) for name in self.members}
        self.units: list[LocalUnit] = []
        #: decided module -> index of its unit in ``units``
        self.index: dict[str, int] = {}
        #: split module -> indices of its slices' units
        self.slice_index: dict[str, list[int]] = {}
        for dname in [n for n in self.members if n in decisions and n not in excluded]:
            if decisions[dname].split > 1:
                self._add_slices(dname, decisions[dname])
            else:
                self._add_unit(dname, decisions[dname])

    def _deferred(self, dname: str) -> bool:
        return self.info.pos[dname] <= self.info.first_trainable_pos

    def _add_unit(self, dname: str, d: Decision) -> None:
        info = self.info
        covered = [n for n in self.members if self.cover[n] == dname and n not in self.excluded]
        params = [p for n in covered for p in info.params[n]]
        if not params:
            return  # FSDP2 creates no parameter group: no hooks that gather, reduce or free anything
        compute = sum(info.modules[n].fwd_seconds + info.modules[n].bwd_seconds for n in covered)
        self.index[dname] = len(self.units)
        optim = _optim_bytes(info, covered)
        self.units.append(
            _make_unit(info, (dname,), dname, d.mode, params, optim, compute, deferred=self._deferred(dname))
        )

    def _add_slices(self, dname: str, d: Decision) -> None:
        info = self.info
        mp = info.modules[dname]
        if info.splittable(dname) < d.split:
            raise ValueError(f"module {dname!r} cannot be split {d.split} ways")
        own = info.params[dname]
        total = max(sum(p.nbytes for p in own), 1)
        tensor, scalar = info.optim_tensor[dname], info.optim_scalar[dname]
        per_tensor = scalar / max(len(own), 1)
        self.slice_index[dname] = []
        for i, sp in enumerate(split_params(own, d.split)):
            share = sum(p.nbytes for p in sp) / total
            compute = (mp.fwd_seconds + mp.bwd_seconds) * share
            optim = (tensor * share, per_tensor * len(sp))
            u = _make_unit(
                info,
                (slice_name(dname, i),),
                dname,
                d.mode,
                sp,
                optim,
                compute,
                split=d.split,
                deferred=self._deferred(dname),
            )
            # Each extra slice is one more matmul call and its hooks; torch.cat copies the output once.
            extra = info.config.split_overhead_seconds + mp.output_bytes * share / info.config.copy_bytes_per_second
            extra *= info.micro_batches
            u.time = u.time + UnitTime(overhead=extra)
            self.slice_index[dname].append(len(self.units))
            self.units.append(u)

    def node(self, name: str) -> Node:
        """Module ``name`` and its subtree: activations, output and input bytes, the gradient bytes its own
        parameters produce, the unit it opens (if decided) and the unit owning its parameters."""
        info = self.info
        mp = info.modules[name]
        if name in self.slice_index:
            return self._split_node(name)
        owner = None if name in self.excluded else self.index.get(self.cover[name])
        grad = sum(p.nbytes for p in info.params[name] if p.trainable) if owner is not None else 0
        node = Node(
            name,
            self.index.get(name) if name not in self.excluded else None,
            mp.activation_bytes,
            mp.output_bytes,
            info.input_bytes.get(name, 0),
            grad,
            owner,
            mp.fwd_seconds,
            mp.bwd_seconds,
        )
        node.children = [self.node(c) for c in info.children[name]]
        node.grad_sum = info.grad_sum.get(name, 0)
        node.bwd_extra = mp.backward_transient_bytes or 0
        node.fwd_peak = mp.forward_peak_bytes
        return self._with_recompute(node)

    def _with_recompute(self, node: Node) -> Node:
        decision = self.decisions.get(node.name)
        if decision is None or not decision.recomputes:
            return node
        mp = self.info.modules[node.name]
        # A profile from before inputs were measured: the previous module's output, saved again inside.
        kept = mp.input_bytes if mp.input_bytes is not None else self.info.input_bytes.get(node.name, 0)
        saved = mp.input_saved_bytes if mp.input_saved_bytes is not None else kept
        node.recompute, node.kept, node.kept_saved = True, kept, min(saved, kept)
        node.recompute_forward = mp.recompute_forward_bytes
        node.full_replay = mp.recompute_replay_seconds
        if decision.recompute == "selective":
            if mp.selective_kept_bytes is None or mp.selective_replay_seconds is None:
                raise ValueError(
                    f"module {node.name!r}: the plan recomputes it selectively, and the profile did not measure it so "
                    "(a profile from before version 4, or a module that is not a block: a parameter-owning child of "
                    "a ModuleList/Sequential); profile the model again, or recompute it fully (recompute='full')"
                )
            # What the policy keeps is part of what the subtree saves: never more than that.
            node.selective = min(mp.selective_kept_bytes, max(node.saved() - node.kept_saved, 0))
            node.selective_forward = mp.selective_forward_bytes
            node.selective_seconds = mp.selective_replay_seconds
        return node

    def _split_node(self, name: str) -> Node:
        """A split Linear: a parent holding the activations, with one child per slice (its unit and its share).

        The slices' outputs are kept until ``torch.cat`` joins them, and in backward the concatenated output's
        gradient is alive while every slice runs, so each slice counts the whole output. Each slice's backward also
        produces a whole input gradient, which autograd adds to the sum of those before it out of place (measured:
        the sum, the new one and their sum are alive together), so every slice but the first to run in backward (the
        last) counts three."""
        info = self.info
        mp = info.modules[name]
        k = len(self.slice_index[name])
        node = Node(name, None, mp.activation_bytes, mp.output_bytes, 0, 0, None, 0.0, 0.0)
        inp = info.input_bytes.get(name, 0)
        for i, (u, sp) in enumerate(zip(self.slice_index[name], split_params(info.params[name], k), strict=True)):
            node.children.append(
                Node(
                    slice_name(name, i),
                    u,
                    0,
                    mp.output_bytes,
                    inp if i == k - 1 else 3 * inp,
                    sum(p.nbytes for p in sp if p.trainable),
                    u,
                    mp.fwd_seconds * (1.0 / k),
                    mp.bwd_seconds * (1.0 / k),
                )
            )
        return self._with_recompute(node)


def _free_node(info: ModelInfo, name: str) -> Node:
    mp = info.modules[name]
    return Node(
        name,
        None,
        mp.activation_bytes,
        # A container's output is its last child's, whose node counts it (the model's root's: the logits, which the
        # loss region counts); its gradient is in flight at the start of the container's backward, not at the end.
        0 if info.children[name] else mp.output_bytes,
        info.input_bytes.get(name, 0),
        0,
        None,
        mp.fwd_seconds,
        mp.bwd_seconds,
        grad_sum=info.grad_sum.get(name, 0),
        bwd_extra=mp.backward_transient_bytes or 0,
    )


def list_groups(info: ModelInfo, decisions: Mapping[str, Decision]) -> list[list[str]]:
    """Decided modules the executor merges into one FSDP2 group because they hold a tied parameter (see
    ``lightning_osdp/grouping.py``), each in forward order."""
    ties = [[h for h in group if h in info.modules] for group in info.tied]
    return [
        sorted(unit.names, key=lambda n: info.pos.get(n, 0))
        for unit in communication_units(decisions, ties)
        if unit.is_list_group
    ]


@dataclass
class Layout:
    """Which modules are segments, tied list groups, the root's, or free (see [Note: the execution structure]).

    Attributes:
        segments: top-level decided modules, in forward order.
        groups: tied list groups (decided holders in different units), each global.
        group_cover: modules whose own parameters each group covers (keyed by the group's first holder).
        root_cover: modules whose own parameters the root unit covers.
        excluded: modules whose parameters a group covers (they are free modules of no segment's unit).
        items: in forward order, a segment's entry (``str``) or a free run (``list`` of module names).
    """

    segments: list[str]
    groups: list[list[str]]
    group_cover: dict[str, list[str]]
    root_cover: list[str]
    excluded: frozenset[str]
    items: list[str | list[str]]


def layout(info: ModelInfo, decisions: Mapping[str, Decision]) -> Layout:
    """The layout of ``decisions`` (which must include the root ``""``)."""
    groups = list_groups(info, decisions)
    grouped = {n for g in groups for n in g}

    def covering(name: str) -> str:
        return covering_decision(decisions, name)

    def nearest_decided_ancestor(name: str) -> str:
        return covering(name.rpartition(".")[0]) if "." in name else ROOT

    top = [
        n
        for n in info.order
        if n != ROOT and n in decisions and n not in grouped and nearest_decided_ancestor(n) == ROOT
    ]
    group_cover = {g[0]: [n for m in g for n in info.subtree(m) if covering(n) == m] for g in groups}
    excluded = frozenset(n for cov in group_cover.values() for n in cov)
    in_segment = {n for e in top for n in info.subtree(e)}
    root_cover = [n for n in info.order if n not in excluded and n not in in_segment and covering(n) == ROOT]
    items: list[str | list[str]] = []
    top_set = set(top)
    run: list[str] = []
    skip: set[str] = set()
    for n in info.order:
        if n in skip:
            continue
        if n in top_set:
            if run:
                items.append(run)
                run = []
            skip.update(info.subtree(n))
            items.append(n)
        else:
            run.append(n)
    if run:
        items.append(run)
    return Layout(top, groups, group_cover, root_cover, excluded, items)


def build_structure(info: ModelInfo, plan: Plan) -> Structure:
    """The execution structure of ``plan`` (see [Note: the execution structure])."""
    decisions = dict(plan.decisions)
    for name, d in decisions.items():
        if name not in info.modules:
            raise ValueError(f"plan names module {name!r}, which the profile does not have")
        if d.mode not in MODES:
            raise ValueError(f"module {name!r}: unknown mode {d.mode!r}")
    decisions.setdefault(ROOT, Decision("no_shard"))
    lay = layout(info, decisions)
    globals_ = [global_unit(info, ROOT, (ROOT,), lay.root_cover, decisions[ROOT].mode)]
    for name in [ROOT, *(m for g in lay.groups for m in g)]:
        if decisions[name].recomputes:
            raise ValueError(
                f"module {name!r}: the cost model predicts recomputation of segments (blocks and the modules in them), "
                "not of the root or a tied group"
            )
    for g in lay.groups:
        # communication_units refused tied decisions of different modes
        globals_.append(global_unit(info, g[0], tuple(g), lay.group_cover[g[0]], decisions[g[0]].mode))
    items: list[Segment | FreeRun] = []
    for item in lay.items:
        if isinstance(item, str):
            seg_decisions = {m: decisions[m] for m in info.subtree(item) if m in decisions}
            segment = build_segment(info, item, seg_decisions, excluded=lay.excluded)
            segment.bounds = segment_bounds(info, item, lay.excluded)
            items.append(segment)
        else:
            items.append(free_run(info, item))
    return Structure(
        globals=globals_,
        items=items,
        compute_seconds=sum(mp.fwd_seconds + mp.bwd_seconds for mp in info.modules.values()),
        extra_activation_bytes=info.profile.extra_activation_bytes,
        last_output_bytes=info.modules[info.leaves[-1]].output_bytes if info.leaves else 0,
        buffer_bytes=sum(int(getattr(mp, "buffer_bytes", 0) or 0) for mp in info.modules.values()),
        globals_bound_pending=max(
            [
                global_unit(info, ROOT, (ROOT,), lay.root_cover, "full_shard").bytes.flat,
                *(
                    global_unit(info, g[0], tuple(g), lay.group_cover[g[0]], "full_shard").bytes.flat
                    for g in lay.groups
                ),
            ]
        ),
    )


def segment_bounds(info: ModelInfo, entry: str, excluded: frozenset[str] = frozenset()) -> tuple[int, int]:
    """The largest all-gather output and reduce-scatter input any option of the segment at ``entry`` leaves
    pending: those of the whole segment as one sharded unit (bytes on rank 0)."""
    unit = build_segment(info, entry, {entry: Decision("full_shard")}, excluded=excluded).units[0]
    return unit.bytes.flat, unit.bytes.reduce_input


def free_run(info: ModelInfo, names: Sequence[str]) -> FreeRun:
    """Free modules (their parameters are in a global unit) as one run."""
    return FreeRun([_free_node(info, n) for n in names])
