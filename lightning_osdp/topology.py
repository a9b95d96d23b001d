"""Where the ranks are: how many nodes, how many ranks on each, and the groups a plan communicates on.

[Note: the groups]
Ranks are numbered node by node: Lightning gives rank ``node_rank * ranks_per_node + local_rank``, torchrun and
SLURM likewise. A plan's collectives run on three kinds of process group:

* the **world**: ``full_shard`` and ``shard_grad_op`` units all-gather and reduce-scatter over every rank, and DDP
  all-reduces the ``no_shard`` gradients over every rank;
* a **shard group**: ``shard_group_size`` consecutive ranks, by default the ranks of one node. A ``hybrid_shard``
  unit shards its parameters within it, so its all-gathers and its reduce-scatter stay on the node's links;
* a **replicate group**: the ranks at the same position of every shard group, one rank per group. A
  ``hybrid_shard`` unit all-reduces its sharded gradient over it (the only traffic of that unit between nodes).

These are the dims of FSDP2's 2-D device mesh for hybrid sharding (``init_device_mesh(device, (replicas,
shard_group_size), mesh_dim_names=("replicate", "shard"))``): its rows are the shard groups and its columns the
replicate groups, because the mesh lays consecutive ranks along its last dim. A shard group must tile the nodes:
it holds whole nodes, or a node holds whole shard groups; otherwise one group would straddle a node boundary while
another did not, and the groups of one kind would not run at the same speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_osdp.profiling.collectives import NodeGroups

__all__ = ["CommGroup", "Meshes", "Topology", "TopologyError", "build_meshes"]


class TopologyError(ValueError):
    """A topology that cannot be laid out (the message names the figure and what is accepted)."""


@dataclass(frozen=True)
class CommGroup:
    """One kind of process group of a topology, as the collective model sees it (see [Note: the groups]).

    Attributes:
        kind: ``"world"``, ``"shard"`` or ``"replicate"``.
        size: ranks in one such group.
        nodes: nodes one such group spans.
        per_node: ranks of one such group on each node it spans.
    """

    kind: str
    size: int
    nodes: int
    per_node: int

    @property
    def crosses_nodes(self) -> bool:
        """Whether the group's collectives cross the network between nodes."""
        return self.nodes > 1


