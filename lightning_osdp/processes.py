"""Lightning's process protocol for :class:`~lightning_osdp.OSDPStrategy`: how its ranks start, find each other, talk
and end.

:class:`ProcessGroupStrategy` is the process half of the strategy, what Lightning's DDP strategy does without DDP's
wrapping: the launcher (Lightning's subprocess launcher with no rank left behind, ``lightning_osdp/watchdog.py``, or
the spawn/fork launcher that sends the full weights back, ``lightning_osdp/launcher.py``), the ranks, the default
process group (destroyed at exit whatever its backend: [Note: gloo groups at exit] in ``lightning_osdp/_compat.py``),
the distributed sampler's arguments, ``barrier``, ``broadcast`` and ``reduce``, and teardown. Nothing here depends on
a plan.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_osdp._compat import init_dist_connection, sync_ddp_if_available
from lightning_osdp.launcher import _OSDPMultiProcessingLauncher
from lightning_osdp.watchdog import _OSDPSubprocessScriptLauncher

__all__ = ["ProcessGroupStrategy", "StartMethod"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ProcessGroupStrategy(ParallelStrategy):
    """A :class:`ParallelStrategy` over one process per device: the ranks numbered node by node, one default process
    group of ``process_group_backend`` (``None``: torch's default for the device) whose collectives wait ``timeout``
    for a rank, started by ``start_method``. The arguments arrive checked (:mod:`lightning_osdp.options`)."""

    def __init__(
        self,
        *,
        accelerator: Any,
        parallel_devices: list[torch.device] | None,
        cluster_environment: ClusterEnvironment | None,
        checkpoint_io: CheckpointIO | None,
        precision_plugin: Precision | None,
        process_group_backend: str | None,
        timeout: timedelta,
        start_method: StartMethod,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.num_nodes = 1

    @property
    def timeout(self) -> timedelta:
        """The process-group timeout: how long a collective waits for a rank before the run fails."""
        return self._timeout

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # NOTE: Lightning skips distributed samplers and `sync_dist` unless a strategy it does not know says so.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _OSDPSubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, exit_wait=self._timeout
            )
        else:
            self._launcher = _OSDPMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._process_group_backend = join_process_group(self, self._process_group_backend, self._timeout)

    def set_world_ranks(self) -> None:
        set_world_ranks(self)

    @override
    def barrier(self, name: str | None = None) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        return reduce(tensor, group, reduce_op)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


# What the Trainer's and Fabric's strategies both do with their processes (Lightning's DDP strategies share module-level
# helpers between its two front doors the same way).
def set_world_ranks(strategy: Any) -> None:
    """This process's global rank and the world size in ``strategy``'s cluster environment, and rank zero's for
    ``rank_zero_only``: from its node rank, local rank, processes per node and nodes."""
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank  # type: ignore[attr-defined]


def join_process_group(strategy: Any, backend: str | None, timeout: timedelta) -> str:
    """Set up ``strategy``'s process after its accelerator: the seed reset as Lightning's strategies do, the world
    ranks, and the default process group (``backend``, else the device's); the backend it joined."""
    reset_seed()
    set_world_ranks(strategy)
    backend = backend or _default_backend(strategy.root_device)
    assert strategy.cluster_environment is not None
    device_id = strategy.root_device if strategy.root_device.type != "cpu" else None
    init_dist_connection(strategy.cluster_environment, backend, timeout=timeout, device_id=device_id)
    return backend


def barrier(device: torch.device) -> None:
    """Every rank waits for all (on NCCL, on ``device``); nothing without a process group."""
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[device.index])
    else:
        torch.distributed.barrier()


def broadcast(obj: TBroadcast, src: int = 0) -> TBroadcast:
    """``obj`` of rank ``src`` on every rank (pickled); ``obj`` itself without a process group."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def reduce(tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
    """A tensor reduced over ``group`` with ``reduce_op`` (Lightning's ``sync_ddp_if_available``); anything else as
    it is."""
    if isinstance(tensor, Tensor):
        return sync_ddp_if_available(tensor, group, reduce_op)
    return tensor


def _distributed_is_initialized() -> bool:
    # `is_initialized` exists only in builds with distributed support.
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _default_backend(device: torch.device) -> str:
    # torch's own map of device types to backends (cpu: gloo, cuda: nccl, ...), the one Lightning's strategies read.
    return torch.distributed.Backend.default_device_backend_map.get(device.type, "gloo")
