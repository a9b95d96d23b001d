"""``OSDPStrategy``: the Lightning glue around profile -> solve -> apply -> checkpoint.

The strategy owns no algorithm: it resolves a plan (given, loaded, or profiled and solved), hands it to the
executor, attaches the step monitor and speaks Lightning's step protocol (precision, gradient-sync blocking). It
inherits the rest of Lightning's protocol: the ranks, launchers and collectives from
:class:`~lightning_osdp.processes.ProcessGroupStrategy`, the checkpoint hooks from
:class:`~lightning_osdp.checkpoint.strategy.CheckpointingStrategy`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_osdp import checkpoint as osdp_checkpoint
from lightning_osdp import migration, options, preemption
from lightning_osdp._compat import (
    DDPForwardRedirection,
    fit_ckpt_path,
    optimizers_to_device,
)
from lightning_osdp.apply import OSDPModule, ReplicatedModule, applied_root, apply_plan, no_gradient_sync
from lightning_osdp.apply.materialize import has_meta_tensors, meta_parameters
from lightning_osdp.apply.optimizer import prepare_optimizers
from lightning_osdp.budget import card_bytes, device_memory_capacity, format_bytes
from lightning_osdp.checkpoint.strategy import CheckpointingStrategy
from lightning_osdp.distributed import from_rank_zero
from lightning_osdp.memory import return_freed_blocks_on
from lightning_osdp.monitor import OSDPMonitor
from lightning_osdp.plan import MODES, Plan
from lightning_osdp.planning import PlannerOptions, RunPlanner
from lightning_osdp.precision import OSDPPrecision, osdp_precision
from lightning_osdp.processes import ProcessGroupStrategy, StartMethod
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.setup_log import SetupLog
from lightning_osdp.solver.ilp import DEFAULT_GAP
from lightning_osdp.solver.policy import DEFAULT_MEMORY_HEADROOM
from lightning_osdp.step_monitor import SetupMeter, StepMonitor
from lightning_osdp.topology import Meshes, Topology, TopologyError, build_meshes

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_osdp._compat import StrategyRegistry
    from lightning_osdp.cost_model import PredictionCheck

__all__ = ["OSDPStrategy"]


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


class OSDPStrategy(CheckpointingStrategy, ProcessGroupStrategy):
    """Optimal Sharded Data Parallel: each module replicated (DDP) or sharded (ZeRO-2/ZeRO-3), as a plan says.

    ``docs/configuration.md`` says what each argument does, its default and the values it takes; in short:

    Args:
        memory_budget: per-device bytes the plan must fit (``4e9``, ``"6GiB"``, ``"8GB"``); ``None``: the device's.
        plan: a :class:`~lightning_osdp.Plan` or a plan file, applied as is; without one the model is profiled on the
            first training batch and the fastest plan under the budget is solved (a resumed run reuses its
            checkpoint's plan when the world and the budget are unchanged). ``Any`` so that LightningCLI passes a
            YAML path through (jsonargparse would read the file as the ``Plan`` dataclass).
        process_group_backend: ``None`` (``"gloo"`` on CPU, ``"nccl"`` on CUDA) or any backend of this torch build.
        timeout: how long a collective waits for a rank (a ``timedelta`` or seconds); ``None``: 5 minutes.
        start_method: ``"popen"`` (Lightning's subprocess launcher), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        memory_steps: on CPU, the first optimizer steps measured by the live-storage tracker (0: none).
        state_dict_type: ``"sharded"`` (DCP directories, every rank writes) or ``"full"`` (one file from rank 0).
        modes: the modes the planner may choose (``("full_shard",)`` is FSDP, ``("no_shard",)`` DDP).
        max_split: the largest operator-splitting factor the planner may choose (1 disables splitting).
        activation_checkpointing: ``"auto"`` (per unit: none, selective or full recomputation, where each pays),
            ``"selective"`` or ``"full"``/``True`` (every unit with activations), ``False`` (never).
        plan_out: where the solved plan is saved (its profile beside it); default ``osdp_plan.json`` in the log dir.
        solver_time_limit: a wall-clock safety net for the ILP solver, in seconds: each of its runs may take this
            long, the solve 3 times this. The solve stops on work limits (the same plan under any load); the plan's
            report says whether it is proven optimal, and ``"time limit"`` when this net was reached.
        solver_gap: the relative optimality gap the solve stops at (of the predicted step time; ``1e-3``: a plan
            proved within 0.1% of the fastest). A larger gap plans sooner on deep models whose bound is slow to
            prove (``docs/benchmarks.md``, "Planning speed").
        solver: the ILP's solver: ``"highs"`` (HiGHS in process, the only one; ``"cbc"``, removed, plans on HiGHS
            with a ``FutureWarning``).
        memory_headroom: the fraction of the budget the planner keeps free, as ``osdp plan --memory`` does.
        mixed_precision: ``None``, ``"bf16"`` or a ``MixedPrecisionPolicy`` for the sharded units (with the autocast
            precision of its dtype; see [Note: mixed precision]).
        shard_group_size: the ranks a ``hybrid_shard`` unit shards over; ``None``: one node's.
        find_unused_parameters: DDP's option for the replicated units; ``None``: ``True`` under manual optimization.
        pretrained: a full checkpoint read into the shards after the plan is applied (``docs/large-models.md``).
        pretrained_prefix: the prefix of the model's names the checkpoint's keys are read under; ``None`` finds it.
        pretrained_cast: cast pretrained weights of another dtype of the same kind (bf16 into fp32) to their
            parameters' dtypes (``False``: a dtype other than the parameter's is an error, found before profiling).
        **kwargs: none is accepted: an argument of Lightning's FSDP, ModelParallel, DeepSpeed or DDP strategy raises
            ``TypeError`` naming what OSDP does instead (:mod:`lightning_osdp.migration`, ``docs/migrating.md``).

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
        start_method: StartMethod = "popen",
        memory_steps: int = 3,
        state_dict_type: osdp_checkpoint.StateDictType = "sharded",
        modes: Sequence[str] = MODES,
        max_split: int = 8,
        activation_checkpointing: bool | Literal["auto", "selective", "full"] = "auto",
        plan_out: str | os.PathLike[str] | None = None,
        solver_time_limit: float = 10.0,
        memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
        mixed_precision: str | MixedPrecisionPolicy | None = None,
        shard_group_size: int | None = None,
        find_unused_parameters: bool | None = None,
        pretrained: str | os.PathLike[str] | None = None,
        pretrained_prefix: str | None = None,
        pretrained_cast: bool = False,
        solver: str = "highs",
        solver_gap: float = DEFAULT_GAP,
        **kwargs: Any,
    ) -> None:
        if kwargs:  # another strategy's arguments, carried over: one error naming what OSDP does instead of each
            migration.refuse_foreign_arguments(kwargs, "OSDPStrategy", accepted=migration.arguments_of(OSDPStrategy))
        # Before the base class assigns `precision_plugin`, whose setter checks the pair.
        self._mp_policy = options.check_mixed_precision(mixed_precision)
        self._planner = PlannerOptions.checked(
            modes=modes,
            max_split=max_split,
            activation_checkpointing=activation_checkpointing,
            solver_time_limit=solver_time_limit,
            memory_headroom=memory_headroom,
            solver=solver,
            solver_gap=solver_gap,
        )
        self._plan: Plan | None = options.check_plan(plan)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=options.check_process_group_backend(process_group_backend),
            timeout=options.check_timeout(
                timeout, solver_time_limit=self._planner.solver_time_limit, planning=self._plan is None
            ),
            start_method=options.check_start_method(start_method),
        )
        self._memory_budget = options.check_memory_budget(memory_budget)
        # What the user asked for (None: the device's capacity, which drifts between runs on a CPU); a resumed run
        # reuses its checkpoint's plan when this is unchanged.
        self._requested_budget = self._memory_budget
        self._plan_out = options.check_plan_out(plan_out)
        self._profile: ModelProfile | None = None
        self._profile_file: Path | None = None  # where rank 0 saved it, to record a measured correction in
        self._shard_group_size = options.check_shard_group_size(shard_group_size)
        self._meshes: Meshes | None = None
        self._memory_steps = options.check_memory_steps(memory_steps)
        self._state_dict_type: osdp_checkpoint.StateDictType = options.check_state_dict_type(state_dict_type)
        self._find_unused_parameters = options.check_find_unused_parameters(find_unused_parameters)
        self._pretrained = options.check_pretrained(pretrained)
        self._pretrained_prefix = options.check_pretrained_prefix(pretrained_prefix)
        self._pretrained_cast = options.check_pretrained_cast(pretrained_cast)
        self._monitor: OSDPMonitor | None = None
        self._setup_peak: int | None = None
        self._root: OSDPModule | ReplicatedModule | None = None
        # DDP's: in manual optimization `manual_backward` runs inside the redirected forward, where DDP's reducer must
        # not prepare a backward of its own (`pre_backward` prepares it).
        self._forward_redirection = DDPForwardRedirection()

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
    def planner_options(self) -> PlannerOptions:
        """The planner's options (modes, split, recomputation, solver limit, headroom) that :meth:`plan_for` uses."""
        return self._planner

    @property
    def memory_headroom(self) -> float:
        """The fraction of the budget the planner keeps free."""
        return self._planner.memory_headroom

    @property
    def activation_checkpointing(self) -> bool | Literal["auto", "selective", "full"]:
        """Which recomputation the planner may choose: ``"auto"``, ``"selective"``, ``"full"``/``True`` or ``False``."""
        return self._planner.activation_checkpointing

    @property
    def mixed_precision(self) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed-precision policy of the sharded units (``None``: Lightning's precision plugin alone)."""
        return self._mp_policy

    @property
    def profile(self) -> ModelProfile | None:
        """The model profile the plan was solved from (``None`` when a plan was given), with any correction a
        measured peak over the budget recorded in it."""
        return self._monitor.profile if self._monitor is not None else self._profile

    @property
    def prediction_check(self) -> PredictionCheck | None:
        """The plan's predicted peak memory and step time against rank 0's measured ones, after the first steps."""
        return self._monitor.prediction_check if self._monitor is not None else None

    @property
    def monitor(self) -> StepMonitor | None:
        """Measured step times and peak memory of this rank (after setup)."""
        return self._monitor.steps if self._monitor is not None else None

    @property
    def peak_memory_bytes(self) -> int | None:
        """This rank's measured peak memory of a training step (largest over the measured steps)."""
        return self._monitor.peak_memory_bytes if self._monitor is not None else None

    @property
    def setup_peak_memory_bytes(self) -> int | None:
        """This rank's peak memory during ``setup``, measured as a step's is (``None`` before setup, or on CPU with
        ``memory_steps=0``)."""
        return self._setup_peak

    @property
    def step_time(self) -> float | None:
        """This rank's median measured step time in seconds (first step excluded)."""
        return self._monitor.step_time if self._monitor is not None else None

    def summary(self) -> str:
        """One line for the end of a run: the step and last metrics, the plan, and this rank's measured step time and
        peak memory beside the plan's prediction (when it has a profile). The examples print it."""
        module = self.lightning_module
        if self._monitor is None:
            return "no plan yet"
        return self._monitor.summary(module._trainer if module is not None else None, self.global_rank)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 1-D mesh over every rank."""
        return self._mesh().world

    @property
    def hybrid_mesh(self) -> DeviceMesh:
        """The 2-D mesh ``(replicate, shard)`` of ``hybrid_shard`` units (see ``lightning_osdp/topology.py``)."""
        return self._mesh().hybrid

    def _mesh(self) -> Meshes:
        if self._meshes is None:
            raise RuntimeError("the device meshes exist once the processes are initialised")
        return self._meshes

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
    def setup_environment(self) -> None:
        super().setup_environment()
        # Ranks numbered node by node: rows of the hybrid mesh are shard groups (lightning_osdp/topology.py).
        self._meshes = build_meshes(self.root_device.type, self.topology)

    @override
    def set_world_ranks(self) -> None:
        # Lightning calls this when the Trainer is built, once `num_nodes` and `devices` are known: the earliest moment
        # the shard group can be checked against them, and the devices are known: on CPU the budget is the process's
        # memory from here on (lightning_osdp/memory.py [Note: resident memory on CPU]).
        _ = self.topology
        return_freed_blocks_on(self.parallel_devices)
        super().set_world_ranks()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        # The budget holds from the first line of setup: its peak is measured as a step's is (see `memory_steps`).
        meter = SetupMeter(self.root_device, measure=self._memory_steps > 0)
        log = SetupLog()
        with meter.measuring(self.model):
            self._setup(trainer, log)
        self._setup_peak = meter.peak
        log.finish()
        meter.warn_over(self._memory_budget)

    def _setup(self, trainer: pl.Trainer, log: SetupLog) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        preemption.install(trainer)  # before Lightning registers its SIGTERM handler (lightning_osdp/preemption.py)
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        # A module sharded by an earlier `fit` (this Trainer's, whose `validate/test` re-connects the bare
        # LightningModule, or another Trainer's) keeps its plan: FSDP2 applies once per module.
        existing = applied_root(module, self._plan)
        if existing is not None:
            self._root, self._plan = existing, existing.plan
        else:
            if self._plan is not None:
                self._plan.validate(module)  # a given plan that does not fit fails before anything is changed
            if self._memory_budget is None:
                self._memory_budget = device_memory_capacity(self.root_device, self.num_processes)
            # Cast before sharding so that FSDP2 shards parameters of their final dtype (bf16-true).
            self.model = self.precision_plugin.convert_module(self.model)
            # A model built on meta is materialized by the executor once sharded; one built for real moves whole, as
            # under Lightning's DDP (see docs/large-models.md).
            self.model_to_device()
            resuming = fit_ckpt_path(trainer) is not None
            if self._pretrained is not None and not resuming:
                self._check_pretrained(module, self._pretrained, log)
            planner = self._run_planner(log)
            resolution = planner.resolve(trainer, module, self._plan, self.batch_to_device)
            self._plan, self._profile, self._profile_file = resolution.plan, resolution.profile, planner.profile_file
            find_unused = self._find_unused_parameters
            meta = has_meta_tensors(module)
            with log.stage("applying the plan" + (" and materializing the shards" if meta else "")):
                self._root = apply_plan(
                    module,
                    self._plan,
                    mesh=self.device_mesh,
                    hybrid_mesh=self.hybrid_mesh,
                    mp_policy=self._mp_policy,
                    find_unused_parameters=not module.automatic_optimization if find_unused is None else find_unused,
                    device=self.root_device,
                )
            with log.stage(f"reading {self._pretrained}") if self._pretrained is not None else nullcontext():
                osdp_checkpoint.initialize_weights(
                    module,
                    self._root.uninitialized,
                    pretrained=self._pretrained,
                    prefix=self._pretrained_prefix,
                    resuming=resuming,
                    cast=self._pretrained_cast,
                )
            budget = format_bytes(self._memory_budget)
            rank_zero_info(
                f"OSDP: {self._plan.summary()} on {self.world_size} ranks, memory budget {budget} per device"
            )
        self.model = self._root
        self._attach_monitor(trainer)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            # Optimizers are built after sharding, so they hold the DTensor shards.
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            prepare_optimizers(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _check_pretrained(self, module: pl.LightningModule, source: Path, log: SetupLog) -> None:
        """``pretrained`` checked against the model (keys, shapes, dtypes, from headers alone) before profiling, on
        every rank (each reads the file), any rank's error raised on every rank (lightning_osdp/checkpoint/
        pretrained.py, [Note: checked before profiling])."""
        log.timed(
            f"checking {source} against the model",
            lambda: from_rank_zero(
                lambda: osdp_checkpoint.check_before_setup(
                    module, source, prefix=self._pretrained_prefix, cast=self._pretrained_cast
                ),
                what=f"checking the pretrained weights {source}",
                everywhere=True,
            ),
            lambda found: found.describe("it fits: will load"),
        )

    def _run_planner(self, log: SetupLog) -> RunPlanner:
        assert self._memory_budget is not None
        return RunPlanner(
            self._planner,
            budget=self._memory_budget,
            requested_budget=self._requested_budget,
            topology=self.topology,
            world_size=self.world_size,
            device=self.root_device,
            mp_policy=self._mp_policy,
            step_context=self.precision_plugin.train_step_context,
            node_groups=self._mesh().node_groups(),
            plan_out=self._plan_out,
            is_global_zero=self.is_global_zero,
            log=log,
        )

    def _attach_monitor(self, trainer: pl.Trainer) -> None:
        assert self._plan is not None
        if self._monitor is None or self._monitor.plan is not self._plan:
            self._monitor = OSDPMonitor(
                self.root_device,
                plan=self._plan,
                profile=self._profile,
                topology=self.topology,
                memory_budget=self._memory_budget,
                profile_file=self._profile_file,
                memory_steps=self._memory_steps,
            )
        self._monitor.attach(trainer)

    def plan_for(self, profile: ModelProfile, world_size: int | Topology | None = None) -> Plan:
        """The plan this strategy chooses for ``profile`` under its memory budget and planner options, on
        ``world_size`` ranks or a :class:`~lightning_osdp.topology.Topology` (default: this run's nodes and shard
        groups): :func:`~lightning_osdp.solver.plan_model`, what ``setup`` runs on rank 0 after profiling and what
        ``osdp plan`` runs with the same options."""
        if self._memory_budget is None:
            raise ValueError(
                "plan_for needs a memory budget: give OSDPStrategy(memory_budget=...), or call it after setup"
            )
        card = card_bytes(self.root_device) if self.parallel_devices else None
        return self._planner.plan(profile, self._memory_budget, world_size or self.topology, card_bytes=card)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not has_meta_tensors(self.model):  # a meta model materializes after sharding, as its plan keeps it
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)``: parameters on meta, materialized after the plan is applied (each
        rank allocates what its plan keeps; ``lightning_osdp/apply/materialize.py``); otherwise as Lightning's."""
        if empty_init:
            with meta_parameters(), self.precision_plugin.tensor_init_context():
                yield
            return
        with super().tensor_init_context(empty_init):
            yield

    # ------------------------------------------------------------------ steps
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        preemption.after_optimizer_step(self.lightning_module.trainer if self.lightning_module else None)
        return output

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # As Lightning's DDP strategy: a manual backward runs inside the forward (see `_forward_redirection`), before
        # DDP's post-forward would have prepared its reducer.
        module = self.lightning_module
        if isinstance(self.model, ReplicatedModule) and module is not None and not module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient reduction while accumulating: DDP and FSDP2 keep unsharded gradients until the last
        micro-batch."""
        assert isinstance(self.model, (OSDPModule, ReplicatedModule))
        with no_gradient_sync(self.model):
            yield

    # ------------------------------------------------------------------ state
    @override
    def _checkpoint_context(self) -> osdp_checkpoint.CheckpointContext:
        # The requested budget: a resumed run reuses the plan when the user asks for the same one again.
        return osdp_checkpoint.CheckpointContext(self.world_size, self._plan, self.profile, self._requested_budget)
