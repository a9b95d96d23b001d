"""One FSDP2 unit under one mode: the bytes it keeps, gathers and reduces, and the seconds it communicates.

[Note: what FSDP2 allocates per unit]
Read from ``torch/distributed/fsdp/_fully_shard`` (torch 2.13); ``ws`` is the world size, ``rows(p)`` the dim-0
size of parameter ``p`` and ``row(p)`` the elements per row.

* Sharded modes keep a padded shard of every parameter: ``ceil(rows / ws) * row`` elements (``_init_sharded_param``
  pads dim 0 so that all-gather inputs are equal). Rank 0 always holds a full-size shard, so it is the rank
  modelled; its optimizer state (``zeros_like`` of the local, unpadded shard) is the same size.
* Gathering (``foreach_all_gather``) allocates one flat output of ``ws * sum(padded shard)`` elements, copies
  the shards in, all-gathers, then copies out into one unsharded tensor per parameter (the same total). In
  forward the flat buffer is kept until the *next* unit copies out (``AllGatherState``); in backward it is
  freed right after the copy-out. On one rank there is no flat buffer: the unsharded parameters are filled from
  the shards directly (``FSDPParamGroup`` special-cases ``world_size == 1``).
* The reduction (``foreach_reduce``) allocates a reduce-scatter input of ``ws * sum(padded shard)`` of the
  trainable parameters, copies the unsharded gradients in (and drops them), then allocates the output
  (``sum(padded shard)``): the output *is* the sharded gradient the optimizer reads, one storage per unit. The
  input is kept alive until the next unit's reduction.

``no_shard`` parameters are not FSDP2's: they stay plain tensors under DDP (the executor's [Note: the replicated
part runs on DDP]), with ``gradient_as_bucket_view=True``. DDP allocates its buckets (the full trainable bytes)
once, at construction, and they live for the whole run: ``zero_grad(set_to_none=True)`` drops the ``.grad``
views, not the buckets. In backward, autograd's gradient of each parameter is copied into its bucket slot and
dropped, and the bucket is all-reduced in place. So a ``no_shard`` unit keeps ``P`` parameters and a ``P``
bucket, gathers nothing and has no reduction buffer of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_osdp.profiling.model_profile import ModelProfile, ModuleProfile

__all__ = [
    "RESHARDING_MODES",
    "SHARDED_MODES",
    "ParamSpec",
    "UnitBytes",
    "UnitTime",
    "module_params",
    "split_params",
    "unit_bytes",
]

#: Modes whose parameters are FSDP2's (sharded DTensors); ``hybrid_shard`` shards within its shard group.
SHARDED_MODES: tuple[str, ...] = ("shard_grad_op", "full_shard", "hybrid_shard")
#: Sharded modes that free the unsharded parameters after forward and gather them again for backward
#: (``reshard_after_forward=True``).
RESHARDING_MODES: tuple[str, ...] = ("full_shard", "hybrid_shard")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor as FSDP2 shards it."""

    rows: int
    row_numel: int
    itemsize: int
    trainable: bool

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def local_bytes(self, world_size: int, sharded: bool) -> int:
        """Bytes rank 0 keeps: the padded shard (sharded), or the whole tensor (replicated)."""
        if not sharded:
            return self.nbytes
        return math.ceil(self.rows / world_size) * self.row_numel * self.itemsize

    def gathered_bytes(self, world_size: int, sharded: bool) -> int:
        """Bytes of the all-gather output (padded); 0 when replicated (nothing is gathered)."""
        if not sharded:
            return 0
        return self.local_bytes(world_size, True) * world_size


