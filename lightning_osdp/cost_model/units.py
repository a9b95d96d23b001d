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

[Note: bytes per dtype under FSDP2's mixed precision]
Under ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (``OSDPStrategy(mixed_precision=...)``) a parameter has
three sizes: ``storage_itemsize`` (the sharded parameter, its sharded gradient and the optimizer state: the model's
own dtype, fp32), ``itemsize`` (what is gathered and computed with: ``param_dtype``; the all-gather output and the
unsharded parameters, and the unsharded gradients autograd produces for them) and ``reduce_itemsize`` (the
reduce-scatter input, which ``foreach_reduce`` casts to ``reduce_dtype``). Without a policy all three are the
parameter's dtype. ``no_shard`` units are DDP's, whose parameters and buckets stay in the storage dtype; under the
policy the strategy runs the step under Lightning's autocast (as Lightning's FSDP strategy pairs FSDP's parameter
cast with autocast), which casts the weights a replicated matrix multiplication uses (``cast_by_autocast``) to
``param_dtype`` in each forward and keeps the copies for backward: the unit counts them with its parameters (they
exist from its forward to its backward, which covers the loss, where peaks fall). A sharded unit needs no such
copy: its parameters are gathered in ``param_dtype`` already, and what autograd keeps of them is FSDP2's unsharded
parameter, freed at reshard.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_osdp.profiling.model_profile import ModuleProfile

