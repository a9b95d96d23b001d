"""``OSDPStrategy``: the Lightning glue around profile -> solve -> apply -> checkpoint.

The strategy owns no algorithm: it resolves a plan (given, loaded, or profiled and solved), hands it to the
executor, times the steps and speaks Lightning's protocol (launchers, samplers, gradient-sync blocking,
checkpoints).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_osdp import checkpoint as osdp_checkpoint
from lightning_osdp import options, preemption
from lightning_osdp._compat import (
    fit_ckpt_path,
    fit_train_dataloader,
    init_dist_connection,
    optimizers_to_device,
    sync_ddp_if_available,
)
from lightning_osdp.apply import OSDPModule, ReplicatedModule, apply_plan
from lightning_osdp.apply.optimizer import step_mixed_groups_per_tensor
from lightning_osdp.budget import device_memory_capacity, format_bytes
from lightning_osdp.distributed import from_rank_zero
from lightning_osdp.launcher import _OSDPMultiProcessingLauncher
from lightning_osdp.plan import MODES, Plan, PlanError
from lightning_osdp.precision import OSDPPrecision, osdp_precision
from lightning_osdp.profiling.collectives import NodeGroups
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.solver.policy import DEFAULT_MEMORY_HEADROOM
from lightning_osdp.step_monitor import StepMonitor
from lightning_osdp.topology import Topology, TopologyError
from lightning_osdp.watchdog import _OSDPSubprocessScriptLauncher

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_osdp._compat import StrategyRegistry
    from lightning_osdp.cost_model import Prediction, PredictionCheck

__all__ = ["OSDPStrategy"]

_StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
_ROOT_ATTRIBUTE = "_osdp_root"
# Step 0 builds the optimizer state and runs lazy init: the check uses the median of the steps after it.
_CHECK_AFTER_STEPS = 4

# [Note: mixed precision]
# Lightning's `bf16-mixed` is autocast over fp32 parameters: a sharded unit gathers fp32, and autocast then makes a
# bf16 copy of every weight a matmul uses and keeps it for backward: half the model's parameter bytes, unsharded,
# on every rank. Large FSDP2 runs instead let FSDP2 gather in bf16 (`MixedPrecisionPolicy(param_dtype=bf16,
# reduce_dtype=fp32)`, torchtitan's default): half the all-gather bytes, and what autograd keeps of a weight is the
# unsharded parameter FSDP2 frees at reshard. `mixed_precision` offers that policy for the sharded units.
# * Spelling: `"bf16"` names the one policy large runs use, and is what a LightningCLI YAML can say
#   (`mixed_precision: bf16`); a `MixedPrecisionPolicy` object (fp16, a bf16 reduction, `output_dtype`) is accepted
#   from Python, as FSDP2 takes it. Not a new `Trainer(precision=...)` value: Lightning owns that vocabulary, and the
#   policy is a property of how the strategy shards, as `FSDPStrategy(mixed_precision=...)` is for FSDP1.
# * Replicated units: they run on DDP, which has no public parameter cast (its `_MixedPrecision` is private,
#   experimental, and needs CUDA events). The policy therefore goes with Lightning's autocast of the same dtype
#   (`bf16-mixed`), which makes the replicated units compute in bf16 while their parameters, gradients and buckets
#   stay fp32 and are all-reduced in fp32, the policy's reduce dtype. Lightning's own `FSDPStrategy` pairs FSDP's
#   parameter cast with autocast the same way. For matmul weights the numbers are those of plain `bf16-mixed`
#   (autocast rounds fp32 to bf16 as FSDP2's cast does); a model that runs its norms and its loss in fp32 explicitly
#   (`examples/llama`) steps as torchtitan's does.
# * The cost model follows: the step is profiled with the parameters in bf16 (what the sharded units compute with),
#   sharded units gather and all-gather bf16 and reduce-scatter fp32, and replicated units keep autocast's bf16 copies
#   of their weights (`lightning_osdp/cost_model/units.py` [Note: bytes per dtype under FSDP2's mixed precision]).
# * The default stays `None`: Lightning's plugins alone, the behaviour that matches Lightning's DDP bit for bit.


class OSDPStrategy(ParallelStrategy):
    """Optimal Sharded Data Parallel: each module replicated (DDP) or sharded (ZeRO-2/ZeRO-3), as a plan says.

    Args:
        memory_budget: per-device memory the plan must fit, in bytes (a whole number, ``4e9`` included) or as a
            string (``"512MiB"``, ``"6GiB"``, ``"8GB"``). ``None`` means the device's capacity (see
            :func:`~lightning_osdp.budget.device_memory_capacity`).
        plan: a :class:`~lightning_osdp.Plan`, or the path (``str`` or ``os.PathLike``) of a plan file; applied
            as is when given. Without one the strategy profiles the model on the first training batch and solves
            for the fastest plan under ``memory_budget`` (a resumed run reuses its checkpoint's plan when the
            world size and the requested budget are unchanged). Annotated ``Any`` so that LightningCLI hands a
            YAML path through unchanged: jsonargparse would otherwise read the file as the ``Plan`` dataclass.
        process_group_backend: ``None`` (``"gloo"`` on CPU, ``"nccl"`` on CUDA), a backend ``torch.distributed``
            knows and this torch build has, or per-device backends such as ``"cpu:gloo,cuda:nccl"``.
        timeout: the process-group timeout, a ``timedelta`` or a number of seconds (YAML: ``300`` or
            ``"0:05:00"``): how long any collective waits for a rank before the run fails. ``None`` is 5 minutes
            (longer only when ``solver_time_limit`` is above 60 s); see ``docs/troubleshooting.md`` for why, and when
            to raise it.
        start_method: ``"popen"`` (Lightning's subprocess launcher, the default), ``"spawn"``, ``"fork"`` or
            ``"forkserver"``. Under ``"popen"`` the ranks it starts end when rank 0 ends, and rank 0 ends with an
            error when one of them fails.
        memory_steps: on CPU, how many of the first optimizer steps are run under the live-storage tracker
            that measures peak memory (it costs Python time per operator); 0 measures none. CUDA measures every
            step.
        modes: the modes the planner may choose from: ``("no_shard",)`` is DDP, ``("full_shard",)`` FSDP,
            ``("shard_grad_op",)`` ZeRO-2, ``("hybrid_shard",)`` HSDP (sharded within ``shard_group_size`` ranks,
            replicated across such groups; on one node of one group it is ``full_shard``).
        max_split: the largest operator-splitting factor the planner may choose (1 disables splitting).
        activation_checkpointing: whether the planner may recompute a unit's activations in backward instead of
            keeping them (non-reentrant ``torch.utils.checkpoint`` around the unit's module, inside its FSDP2 unit):
            ``"auto"`` (default) where that is the fastest way to fit the budget, ``True`` on every unit that saves
            activations, ``False`` never (the planner of releases before recomputation).
        plan_out: the file the chosen plan is saved to (with the profile beside it as ``*.profile.json``); default
            ``osdp_plan.json`` in the logger's directory.
        solver_time_limit: seconds the ILP solver may take (a positive number); the plan records whether it is
            proven optimal.
        memory_headroom: the fraction of the budget the planner keeps free: it plans against
            ``memory_budget * (1 - memory_headroom)``, exactly as ``osdp plan --memory`` does (both call
            :func:`~lightning_osdp.solver.plan_model`; see ``lightning_osdp/solver/policy.py`` [Note: headroom]).
        state_dict_type: ``"sharded"`` (default): checkpoints are directories that every rank writes its shards
            into, in parallel (torch.distributed.checkpoint); ``"full"``: one consolidated file written by rank 0.
            Either loads under any plan and world size (see ``docs/checkpointing.md``).
        mixed_precision: ``None`` (default: Lightning's precision plugin alone), ``"bf16"`` (FSDP2's
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: sharded units gather
            their parameters in bf16 and reduce-scatter gradients in fp32, as torchtitan trains) or a
            ``torch.distributed.fsdp.MixedPrecisionPolicy``. A policy that casts parameters goes with the autocast
            precision of its dtype, ``Trainer(precision="bf16-mixed")`` for bf16; see [Note: mixed precision].
        shard_group_size: the ranks a ``hybrid_shard`` unit shards its parameters over (replicated across such
            groups); ``None``: the ranks of one node (``devices``). It must divide the world size and hold whole nodes
            or fit a whole number of times in one (checked when the Trainer is built; see
            ``lightning_osdp/topology.py``).

    Every argument is checked at construction (:mod:`lightning_osdp.options`): a wrong type raises ``TypeError``, a
    wrong value ``ValueError`` (``PlanError`` for a plan), naming the argument and what it accepts.
    """

    strategy_name = "osdp"

    def __init__(
        self,
        memory_budget: int | float | str | None = None,
        plan: Any = None,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = None,
        start_method: _StartMethod = "popen",
        memory_steps: int = 3,
        state_dict_type: osdp_checkpoint.StateDictType = "sharded",
        modes: Sequence[str] = MODES,
        max_split: int = 8,
        activation_checkpointing: bool | Literal["auto"] = "auto",
        plan_out: str | os.PathLike[str] | None = None,
        solver_time_limit: float = 10.0,
        memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
        mixed_precision: str | MixedPrecisionPolicy | None = None,
        shard_group_size: int | None = None,
    ) -> None:
        # Before the base class assigns `precision_plugin`, whose setter checks the pair.
        self._mp_policy = options.check_mixed_precision(mixed_precision)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Every argument is checked here, before any process starts (lightning_osdp/options.py).
        self._memory_budget = options.check_memory_budget(memory_budget)
        # What the user asked for (None: the device's capacity, which drifts between runs on a CPU); a resumed run
        # reuses its checkpoint's plan when this is unchanged.
        self._requested_budget = self._memory_budget
        self._modes = options.check_modes(modes)
        self._max_split = options.check_max_split(max_split)
        self._activation_checkpointing = options.check_activation_checkpointing(activation_checkpointing)
        self._plan_out = options.check_plan_out(plan_out)
        self._solver_time_limit = options.check_solver_time_limit(solver_time_limit)
        self._memory_headroom = options.check_memory_headroom(memory_headroom)
        self._profile: ModelProfile | None = None
        # Where this run saved the profile beside its plan (rank 0), to record a measured correction in.
        self._profile_file: Path | None = None
        self._prediction_check: PredictionCheck | None = None
        self._plan: Plan | None = options.check_plan(plan)
        self._process_group_backend = options.check_process_group_backend(process_group_backend)
        self._timeout = options.check_timeout(
            timeout, solver_time_limit=self._solver_time_limit, planning=self._plan is None
        )
        self._start_method = options.check_start_method(start_method)
        self._shard_group_size = options.check_shard_group_size(shard_group_size)
        self._device_mesh: DeviceMesh | None = None
        self._hybrid_mesh: DeviceMesh | None = None
        self._node_mesh: DeviceMesh | None = None
        self._memory_steps = options.check_memory_steps(memory_steps)
        self._state_dict_type: osdp_checkpoint.StateDictType = options.check_state_dict_type(state_dict_type)
        self._monitor: StepMonitor | None = None
        self._root: OSDPModule | ReplicatedModule | None = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ what users read
    @property
    def plan(self) -> Plan | None:
        """The plan in force (after setup), or the one given."""
        return self._plan

    @property
    def memory_budget(self) -> int | None:
        """Per-device budget in bytes: the one given, or after setup the device's capacity."""
        return self._memory_budget

    @property
    def memory_headroom(self) -> float:
        """The fraction of the budget the planner keeps free."""
        return self._memory_headroom

    @property
    def activation_checkpointing(self) -> bool | Literal["auto"]:
        """Whether the planner may recompute units' activations: ``"auto"``, ``True`` or ``False``."""
        return self._activation_checkpointing

    @property
    def mixed_precision(self) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed-precision policy of the sharded units (``None``: Lightning's precision plugin alone)."""
        return self._mp_policy

    @property
    def timeout(self) -> timedelta:
        """The process-group timeout: how long a collective waits for a rank before the run fails."""
        return self._timeout

    @property
    def profile(self) -> ModelProfile | None:
        """The model profile the plan was solved from (``None`` when a plan was given)."""
        return self._profile

    @property
    def prediction_check(self) -> PredictionCheck | None:
        """The plan's predicted peak memory and step time against rank 0's measured ones, after the first steps."""
        return self._prediction_check

    @property
    def monitor(self) -> StepMonitor | None:
        """Measured step times and peak memory of this rank (after setup)."""
        return self._monitor

    @property
    def peak_memory_bytes(self) -> int | None:
        """This rank's measured peak memory of a training step (largest over the measured steps)."""
        return self._monitor.peak_memory_bytes if self._monitor else None

    @property
    def step_time(self) -> float | None:
        """This rank's median measured step time in seconds (first step excluded)."""
        return self._monitor.step_time() if self._monitor else None

    def summary(self) -> str:
        """One line for the end of a run: the step reached and the last logged metrics, the plan in force, and this
        rank's measured step time and peak memory beside the plan's prediction (when the plan was solved here or
        resumed with its profile). The examples and the demo print it."""
        parts = []
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None:
            metrics = []
            for name, value in sorted(trainer.callback_metrics.items()):
                if (isinstance(value, Tensor) and value.numel() == 1) or isinstance(value, (int, float)):
                    number = float(value)
                else:
                    continue
                if math.isfinite(number):
                    metrics.append(f"{name}={number:.4f}")
            parts.append(f"step {trainer.global_step}: " + (" ".join(metrics) or "no metrics logged"))
        if self._plan is None:
            parts.append("no plan yet")
            return " | ".join(parts)
        budget = f", budget {format_bytes(self._memory_budget)} per device" if self._memory_budget else ""
        parts.append(f"{self._plan.summary()} on {self.world_size} ranks{budget}")
        predicted = None
        if self._profile is not None:
            from lightning_osdp.cost_model import predict

            predicted = predict(self._profile, self._plan, self.topology)
        measured = []
        if self.step_time is not None:
            guess = f" (predicted {predicted.step_seconds * 1e3:.1f} ms)" if predicted else ""
            measured.append(f"step {self.step_time * 1e3:.1f} ms{guess}")
        if self.peak_memory_bytes is not None:
            guess = f" (predicted {format_bytes(predicted.peak_bytes)})" if predicted else ""
            measured.append(f"peak memory {format_bytes(self.peak_memory_bytes)}{guess}")
        if measured:
            parts.append(f"rank {self.global_rank} measured: " + ", ".join(measured))
        return " | ".join(parts)

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists once the processes are initialised")
        return self._device_mesh

    @property
    def hybrid_mesh(self) -> DeviceMesh:
        """The 2-D mesh ``(replicate, shard)`` of ``hybrid_shard`` units (see ``lightning_osdp/topology.py``)."""
        if self._hybrid_mesh is None:
            raise RuntimeError("the hybrid mesh exists once the processes are initialised")
        return self._hybrid_mesh

    @property
    def topology(self) -> Topology:
        """The run's nodes (``num_nodes``), ranks per node (``devices``) and ``hybrid_shard``'s shard group size: what
        the planner's cost model prices the collectives with.

        Raises:
            TopologyError: ``shard_group_size`` does not tile the nodes.
        """
        try:
            return Topology(self.num_nodes, max(self.num_processes, 1), self._shard_group_size)
        except TopologyError as err:
            raise TopologyError(f"OSDPStrategy(shard_group_size=...): {err}") from None

    # ------------------------------------------------------------------ Lightning's protocol
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

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else OSDPPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning's plugins are replaced by their OSDP subclasses (clipping over mixed gradients, a sharded grad
        # scaler), as Lightning's FSDP strategy insists on its own: see `lightning_osdp.precision`.
        if precision_plugin is not None:
            # Lightning assigns the Trainer's plugin while the Trainer is built: a wrong pair fails there.
            options.check_precision_for_policy(self._mp_policy, str(getattr(precision_plugin, "precision", "")))
        self._precision_plugin = osdp_precision(precision_plugin) if precision_plugin is not None else None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints load into the sharded model: after `setup` has applied the plan.
        return True

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Optimal Sharded Data Parallel (per-module DDP/ZeRO plan)"
        )

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
        device = self.root_device.type
        self._device_mesh = init_device_mesh(device, (self.world_size,), mesh_dim_names=("dp",))
        # Ranks are numbered node by node, and a mesh lays consecutive ranks along its last dim: rows are shard groups
        # (nodes), columns replicate groups (one rank per node). See lightning_osdp/topology.py.
        topology = self.topology
        self._hybrid_mesh = init_device_mesh(
            device, (topology.replicas, topology.shard_size), mesh_dim_names=("replicate", "shard")
        )
        if topology.nodes > 1:
            self._node_mesh = (
                self._hybrid_mesh
                if topology.shard_size == topology.ranks_per_node
                else init_device_mesh(
                    device, (topology.nodes, topology.ranks_per_node), mesh_dim_names=("replicate", "shard")
                )
            )

    def _node_groups(self) -> NodeGroups | None:
        """This rank's groups within its node and across nodes, where the profile measures the two levels."""
        if self._node_mesh is None:
            return None
        return NodeGroups(self.num_nodes, self._node_mesh.get_group("shard"), self._node_mesh.get_group("replicate"))

    def set_world_ranks(self) -> None:
        # Lightning calls this when the Trainer is built, once `num_nodes` and `devices` are known: the earliest moment
        # the shard group can be checked against them.
        _ = self.topology
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        preemption.install(trainer)  # before Lightning registers its SIGTERM handler (lightning_osdp/preemption.py)
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        existing: OSDPModule | ReplicatedModule | None = getattr(module, _ROOT_ATTRIBUTE, None)
        if existing is not None:
            # The module was sharded by an earlier `fit` (this Trainer's, whose `validate/test` re-connects the bare
            # LightningModule, or another Trainer's): FSDP2 applies once per module, so the plan stays.
            if self._plan is not None and self._plan.decisions != existing.plan.decisions:
                raise PlanError(
                    "this LightningModule is already sharded under another plan (by an earlier fit); FSDP2 shards a "
                    "module once: build a fresh instance (and load a checkpoint into it) to train under a new plan"
                )
            self._root, self._plan = existing, existing.plan
            self.model = existing
        else:
            if self._plan is not None:
                self._plan.validate(module)  # a given plan that does not fit fails before anything is changed
            if self._memory_budget is None:
                self._memory_budget = device_memory_capacity(self.root_device, self.num_processes)
            # Cast before sharding so that FSDP2 shards parameters of their final dtype (bf16-true).
            self.model = self.precision_plugin.convert_module(self.model)
            self.model.to(self.root_device)
            plan = self._resolve_plan(trainer)
            self._root = apply_plan(
                module, plan, mesh=self.device_mesh, hybrid_mesh=self.hybrid_mesh, mp_policy=self._mp_policy
            )
            # A plain attribute, not a submodule: the root holds the module, the module must not hold the root.
            object.__setattr__(module, _ROOT_ATTRIBUTE, self._root)
            self.model = self._root
            self._plan = plan
            self._report_plan(plan)
        if self._monitor is None:
            self._monitor = StepMonitor(self.root_device, memory_steps=self._memory_steps)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            # Optimizers are built after sharding, so they hold the DTensor shards.
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                if step_mixed_groups_per_tensor(optimizer):
                    rank_zero_info(
                        "OSDP: parameter groups mixing replicated and sharded parameters step tensor by tensor "
                        "(foreach=False): torch's foreach kernels refuse plain tensors and DTensors in one list"
                    )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _resolve_plan(self, trainer: pl.Trainer) -> Plan:
        """The plan given; else the plan of the checkpoint being resumed, if made for this world size, topology and
        budget; else profile the model and solve."""
        if self._plan is not None:
            return self._plan
        choice = self._resume_choice()
        planned_for = _planned_for(choice.plan, self.world_size) if choice is not None and choice.plan else None
        here = self.topology
        if planned_for is not None and planned_for != Topology(here.nodes, here.ranks_per_node, here.shard_size):
            saved = planned_for.describe()
            rank_zero_info(
                f"OSDP: the checkpoint's plan was made for {saved} and this run is {self.topology.describe()}: "
                "planning again (the checkpoint loads under the new plan)"
            )
        elif choice is not None:
            rank_zero_info(f"OSDP: {choice.reason}")
            if choice.plan is not None:
                self._profile = ModelProfile.from_dict(choice.profile) if choice.profile else None
                return self._plan_with_correction(choice.plan)
        return self._profile_and_solve(trainer)

    def _plan_with_correction(self, plan: Plan) -> Plan:
        """``plan`` (a checkpoint's), or a new plan from the checkpoint's profile when that profile carries a measured
        correction under which ``plan`` no longer fits (see :meth:`_check_prediction`)."""
        profile = self._profile
        if profile is None or profile.measured_peak_correction <= 0 or self._memory_budget is None:
            return plan
        from lightning_osdp.cost_model import predict
        from lightning_osdp.solver import planned_budget

        if predict(profile, plan, self.world_size).peak_bytes <= planned_budget(
            self._memory_budget, self._memory_headroom
        ):
            return plan
        rank_zero_info(
            f"OSDP: the saved plan went over its budget when it ran (the profile carries a measured correction of "
            f"{format_bytes(profile.measured_peak_correction)}): planning again from the saved profile"
        )
        return from_rank_zero(lambda: self.plan_for(profile), what="planning")

    def _resume_choice(self) -> osdp_checkpoint.PlanChoice | None:
        assert self.lightning_module is not None
        path = fit_ckpt_path(self.lightning_module.trainer)
        if path is None or not Path(path).exists():
            return None
        saved = osdp_checkpoint.saved_plan(path)
        return osdp_checkpoint.resume_plan(
            saved, world_size=self.world_size, memory_budget=self._requested_budget, module=self.lightning_module
        )

    def _profile_and_solve(self, trainer: pl.Trainer) -> Plan:
        from lightning_osdp.cost_model import predict
        from lightning_osdp.profiling import profile as profile_model
        from lightning_osdp.profiling import profile_with_policy
        from lightning_osdp.solver import format_plan

        assert self.lightning_module is not None and self._memory_budget is not None
        batch, source, step = self._representative_batch(trainer)
        kwargs: dict[str, Any] = {
            "device": self.root_device,
            "step": step,
            "batch_source": source,
            "step_context": self.precision_plugin.train_step_context,
            # The ranks of this machine share its memory: measure the model in place only if a copy fits its share.
            "available_memory": device_memory_capacity(self.root_device, self.num_processes),
            "node_groups": self._node_groups(),
        }
        # A collective: every rank profiles its replica, rank 0's figures are broadcast so all plan alike.
        if self._mp_policy is not None:
            # As the policy runs the step: parameters in its dtype (lightning_osdp/profiling/mixed_precision.py).
            profile = profile_with_policy(self.lightning_module, batch, self._mp_policy, **kwargs)
        else:
            profile = profile_model(self.lightning_module, batch, **kwargs)
        self._profile = profile
        plan = from_rank_zero(lambda: self.plan_for(profile), what="planning")
        # `trainer.log_dir` is a collective (a broadcast): every rank asks, rank 0 writes.
        out = (
            Path(self._plan_out)
            if self._plan_out
            else Path(trainer.log_dir or trainer.default_root_dir) / "osdp_plan.json"
        )
        if self.is_global_zero:
            print(format_plan(plan, predict(profile, plan, self.topology), budget=self._memory_budget))
            plan.save(out)
            self._profile_file = profile.save(out.with_name(out.stem + ".profile.json"))
            rank_zero_info(f"OSDP: plan saved to {out} (pass it back with OSDPStrategy(plan=...) to skip planning)")
        return plan

    def plan_for(self, profile: ModelProfile, world_size: int | Topology | None = None) -> Plan:
        """The plan this strategy chooses for ``profile`` under its memory budget and planner options, on
        ``world_size`` ranks or a :class:`~lightning_osdp.topology.Topology` (default: this run's nodes and shard
        groups): :func:`~lightning_osdp.solver.plan_model`, what ``setup`` runs on rank 0 after profiling and what
        ``osdp plan`` runs with the same options."""
        from lightning_osdp.solver import plan_model

        if self._memory_budget is None:
            raise ValueError(
                "plan_for needs a memory budget: give OSDPStrategy(memory_budget=...), or call it after setup"
            )
        return plan_model(
            profile,
            self._memory_budget,
            world_size or self.topology,
            headroom=self._memory_headroom,
            modes=self._modes,
            max_split=self._max_split,
            recompute=self._activation_checkpointing,
            time_limit=self._solver_time_limit,
        )

    def _representative_batch(self, trainer: pl.Trainer) -> tuple[Any, str, str]:
        """The batch profiling runs: the first batch of the fit's train dataloader, else ``example_input_array``
        through ``forward`` (see ``lightning_osdp.profiling`` [Note: the representative batch])."""
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING:
            loader = fit_train_dataloader(trainer)
            if loader is not None:
                batch = next(iter(loader))
                return self.batch_to_device(batch), "first batch of the train dataloader", "training_step"
        if module.example_input_array is not None:
            return self.batch_to_device(module.example_input_array), "example_input_array", "forward"
        raise RuntimeError(
            "OSDP plans from a representative batch: this run has no train dataloader and the LightningModule "
            "no `example_input_array`. Set one, or pass a plan with OSDPStrategy(plan=...)."
        )

    @rank_zero_only
    def _report_plan(self, plan: Plan) -> None:
        budget = format_bytes(self._memory_budget) if self._memory_budget else "n/a"
        rank_zero_info(f"OSDP: {plan.summary()} on {self.world_size} ranks, memory budget {budget} per device")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._start_step()
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        self._start_step()
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._end_step()
        preemption.after_optimizer_step(self.lightning_module.trainer if self.lightning_module else None)
        return output

    def _start_step(self) -> None:
        module = self.lightning_module
        if self._monitor is not None and module is not None and module.trainer.training:
            self._monitor.start(self.model, *self.optimizers)

    def _end_step(self) -> None:
        if self._monitor is None:
            return
        measurement = self._monitor.stop()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if measurement is None or trainer is None or not self.is_global_zero:
            return
        every = max(int(getattr(trainer, "log_every_n_steps", 1)), 1)
        if (trainer.global_step + 1) % every == 0 or measurement.step < 3:
            metrics: dict[str, float] = {"osdp/step_time_s": measurement.seconds}
            if measurement.peak_memory_bytes is not None:
                metrics["osdp/peak_memory_bytes"] = float(measurement.peak_memory_bytes)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if measurement.step + 1 == _CHECK_AFTER_STEPS:
            self._check_prediction(trainer)

    def _check_prediction(self, trainer: pl.Trainer) -> None:
        """Once, on rank 0, after the first steps: the plan's predicted peak memory and step time against the measured
        ones (logged and printed; a large miss is a warning naming what the prediction was made of). A measured peak
        over the memory budget is a warning with both figures, and the miss is recorded in the profile as a
        correction (``ModelProfile.measured_peak_correction``, which the cost model holds all step): in the profile
        file this run saved beside its plan, and in the checkpoints it saves from now on, so that a run resuming
        from one plans with it (see ``docs/how-it-works.md``)."""
        if self._profile is None or self._plan is None or self._monitor is None:
            return  # a plan given by hand has no prediction to check
        from lightning_osdp.cost_model import predict

        prediction = predict(self._profile, self._plan, self.topology)
        measured = self._monitor.peak_memory_bytes
        self._prediction_check = check = prediction.check(measured, self._monitor.step_time(skip=1))
        if measured is not None and self._memory_budget is not None and measured > self._memory_budget:
            self._record_correction(measured, prediction)
        for logger in trainer.loggers:
            logger.log_metrics(
                {
                    "osdp/predicted_peak_memory_bytes": float(prediction.peak_bytes),
                    "osdp/predicted_step_time_s": prediction.step_seconds,
                },
                step=trainer.global_step,
            )
        if check.ok:
            rank_zero_info(f"OSDP: prediction held on rank 0: {check.message}")
        else:
            rank_zero_warn(f"OSDP: the cost model missed on rank 0: {check.message}")

    def _record_correction(self, measured: int, prediction: Prediction) -> None:
        """Warn that rank 0's measured peak is over the budget, and record the miss in the profile (rank 0's, which
        checkpoints save)."""
        assert self._profile is not None and self._memory_budget is not None
        predicted = prediction.peak_bytes
        self._profile = self._profile.with_correction(prediction.missed_bytes(measured))
        where = ["the checkpoints this run saves from now on"]
        if self._profile_file is not None:
            self._profile.save(self._profile_file)
            where.insert(0, str(self._profile_file))
        rank_zero_warn(
            f"OSDP: the measured peak memory {format_bytes(measured)} ({measured} bytes) on rank 0 is over the memory "
            f"budget of {format_bytes(self._memory_budget)} ({self._memory_budget} bytes); the plan was predicted at "
            f"{format_bytes(predicted)} ({predicted} bytes). The profile now carries a correction of "
            f"{format_bytes(self._profile.measured_peak_correction)}, recorded in {' and in '.join(where)}: a run that "
            "resumes from one of them plans with it. To stay under the budget now, restart with a larger "
            "memory_headroom or a smaller memory_budget."
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._monitor is not None:
            self._monitor.abort()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient reduction while accumulating: DDP and FSDP2 keep unsharded gradients until the last
        micro-batch."""
        model = self.model
        sharded = model.sharded if isinstance(model, ReplicatedModule) else model
        with model.no_sync() if isinstance(model, ReplicatedModule) else nullcontext():
            if not isinstance(sharded, OSDPModule):
                yield None
                return
            sharded.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield None
            finally:
                sharded.set_requires_gradient_sync(True)  # type: ignore[operator]

    # ------------------------------------------------------------------ collectives
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

    # ------------------------------------------------------------------ state
    # Checkpoint logic lives in `lightning_osdp.checkpoint`; these methods only pass Lightning's calls on.
    @property
    def state_dict_type(self) -> osdp_checkpoint.StateDictType:
        """``"sharded"`` (a DCP directory, every rank writes its shards) or ``"full"`` (one file from rank 0)."""
        return self._state_dict_type

    def _checkpoint_context(self) -> osdp_checkpoint.CheckpointContext:
        return osdp_checkpoint.CheckpointContext(
            world_size=self.world_size,
            plan=self._plan,
            profile=self._profile,
            memory_budget=self._requested_budget,
        )

    def _module(self) -> pl.LightningModule:
        if self.lightning_module is None:
            raise RuntimeError("checkpoints need the LightningModule attached to the strategy")
        return self.lightning_module

    def full_model_state_dict(self) -> dict[str, Any]:
        """The unsharded model state dict (the model's own keys) in CPU memory on rank 0, empty elsewhere.

        A collective."""
        return osdp_checkpoint.full_model_state(self._module())

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: this rank's shards (DTensors; split slices under their slice names until saved). Full: the
        gathered state on rank 0. A collective for ``"full"``."""
        if self._state_dict_type == "sharded":
            return osdp_checkpoint.sharded_model_state(self._module())
        return osdp_checkpoint.full_model_state(self._module())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if self._state_dict_type == "sharded":
            return osdp_checkpoint.sharded_optimizer_state(self._module(), optimizer)
        return osdp_checkpoint.full_optimizer_state(self._module(), optimizer)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # Lightning calls `load_optimizer_state_dict` only when fitting and after checking that the checkpoint has
        # optimizer states (a clear error for weights-only checkpoints); sharded states are read there, in place.
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None and self._state_dict_type == "sharded":
            raise TypeError(
                "OSDPStrategy(state_dict_type='sharded') writes with torch.distributed.checkpoint, not the "
                "CheckpointIO plugin: `storage_options` is not supported"
            )

        def write_file(content: dict[str, Any], path: Path) -> None:
            self.checkpoint_io.save_checkpoint(content, path, storage_options=storage_options)

        osdp_checkpoint.save_checkpoint(
            checkpoint,
            filepath,
            module=self._module(),
            context=self._checkpoint_context(),
            state_dict_type=self._state_dict_type,
            write_file=write_file,
        )

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        # Rank 0's path for all: every rank must read the same checkpoint.
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = osdp_checkpoint.load_checkpoint(
            path,
            read_file=lambda p: self.checkpoint_io.load_checkpoint(p, weights_only=weights_only),
            weights_only=weights_only,
        )
        rank_zero_info(osdp_checkpoint.describe_resume(path, checkpoint, self._checkpoint_context()))
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        osdp_checkpoint.load_model_state(self._module(), checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        osdp_checkpoint.load_optimizer_states(self._module(), optimizers, checkpoint)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            osdp_checkpoint.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _planned_for(plan: Plan, world_size: int) -> Topology | None:
    """The topology a saved plan was solved for, with its shard group size spelled out (``None``: unreadable). The
    solver records it unless it was one node of one shard group; a plan reused on resume was made for this
    ``world_size``."""
    saved = plan.info.get("topology")
    try:
        topology = Topology.from_dict(saved) if isinstance(saved, dict) else Topology.flat(world_size)
    except (KeyError, TypeError, ValueError):
        return None
    return Topology(topology.nodes, topology.ranks_per_node, topology.shard_size)


def _distributed_is_initialized() -> bool:
    # `is_initialized` exists only in builds with distributed support.
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _default_backend(device: torch.device) -> str:
    # torch's own map of device types to backends (cpu: gloo, cuda: nccl, ...), the one Lightning's strategies read.
    return torch.distributed.Backend.default_device_backend_map.get(device.type, "gloo")