def module_params(mp: ModuleProfile) -> list[ParamSpec]:
    """A module's own parameters from its profile (dtype and trainability are per module in the schema: the
    trainable ones are taken first, in order, until ``trainable_param_bytes`` is reached)."""
    if not mp.param_shapes:
        return []
    numels = [math.prod(shape) if shape else 1 for shape in mp.param_shapes]
    itemsize = mp.param_bytes // max(sum(numels), 1) or 4
    specs: list[ParamSpec] = []
    left = mp.trainable_param_bytes
    for shape, numel in zip(mp.param_shapes, numels, strict=True):
        rows = int(shape[0]) if shape else 1
        trainable = left >= numel * itemsize > 0
        if trainable:
            left -= numel * itemsize
        specs.append(ParamSpec(rows, numel // max(rows, 1), itemsize, trainable))
    return specs


def split_params(params: Sequence[ParamSpec], k: int) -> list[list[ParamSpec]]:
    """The parameters of the ``k`` slices of a split Linear: weight and bias rows by ``torch.tensor_split``."""
    slices: list[list[ParamSpec]] = [[] for _ in range(k)]
    for p in params:
        base, extra = divmod(p.rows, k)
        for i in range(k):
            rows = base + (1 if i < extra else 0)
            slices[i].append(ParamSpec(rows, p.row_numel, p.itemsize, p.trainable))
    return slices


@dataclass(frozen=True)
class UnitBytes:
    """Bytes of one unit on rank 0 under one mode (see [Note: what FSDP2 allocates per unit]).

    Attributes:
        mode: the unit's mode.
        params: parameter bytes kept between steps (padded shards, or full replicas).
        gathered: unsharded parameters while the unit is gathered (0 for ``no_shard``).
        flat: the all-gather output buffer (0 for ``no_shard``, and on one rank).
        grad: the sharded gradient (reduction output) the optimizer reads, kept into the next step (0 for
            ``no_shard``: its gradients live in ``bucket``).
        grad_full: unsharded gradients autograd produces before the reduction (or the copy into the bucket).
        reduce_input: the reduce-scatter input buffer (0 for ``no_shard``: DDP all-reduces its bucket in place).
        bucket: DDP's gradient buckets for the unit's trainable parameters (``no_shard`` only), kept all run.
        optim: optimizer state of the local shards.
        largest_local: the largest local trainable parameter (the optimizer step's temporaries scale with it).
        param_count: elements of the unit's parameters (unsharded).
        param_bytes: bytes of the unit's parameters (unsharded).
        trainable: whether any parameter has ``requires_grad`` (else there is no reduction at all).
        n_params: parameter tensors in the unit.
        n_trainable: trainable parameter tensors in the unit.
    """

    mode: str
    params: int
    gathered: int
    flat: int
    grad: int
    grad_full: int
    reduce_input: int
    optim: int
    largest_local: int
    param_count: int
    param_bytes: int
    trainable: bool
    n_params: int
    n_trainable: int = 0
    bucket: int = 0

    @property
    def sharded(self) -> bool:
        """Whether the unit is an FSDP2 group (sharded parameters, all-gather and reduction buffers)."""
        return self.mode in SHARDED_MODES

    @property
    def reshards_after_forward(self) -> bool:
        """Whether the unit frees its unsharded parameters after forward and gathers them again for backward."""
        return self.mode in RESHARDING_MODES


def unit_bytes(
    params: Sequence[ParamSpec],
    mode: str,
    world_size: int,
    *,
    optim_tensor_bytes: float,
    optim_scalar_bytes: float,
) -> UnitBytes:
    """The bytes of a unit holding ``params`` under ``mode``.

    Args:
        params: the unit's parameters (unsharded shapes).
        mode: one of :data:`~lightning_osdp.plan.MODES`.
        world_size: ranks the unit is sharded over: the world, or for ``hybrid_shard`` its shard group (its
            replicas keep the same bytes).
        optim_tensor_bytes: profiled optimizer-state bytes that scale with the parameters (for the whole,
            unsharded parameters); the local share is taken.
        optim_scalar_bytes: optimizer-state bytes kept per parameter tensor whatever its size (Adam's ``step``).
    """
    sharded = mode in SHARDED_MODES
    trainable = [p for p in params if p.trainable]
    full_trainable = sum(p.nbytes for p in trainable)
    local_trainable = sum(p.local_bytes(world_size, sharded) for p in trainable)
    share = local_trainable / full_trainable if full_trainable else 0.0
    gathered = sum(p.gathered_bytes(world_size, sharded) for p in params)
    return UnitBytes(
        mode=mode,
        params=sum(p.local_bytes(world_size, sharded) for p in params),
        gathered=gathered,
        flat=gathered if world_size > 1 else 0,
        grad=local_trainable if sharded else 0,
        grad_full=full_trainable,
        reduce_input=sum(p.gathered_bytes(world_size, sharded) for p in trainable),
        bucket=0 if sharded else full_trainable,
        optim=round(optim_tensor_bytes * share + optim_scalar_bytes),
        largest_local=max((p.local_bytes(world_size, sharded) for p in trainable), default=0),
        param_count=sum(p.numel for p in params),
        param_bytes=sum(p.nbytes for p in params),
        trainable=bool(trainable),
        n_params=len(params),
        n_trainable=len(trainable),
    )


@dataclass(frozen=True)
class UnitTime:
    """Seconds one unit adds to a step beyond the modules' own compute.

    Attributes:
        communication: its collectives (all-gathers, reduce-scatter or all-reduce).
        exposed: the part of ``communication`` not hidden behind compute.
        copies: FSDP2's own memory copies around the collectives.
        optimizer: the optimizer step over the unit's local trainable parameters.
        overhead: hooks, and the extra calls of a split operator.
        compute: forward + backward compute of the modules the unit covers (informative; counted once, in the
            model's compute).
    """

    communication: float = 0.0
    exposed: float = 0.0
    copies: float = 0.0
    optimizer: float = 0.0
    overhead: float = 0.0
    compute: float = 0.0

    @property
    def added(self) -> float:
        """What the unit adds to the step time: exposed communication, copies, optimizer, overhead."""
        return self.exposed + self.copies + self.optimizer + self.overhead

    def __add__(self, other: UnitTime) -> UnitTime:
        return UnitTime(
            self.communication + other.communication,
            self.exposed + other.exposed,
            self.copies + other.copies,
            self.optimizer + other.optimizer,
            self.overhead + other.overhead,
            self.compute + other.compute,
        )


def collective_seconds(profile: ModelProfile, op: str, nbytes: float, world_size: int) -> float:
    """One call of collective ``op`` on a buffer of ``nbytes`` (its full size) over a world of ``world_size`` ranks on
    one node, from the profile's fit (the cost model itself prices every group of a topology: ``network.py``)."""
    from lightning_osdp.cost_model.network import Network
    from lightning_osdp.topology import Topology

    topology = Topology.flat(max(world_size, 1))
    return Network(profile, topology).seconds(op, nbytes, topology.world)
