"""Timing the collectives FSDP2 issues on the real process group: ``seconds = alpha + bytes / beta`` per op.

[Note: which collectives]
What ``torch.distributed.fsdp`` (FSDP2, ``_fsdp_collectives.py``) issues in torch 2.13, on gloo as on NCCL:

* ``all_gather``: ``dist.all_gather_single`` of the flat, padded unit (``all_gather_into_tensor`` is its
  deprecated alias), before forward and (``full_shard``) again before backward;
* ``reduce_scatter``: ``dist.reduce_scatter_single`` of the unit's flat gradients with ``ReduceOp.AVG`` (fp32
  and bf16 gradients), after backward of a sharded unit; on gloo, where that call is slower than an all-reduce,
  the executor's replacement (``lightning_osdp/comm.py``), and so is what is timed here;
* ``all_reduce``: ``dist.all_reduce`` with ``ReduceOp.AVG``, the gradients of a DDP (``no_shard``)
  unit, whose reduce-scatter group has size 1 and so costs nothing.

``bytes`` is the *full* buffer of each call (the gathered output, the reduce-scatter input, the all-reduce
buffer), as in :class:`~lightning_osdp.profiling.model_profile.CollectiveFit`.

[Note: measuring]
All ranks run the same schedule: a few small calls of each op first (connection set-up), then sizes growing by
4x from 4 KiB. Each (size, op) runs once to warm up, then ``repeats`` times (``repeats + 2`` for the cheap
sizes up to 256 KiB, which scheduling noise hits hardest), each call after a barrier so that a rank's time is the
collective's and not its wait for a late peer; the median is kept. After each size, rank 0 decides for everyone
whether to go on: it stops before a size whose predicted time would overrun the budget (two sizes are always
measured). Rank 0's samples are broadcast and every rank fits the same numbers, so every rank builds the same
plan. The fit is :func:`~lightning_osdp.profiling.fit.fit_latency_throughput`. Garbage collection is off meanwhile.

[Note: two levels]
On several nodes the collectives are measured twice (:func:`benchmark_levels`), on the groups the cost model prices
every other group from (``lightning_osdp/cost_model/network.py``): *within a node* (each node's ranks, every node at
once) and *across nodes* (the ranks of one local rank, one per node, every such group at once). Every group of a kind
measures at the same time, as they communicate at the same time in training: the across-node figure is then one
rank's share of the node's network, whatever the network (a NIC per GPU, or one per node). Each group's rank 0 decides
its own schedule; the profile then carries global rank 0's fits to every rank.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_osdp.comm import reduce_scatter_comm
from lightning_osdp.profiling.fit import fit_latency_throughput
from lightning_osdp.profiling.model_profile import CollectiveFit
from lightning_osdp.profiling.timing import device_clock, timed_section

__all__ = [
    "COLLECTIVE_OPS",
    "DEFAULT_SIZES",
    "NodeGroups",
    "benchmark_collectives",
    "benchmark_levels",
    "fit_collective",
    "zero_cost_collectives",
]

#: The collectives a plan's cost depends on (see [Note: which collectives]).
COLLECTIVE_OPS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")
#: Full-buffer sizes measured by default: 4 KiB, 16 KiB, ..., 16 MiB.
DEFAULT_SIZES: tuple[int, ...] = tuple(4096 * 4**k for k in range(7))
_SMALL_BYTES = 256 * 1024


def fit_collective(op: str, world_size: int, samples: Sequence[tuple[int, float]]) -> CollectiveFit:
    """The ``alpha + bytes / beta`` fit of ``(bytes, seconds)`` samples of one collective."""
    alpha, beta = fit_latency_throughput(samples)
    return CollectiveFit(op, world_size, alpha, beta, [(int(b), float(s)) for b, s in samples])


def zero_cost_collectives(world_size: int = 1) -> dict[str, CollectiveFit]:
    """Fits for a group of one rank: nothing is communicated (``alpha = 0``, ``beta = inf``)."""
    return {op: CollectiveFit(op, world_size, 0.0, math.inf, []) for op in COLLECTIVE_OPS}


def _device_of(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _calls(
    group: Any, numel: int, world_size: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Callable[[], Any]]:
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // world_size, dtype=dtype, device=device)
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    custom = reduce_scatter_comm(group)
    if custom is not None:
        return {
            "all_gather": lambda: all_gather(full, shard, group=group),
            "reduce_scatter": lambda: custom(shard, full, group, dist.ReduceOp.AVG),
            "all_reduce": lambda: dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group),
        }
    return {
        "all_gather": lambda: all_gather(full, shard, group=group),
        "reduce_scatter": lambda: reduce_scatter(shard, full, op=dist.ReduceOp.AVG, group=group),
        "all_reduce": lambda: dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group),
    }


def _median_seconds(call: Callable[[], Any], count: int, group: Any, clock: Callable[[], float]) -> float:
    call()
    times = []
    for _ in range(count):
        dist.barrier(group)
        start = clock()
        call()
        times.append(clock() - start)
    return statistics.median(times)


def _measure(
    group: Any, sizes: list[int], repeats: int, dtype: torch.dtype, budget: float
) -> dict[str, list[tuple[int, float]]]:
    """This rank's ``(bytes, seconds)`` samples per op, on rank 0's schedule (see [Note: measuring])."""
    world_size = dist.get_world_size(group)
    device = _device_of(group)
    clock = device_clock(device)
    src = dist.get_global_rank(group, 0)
    element = torch.empty((), dtype=dtype).element_size()
    samples: dict[str, list[tuple[int, float]]] = {op: [] for op in COLLECTIVE_OPS}
    start = clock()
    # The first calls on a new group pay for connection set-up: not a cost of the plan.
    warm_up = _calls(group, world_size * 16, world_size, dtype, device)
    for op in COLLECTIVE_OPS:
        for _ in range(3):
            warm_up[op]()
    for index, size in enumerate(sizes):
        round_start = clock()
        numel = max(world_size, round(size / element / world_size) * world_size)
        calls = _calls(group, numel, world_size, dtype, device)
        count = repeats if numel * element > _SMALL_BYTES else repeats + 2
        for op in COLLECTIVE_OPS:
            samples[op].append((numel * element, _median_seconds(calls[op], count, group, clock)))
        if index + 1 == len(sizes):
            break
        # The next round costs about this one scaled by the size ratio (the bandwidth term dominates).
        now = clock()
        next_round = (now - round_start) * sizes[index + 1] / max(size, 1)
        go_on = torch.tensor([int(index < 1 or now - start + next_round <= budget)], device=device)
        dist.broadcast(go_on, src=src, group=group)
        if not go_on.item():
            break
    return samples


def benchmark_collectives(
    group: Any = None,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    time_budget_seconds: float = 2.0,
) -> dict[str, CollectiveFit]:
    """Measure and fit all-gather, reduce-scatter and all-reduce on ``group`` (default: the world).

    A collective call: every rank of ``group`` must call it with the same arguments; every rank returns the same
    fits (rank 0's measurements, see [Note: measuring]). Without an initialised process group, or with one
    rank, returns :func:`zero_cost_collectives`.

    Args:
        group: the process group the plan will communicate on.
        sizes: full-buffer sizes in bytes to measure (rounded to whole elements per rank).
        repeats: timed calls per (size, op) after one warm-up call (``repeats + 2`` up to 256 KiB).
        dtype: element type of the buffers.
        time_budget_seconds: a larger size is started only when rank 0 predicts it ends within this many seconds
            of the start (two sizes at least).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return zero_cost_collectives(1)
    group = group if group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return zero_cost_collectives(1)
    with timed_section():
        samples = _measure(group, sorted(sizes), repeats, dtype, time_budget_seconds)
    box: list[Any] = [samples]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return {op: fit_collective(op, world_size, box[0][op]) for op in COLLECTIVE_OPS}


@dataclass(frozen=True)
class NodeGroups:
    """This rank's two process groups of the network's levels (see [Note: two levels]).

    Attributes:
        nodes: nodes of the run.
        within: the ranks of this rank's node.
        across: one rank of each node: those with this rank's local rank.
    """

    nodes: int
    within: Any
    across: Any


def benchmark_levels(
    groups: NodeGroups,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    time_budget_seconds: float = 2.0,
) -> tuple[dict[str, CollectiveFit], dict[str, CollectiveFit]]:
    """The fits within a node and across nodes (see [Note: two levels]): :func:`benchmark_collectives` on
    ``groups.within``, then on ``groups.across``, each with ``time_budget_seconds``. A collective call of every rank.

    Returns:
        ``(within, across)``; on one node ``across`` is empty.
    """
    within = benchmark_collectives(
        groups.within, sizes=sizes, repeats=repeats, dtype=dtype, time_budget_seconds=time_budget_seconds
    )
    if groups.nodes < 2:
        return within, {}
    across = benchmark_collectives(
        groups.across, sizes=sizes, repeats=repeats, dtype=dtype, time_budget_seconds=time_budget_seconds
    )
    return within, across