__all__ = [
    "NOT_CAST_BY_AUTOCAST",
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
    """One parameter tensor as FSDP2 shards it (see [Note: bytes per dtype under FSDP2's mixed precision]).

    Attributes:
        rows: dim-0 size (FSDP2 shards along it).
        row_numel: elements per row.
        itemsize: bytes per element as gathered and computed with (``param_dtype``).
        trainable: ``requires_grad``.
        storage_itemsize: bytes per element as stored: shards, sharded gradients (``None``: ``itemsize``).
        reduce_itemsize: bytes per element of the reduce-scatter input (``None``: ``itemsize``).
        cast_by_autocast: autocast casts it for a matrix multiplication when it is a plain (DDP) parameter of
            another dtype.
    """

    rows: int
    row_numel: int
    itemsize: int
    trainable: bool
    storage_itemsize: int | None = None
    reduce_itemsize: int | None = None
    cast_by_autocast: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor as computed with (and of the gradient autograd produces for it)."""
        return self.numel * self.itemsize

    @property
    def stored_nbytes(self) -> int:
        """Bytes of the whole tensor as stored."""
        return self.numel * (self.storage_itemsize or self.itemsize)

    @property
    def autocast_copy_bytes(self) -> int:
        """Bytes of the compute-dtype copy autocast keeps of it as a replicated parameter (0: none is made)."""
        stored = self.storage_itemsize or self.itemsize
        return self.nbytes if self.cast_by_autocast and self.itemsize < stored else 0

    def _padded_numel(self, world_size: int) -> int:
        return math.ceil(self.rows / world_size) * self.row_numel

    def local_bytes(self, world_size: int, sharded: bool) -> int:
        """Bytes rank 0 keeps: the padded shard (sharded), or the whole tensor (replicated), as stored."""
        if not sharded:
            return self.stored_nbytes
        return self._padded_numel(world_size) * (self.storage_itemsize or self.itemsize)

    def gathered_bytes(self, world_size: int, sharded: bool) -> int:
        """Bytes of the all-gather output (padded, in the compute dtype); 0 when replicated (nothing is gathered)."""
        if not sharded:
            return 0
        return self._padded_numel(world_size) * world_size * self.itemsize

    def reduce_bytes(self, world_size: int, sharded: bool) -> int:
        """Bytes of the reduce-scatter input (padded, in the reduce dtype); 0 when replicated."""
        if not sharded:
            return 0
        return self._padded_numel(world_size) * world_size * (self.reduce_itemsize or self.itemsize)


#: Module types whose weights autocast does not cast for a matrix multiplication (a lookup reads its rows as they
#: are); an embedding tied to an output Linear is cast there (see ``ModelInfo``).
NOT_CAST_BY_AUTOCAST = frozenset({"Embedding", "EmbeddingBag"})


def module_params(
    mp: ModuleProfile,
    *,
    compute_itemsize: int | None = None,
    reduce_itemsize: int | None = None,
    cast_by_autocast: bool | None = None,
) -> list[ParamSpec]:
    """A module's own parameters from its profile (dtype and trainability are per module in the schema: the
    trainable ones are taken first, in order, until ``trainable_param_bytes`` is reached).

    Args:
        mp: the module's profile (its byte figures are of the parameters as stored).
        compute_itemsize, reduce_itemsize: the mixed-precision policy's dtypes' sizes (``None``: the stored one).
        cast_by_autocast: whether autocast casts its matrices (``None``: unless the module is an embedding).
    """
    if not mp.param_shapes:
        return []
    numels = [math.prod(shape) if shape else 1 for shape in mp.param_shapes]
    itemsize = mp.param_bytes // max(sum(numels), 1) or 4
    cast = mp.type not in NOT_CAST_BY_AUTOCAST if cast_by_autocast is None else cast_by_autocast
    specs: list[ParamSpec] = []
    left = mp.trainable_param_bytes
    for shape, numel in zip(mp.param_shapes, numels, strict=True):
        rows = int(shape[0]) if shape else 1
        trainable = left >= numel * itemsize > 0
        if trainable:
            left -= numel * itemsize
        specs.append(
            ParamSpec(
                rows,
                numel // max(rows, 1),
                compute_itemsize or itemsize,
                trainable,
                storage_itemsize=itemsize,
                reduce_itemsize=reduce_itemsize,
                cast_by_autocast=cast and len(shape) >= 2,
            )
        )
    return specs


def split_params(params: Sequence[ParamSpec], k: int) -> list[list[ParamSpec]]:
    """The parameters of the ``k`` slices of a split Linear: weight and bias rows by ``torch.tensor_split``."""
    slices: list[list[ParamSpec]] = [[] for _ in range(k)]
    for p in params:
        base, extra = divmod(p.rows, k)
        for i in range(k):
            rows = base + (1 if i < extra else 0)
            slices[i].append(dataclasses.replace(p, rows=rows))
    return slices


@dataclass(frozen=True)
class UnitBytes:
    """Bytes of one unit on rank 0 under one mode (see [Note: what FSDP2 allocates per unit]).

    Attributes:
        mode: the unit's mode.
        params: parameter bytes kept between steps (padded shards, or full replicas; under a mixed-precision
            policy a replicated unit's autocast copies too).
        gathered: unsharded parameters while the unit is gathered (0 for ``no_shard``).
        flat: the all-gather output buffer (0 for ``no_shard``, and on one rank).
        grad: the sharded gradient (reduction output) the optimizer reads, kept into the next step (0 for
            ``no_shard``: its gradients live in ``bucket``).
        grad_full: unsharded gradients autograd produces before the reduction (or the copy into the bucket), in the
            compute dtype.
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
    full_trainable = sum(p.stored_nbytes for p in trainable)
    local_trainable = sum(p.local_bytes(world_size, sharded) for p in trainable)
    share = local_trainable / full_trainable if full_trainable else 0.0
    gathered = sum(p.gathered_bytes(world_size, sharded) for p in params)
    # A replicated unit under a mixed-precision policy: autocast's compute-dtype copies of its weights.
    copies = 0 if sharded else sum(p.autocast_copy_bytes for p in params)
    return UnitBytes(
        mode=mode,
        params=sum(p.local_bytes(world_size, sharded) for p in params) + copies,
        gathered=gathered,
        flat=gathered if world_size > 1 else 0,
        grad=local_trainable if sharded else 0,
        # FSDP2's unsharded gradients are of its compute-dtype parameters; DDP's of its stored ones.
        grad_full=sum(p.nbytes if sharded else p.stored_nbytes for p in trainable),
        reduce_input=sum(p.reduce_bytes(world_size, sharded) for p in trainable),
        bucket=0 if sharded else full_trainable,
        optim=round(optim_tensor_bytes * share + optim_scalar_bytes),
        largest_local=max((p.local_bytes(world_size, sharded) for p in trainable), default=0),
        param_count=sum(p.numel for p in params),
        param_bytes=sum(p.stored_nbytes for p in params),
        trainable=bool(trainable),
        n_params=len(params),
        n_trainable=len(trainable),
    )


@dataclass(frozen=True)
class UnitTime:
    """Seconds one unit adds to a step beyond the modules' own compute.

    Attributes:
        communication: its collectives (all-gathers, reduce-scatter or all-reduce).
        exposed: the part of ``communication`` not hidden behind compute (``unoverlapped`` included).
        copies: FSDP2's own memory copies around the collectives.
        optimizer: the optimizer step over the unit's local trainable parameters.
        overhead: hooks, and the extra calls of a split operator.
        compute: forward + backward compute of the modules the unit covers (informative; counted once, in the
            model's compute).
        unoverlapped: the part of ``exposed`` that no compute can hide whatever its amount: a collective that runs
            before the step's first compute (the root's all-gather) or after its last (the reductions of FSDP2's
            final callback).
        contention: what the collectives that compute hides cost that compute: their kernels hold part of the
            device while they run (``ResolvedConfig.collective_compute_share``).
    """

    communication: float = 0.0
    exposed: float = 0.0
    copies: float = 0.0
    optimizer: float = 0.0
    overhead: float = 0.0
    compute: float = 0.0
    unoverlapped: float = 0.0
    contention: float = 0.0

    @property
    def added(self) -> float:
        """What the unit adds to the step time: exposed communication, contention, copies, optimizer, overhead."""
        return self.exposed + self.contention + self.copies + self.optimizer + self.overhead

    def __add__(self, other: UnitTime) -> UnitTime:
        return UnitTime(
            self.communication + other.communication,
            self.exposed + other.exposed,
            self.copies + other.copies,
            self.optimizer + other.optimizer,
            self.overhead + other.overhead,
            self.compute + other.compute,
            self.unoverlapped + other.unoverlapped,
            self.contention + other.contention,
        )