@dataclass(frozen=True)
class Topology:
    """The ranks of a run: ``nodes`` machines of ``ranks_per_node`` ranks each, and the size of the shard groups of
    ``hybrid_shard`` units.

    Args:
        nodes: machines (Lightning's ``num_nodes``).
        ranks_per_node: ranks on each (Lightning's ``devices``).
        shard_group_size: ranks a ``hybrid_shard`` unit shards its parameters over; ``None``: one node's ranks. It
            must divide the world size, and either divide ``ranks_per_node`` or be a multiple of it.
    """

    nodes: int = 1
    ranks_per_node: int = 1
    shard_group_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be an integer >= 1, got {value!r}")
        size = self.shard_group_size
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise TopologyError(f"shard_group_size must be an integer >= 1 (or None: one node's ranks), got {size!r}")
        world, per_node = self.world_size, self.ranks_per_node
        if world % size or (size % per_node and per_node % size):
            accepted = sorted(
                {d for d in range(1, per_node + 1) if per_node % d == 0}
                | {per_node * k for k in range(1, self.nodes + 1) if self.nodes % k == 0}
            )
            raise TopologyError(
                f"shard_group_size={size} does not tile {self.describe_ranks()}: a shard group must divide the world "
                f"size and hold whole nodes or fit a whole number of times in one; accepted: "
                f"{', '.join(map(str, accepted))}"
            )

    @classmethod
    def flat(cls, world_size: int) -> Topology:
        """``world_size`` ranks on one node (what an ``int`` world size always meant)."""
        return cls(1, world_size)

    # ------------------------------------------------------------------ figures
    @property
    def world_size(self) -> int:
        """Ranks in all."""
        return self.nodes * self.ranks_per_node

    @property
    def shard_size(self) -> int:
        """Ranks of one shard group (``shard_group_size``, by default ``ranks_per_node``)."""
        return self.shard_group_size if self.shard_group_size is not None else self.ranks_per_node

    @property
    def replicas(self) -> int:
        """Shard groups, the size of a replicate group."""
        return self.world_size // self.shard_size

    @property
    def is_flat(self) -> bool:
        """One node: every collective stays on the node's links."""
        return self.nodes == 1

    # ------------------------------------------------------------------ groups
    @property
    def world(self) -> CommGroup:
        """Every rank."""
        return CommGroup("world", self.world_size, self.nodes, self.ranks_per_node)

    @property
    def shard_group(self) -> CommGroup:
        """A ``hybrid_shard`` unit's shard group."""
        size, per_node = self.shard_size, self.ranks_per_node
        if size <= per_node:
            return CommGroup("shard", size, 1, size)
        return CommGroup("shard", size, size // per_node, per_node)

    @property
    def replicate_group(self) -> CommGroup:
        """A ``hybrid_shard`` unit's replicate group (one rank of each shard group)."""
        per_node = max(1, self.ranks_per_node // self.shard_size)
        size = self.replicas
        return CommGroup("replicate", size, max(1, size // per_node), min(per_node, size))

    def group(self, kind: str) -> CommGroup:
        """The group ``kind``: ``"world"``, ``"shard"`` or ``"replicate"``."""
        groups = {"world": self.world, "shard": self.shard_group, "replicate": self.replicate_group}
        if kind not in groups:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {', '.join(groups)}")
        return groups[kind]

    # ------------------------------------------------------------------ text and data
    def describe_ranks(self) -> str:
        """``"2 nodes x 8 ranks"`` (``"8 ranks on one node"``)."""
        if self.nodes == 1:
            return f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''} on one node"
        return f"{self.nodes} nodes x {self.ranks_per_node} ranks"

    def describe(self) -> str:
        """The ranks and, when it is not one node, the shard groups of ``hybrid_shard``."""
        text = self.describe_ranks()
        if self.shard_group_size is not None and self.shard_size != self.ranks_per_node:
            text += f", hybrid_shard groups of {self.shard_size}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (``shard_group_size`` only when set)."""
        out: dict[str, Any] = {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node}
        if self.shard_group_size is not None:
            out["shard_group_size"] = self.shard_group_size
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        """The inverse of :meth:`to_dict`."""
        return cls(int(data["nodes"]), int(data["ranks_per_node"]), data.get("shard_group_size"))


@dataclass(frozen=True)
class Meshes:
    """The device meshes of a run laid out as [Note: the groups] says.

    Attributes:
        world: the 1-D mesh ``("dp",)`` over every rank (``full_shard``, ``shard_grad_op``, DDP).
        hybrid: the 2-D mesh ``("replicate", "shard")`` of ``hybrid_shard`` units (rows are shard groups).
        nodes: on several nodes, the 2-D mesh whose rows are the nodes (the hybrid mesh itself when a shard group is a
            node), where the profile measures the two levels of the network; ``None`` on one node.
    """

    world: DeviceMesh
    hybrid: DeviceMesh
    nodes: DeviceMesh | None

    def node_groups(self) -> NodeGroups | None:
        """This rank's process groups within and across nodes, where the profile measures the two levels of the
        network (``None`` on one node)."""
        from lightning_osdp.profiling.collectives import NodeGroups

        if self.nodes is None:
            return None
        return NodeGroups(self.nodes.size(0), self.nodes.get_group("shard"), self.nodes.get_group("replicate"))


def build_meshes(device_type: str, topology: Topology) -> Meshes:
    """The run's meshes (a collective: every rank builds the same meshes once its process group is up)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh(device_type, (topology.world_size,), mesh_dim_names=("dp",))
    names = ("replicate", "shard")
    hybrid = init_device_mesh(device_type, (topology.replicas, topology.shard_size), mesh_dim_names=names)
    nodes: DeviceMesh | None = None
    if topology.nodes > 1:
        nodes = (
            hybrid
            if topology.shard_size == topology.ranks_per_node
            else init_device_mesh(device_type, (topology.nodes, topology.ranks_per_node), mesh_dim_names=names)
        )
    return Meshes(world, hybrid, nodes)
