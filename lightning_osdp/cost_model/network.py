"""The seconds of a collective on any group of a topology, from the profile's fits of its two levels.

[Note: two levels]
A profile fits each collective (``alpha + bytes / beta``) on two kinds of real group (``profiling/collectives.py``):
*within a node* (the ranks of one node, every node at once) and *across nodes* (one rank of each node, the ranks
of every local rank at once). On one node the first is the world and the second does not exist. Every group a plan
communicates on (``lightning_osdp/topology.py``'s [Note: the groups]) is priced from these two, with the ring model
of ``lightning_osdp/cli/hardware.py``'s [Note: the collective model]: a ring of ``n`` ranks moves
``passes * (n - 1) / n`` of the full buffer through every rank (``passes`` 2 for all-reduce, else 1), so the *bus
bandwidth* ``beta * passes * (n - 1) / n`` carries over between group sizes, and the latency grows with the ``n - 1``
ring steps:

* a group within one node: the within-node fit carried over to the group's size. The world of a one-node run uses
  the fit as it is (the profile's fit is that of the group the model trains on), so a flat world predicts exactly
  what it did before topologies existed;
* a group across nodes, with ``m`` of its ranks on each of ``k`` nodes: the across-node fit was measured with every
  rank of a node sending across at once, so its bus bandwidth is one rank's share of the node's network; the group's
  ``m`` ranks of a node share ``m`` such shares. A ring over several nodes runs at its slowest link: the bus
  bandwidth is the smaller of that and the within-node one (when ``m > 1`` the ring also steps inside nodes). Its
  latency is NCCL's model of a ring over nodes (``src/graph/tuning.cc``, ``ncclTopoTuneModel``: ``nInterSteps``):
  ``k - 1`` steps cross the network (the across-node fit carried over to ``k`` nodes) and the other ``N - k`` stay
  within a node (each at the within-node fit's latency per step). An upper bound by the fixed cost per call that
  each fit's per-step share carries.

So the world of a multi-node run (``m`` = ranks per node) runs at the node's whole network bandwidth and
``hybrid_shard``'s replicate group (``m = 1`` for a shard group of one node) at one rank's share, as all of a
node's replicate groups all-reduce at once: per node, the bytes ``hybrid_shard`` sends across nodes equal DDP's.
"""

from __future__ import annotations

import math
from typing import Protocol

from lightning_osdp.profiling.model_profile import CollectiveFit, ModelProfile
from lightning_osdp.topology import CommGroup, Topology

__all__ = ["Levels", "Network", "as_topology", "bus_bytes_per_second", "carried_over"]


class Levels(Protocol):
    """The two levels of fits: a :class:`~lightning_osdp.profiling.ModelProfile`, or ``osdp plan``'s hardware
    figures."""

    @property
    def collectives(self) -> dict[str, CollectiveFit]: ...

    @property
    def inter_node_collectives(self) -> dict[str, CollectiveFit]: ...


def _passes(op: str) -> int:
    return 2 if op == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather


def bus_bytes_per_second(fit: CollectiveFit) -> float:
    """The fit's bus bandwidth: bytes each rank moves per second (``inf`` for a group of one rank)."""
    n = fit.world_size
    if n < 2 or math.isinf(fit.beta_bytes_per_second):
        return math.inf
    return fit.beta_bytes_per_second * _passes(fit.op) * (n - 1) / n


def carried_over(fit: CollectiveFit, size: int) -> CollectiveFit:
    """``fit`` (measured on ``fit.world_size`` ranks) for a ring of ``size`` ranks: the same bus bandwidth, the
    latency scaled by the ring's steps (see [Note: two levels]). A fit of one rank (nothing measured) stays free."""
    n0 = fit.world_size
    if size == n0 or n0 < 2 or math.isinf(fit.beta_bytes_per_second):
        return CollectiveFit(fit.op, size, fit.alpha_seconds, fit.beta_bytes_per_second)
    if size < 2:
        return CollectiveFit(fit.op, size, 0.0, math.inf)
    beta = bus_bytes_per_second(fit) / (_passes(fit.op) * (size - 1) / size)
    return CollectiveFit(fit.op, size, fit.alpha_seconds * (size - 1) / (n0 - 1), beta)


