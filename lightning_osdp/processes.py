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
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _default_backend(self.root_device)
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _distributed_is_initialized() -> bool:
    # `is_initialized` exists only in builds with distributed support.
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _default_backend(device: torch.device) -> str:
    # torch's own map of device types to backends (cpu: gloo, cuda: nccl, ...), the one Lightning's strategies read.
    return torch.distributed.Backend.default_device_backend_map.get(device.type, "gloo")