def as_topology(world_size: int | Topology | None, profile: ModelProfile) -> Topology:
    """The topology a prediction or a solve is for: a :class:`Topology` as given; ``None``: the profile's (its world
    on its nodes); an ``int``: that many ranks with the profile's ranks per node when it was measured on several
    nodes and the number is a multiple of them, else on one node."""
    if isinstance(world_size, Topology):
        return world_size
    nodes = max(int(getattr(profile, "nodes", 1) or 1), 1)
    measured = max(int(profile.world_size), 1)
    per_node = measured // nodes if measured % nodes == 0 else measured
    if world_size is None:
        return Topology(nodes, per_node) if nodes > 1 and measured % nodes == 0 else Topology.flat(measured)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 or a Topology, got {world_size!r}")
    if nodes > 1 and world_size % per_node == 0 and world_size > per_node:
        return Topology(world_size // per_node, per_node)
    return Topology.flat(world_size)


class Network:
    """Collective fits for every group of ``topology``, from ``profile``'s two levels (see [Note: two levels]).

    Raises (when asked for a group across nodes):
        ValueError: the profile has no across-node fits (it was measured on one node).
    """

    def __init__(self, profile: Levels, topology: Topology) -> None:
        self.profile = profile
        self.topology = topology
        self._cache: dict[tuple[str, CommGroup], CollectiveFit] = {}

    def _level(self, op: str, across: bool) -> CollectiveFit:
        fits = self.profile.inter_node_collectives if across else self.profile.collectives
        fit = fits.get(op)
        if fit is not None:
            return fit
        if across:
            raise ValueError(
                f"the profile has no across-node fit for {op!r}: it was measured on one node, and "
                f"{self.topology.describe_ranks()} communicate between nodes. Profile on the nodes the model will "
                "train on, or plan with built-in figures (osdp plan --nodes N --gpus-per-node G --network NAME)"
            )
        raise ValueError(
            f"the profile has no fit for collective {op!r} (it has {sorted(self.profile.collectives) or 'none'}); "
            "profile on the process group the model will train on"
        )

    def fit(self, op: str, group: CommGroup) -> CollectiveFit:
        """The ``alpha + bytes / beta`` fit of ``op`` on one group of kind ``group``."""
        key = (op, group)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if group.size <= 1:
            fit = CollectiveFit(op, 1, 0.0, math.inf)
        elif not group.crosses_nodes:
            intra = self._level(op, across=False)
            if self.topology.is_flat and group.size == self.topology.world_size:
                fit = intra  # the flat world: the fit as measured (see [Note: two levels])
            else:
                fit = carried_over(intra, group.size)
        else:
            across_fit = self._level(op, across=True)
            bus = bus_bytes_per_second(across_fit) * group.per_node
            # The ring's k - 1 network steps, then its N - k steps within nodes (see [Note: two levels]).
            alpha = carried_over(across_fit, group.nodes).alpha_seconds
            if group.per_node > 1:
                intra_fit = self._level(op, across=False)
                bus = min(bus, bus_bytes_per_second(carried_over(intra_fit, group.size)))
                if intra_fit.world_size > 1:
                    steps_within = group.size - group.nodes
                    alpha += intra_fit.alpha_seconds * steps_within / (intra_fit.world_size - 1)
            n = group.size
            beta = bus / (_passes(op) * (n - 1) / n) if math.isfinite(bus) else math.inf
            fit = CollectiveFit(op, n, alpha, beta)
        self._cache[key] = fit
        return fit

    def seconds(self, op: str, nbytes: float, group: CommGroup) -> float:
        """One call of ``op`` on a buffer of ``nbytes`` (its full size) on ``group`` (0 on one rank, or for nothing)."""
        if group.size <= 1 or nbytes <= 0:
            return 0.0
        return self.fit(op, group).seconds(nbytes)
