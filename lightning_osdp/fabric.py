"""``Fabric(strategy="osdp")``: OSDP for training loops written with Lightning Fabric (litgpt's among them).

:class:`OSDPFabricStrategy` is Fabric's door to the pipeline :class:`~lightning_osdp.OSDPStrategy` opens to the
Trainer, and owns no more algorithm than it: the profile and the solve are
:class:`~lightning_osdp.planning.RunPlanner`'s, the sharding :func:`~lightning_osdp.apply.apply_plan`'s, the
accumulation :func:`~lightning_osdp.apply.no_gradient_sync`, the clipping ``lightning_osdp/apply/clip.py``'s, the
checkpoints ``lightning_osdp/checkpoint/``'s (the same directories, keyed by the model's own names, with the plan
stored), the measured steps :class:`~lightning_osdp.monitor.OSDPMonitor`'s. Lightning's own FSDP strategies share
module-level helpers between the Trainer and Fabric the same way.

[Note: the profile's batch under Fabric]
The Trainer strategy profiles a ``training_step`` on the largest of the first batches of the train dataloader at setup.
Fabric has neither: ``fabric.setup(model)`` sees a bare ``nn.Module``, and the loop, the loss and the batches are the
user's script. Three ways were considered:

* an example batch and a loss function given to the strategy: exact, but ``Fabric(strategy="osdp")`` by name (what a
  litgpt user changes) cannot carry them, and a batch made by hand drifts from the loader's;
* a plan file (``osdp plan``, or a Trainer run's ``osdp_plan.json``): exact and supported (``plan=``), but a second tool
  to run first;
* the first forward the loop runs: always there, the loader's own batch, on every rank.

So the model :meth:`OSDPFabricStrategy.setup_module` returns is :class:`OSDPFabricModule`, which plans at the first
forward that records gradients (``torch.is_grad_enabled()``): its arguments are the batch profiled, the step profiled is
``forward`` on them (on a copy of the model where it fits the budget, on fake tensors otherwise, as the Trainer's) with
the sum of the output's floating-point tensors as the loss; rank 0 solves, every rank applies the plan, and the
optimizers already set up are pointed at the sharded parameters by name (they have no state before their first step;
one that has is refused). A forward without gradients before it (litgpt validates two batches before training) runs on
the whole model as it is; a model built on the meta device plans at its first forward of any kind, having no weights to
run without a plan. A first forward inside ``fabric.no_backward_sync(model, enabled=True)`` plans for accumulation (the
unsharded gradients held between micro-batches).

What this profile misses, and how it is accounted for: the loss is computed outside the module, so its own memory
(the log-softmax of the logits and its gradient, a chunked cross-entropy's pieces) is not in the profile, where a
Trainer ``training_step`` has it measured; and a later batch larger than the first is not planned for. Both show in
the step monitor: the first steps' peak memory is measured (the CUDA allocator, on CPU the live-storage tracker), and
after the first steps rank 0 reports it against the prediction, warning when it is over the budget, with the miss
recorded as a correction in the profile (saved beside the plan with ``plan_out=``, and in every checkpoint) that the
next run plans with. ``memory_headroom`` is the margin for it meanwhile.

[Note: a meta model's parameters before the plan]
``fabric.init_module(empty_init=True)`` builds the parameters on the meta device, to be allocated only as the plan
keeps them. Fabric refuses an optimizer over meta parameters (``setup_optimizers`` checks), yet litgpt builds its
optimizer between ``fabric.setup(model)`` and the first forward, before there is a plan. So a meta model without a
plan gets stand-ins: each meta parameter is replaced by a one-element tensor expanded to its shape (a few bytes, not
meta), the optimizer is built over those, and the first forward puts meta parameters back, profiles on fake tensors,
applies the plan, materializes the shards (``reset_parameters()`` per module, as under the Trainer) and points the
optimizer at them. Weights to start from are read with ``fabric.load_raw(path, model)``, after the plan, into the
shards (``lightning_osdp/checkpoint/pretrained.py``); ``model.load_state_dict`` on the stand-ins is refused with that
advice.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_osdp import checkpoint as osdp_checkpoint
from lightning_osdp import options, processes
from lightning_osdp._compat import (
    BackwardSyncControl,
    FabricSubprocessScriptLauncher,
    Stateful,
    StrategyRegistry,
)
from lightning_osdp.apply import OSDPModule, ReplicatedModule, apply_plan, no_gradient_sync
from lightning_osdp.apply.clip import clip_grad_norm_, clip_grad_value_
from lightning_osdp.apply.materialize import has_meta_tensors, meta_parameters
from lightning_osdp.apply.optimizer import prepare_optimizers
from lightning_osdp.apply.state_dict import SliceMap
from lightning_osdp.budget import device_memory_capacity, format_bytes
from lightning_osdp.memory import return_freed_blocks_on
from lightning_osdp.migration import refuse_foreign_arguments
from lightning_osdp.monitor import OSDPMonitor
from lightning_osdp.plan import MODES, Plan
from lightning_osdp.planning import PlannerOptions, RunPlanner
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.setup_log import SetupLog
from lightning_osdp.solver.ilp import DEFAULT_GAP
from lightning_osdp.solver.policy import DEFAULT_MEMORY_HEADROOM
from lightning_osdp.topology import Meshes, Topology, build_meshes

__all__ = ["OSDPFabricModule", "OSDPFabricStrategy"]

#: Where the first forward's batch is said to come from, in the profile and the plan's printout.
_BATCH_SOURCE = "the first {kind}forward's arguments (Fabric)"


class OSDPFabricModule(nn.Module):
    """What :meth:`OSDPFabricStrategy.setup_module` returns (Fabric wraps it in its ``_FabricModule``): the user's model
    as ``.module``, and once planned the sharded root it runs through as ``.root`` (see [Note: the profile's batch
    under Fabric]). ``.plan`` is the plan in force (``None`` before the first training forward)."""

    def __init__(self, module: nn.Module, strategy: OSDPFabricStrategy) -> None:
        super().__init__()
        self.module = module
        # Plain attributes, not submodules: the root holds `module` too, and the state dict is the model's own.
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "root", None)
        object.__setattr__(self, "_pause", None)  # the open `no_backward_sync` context, where planning enters too
        object.__setattr__(self, "_stand_ins", {})  # [Note: a meta model's parameters before the plan]
        # id of a meta parameter -> (it, its stand-in): held, so that its id stays its own while it is looked up
        object.__setattr__(self, "_replaced", {})
        object.__setattr__(self, "_pending_weights", None)  # a `load_raw` source read once the plan is applied

    root: OSDPModule | ReplicatedModule | None
    _strategy: OSDPFabricStrategy
    _pause: ExitStack | None
    _stand_ins: dict[int, str]  # id of a stand-in -> the parameter's name
    _replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]
    _pending_weights: tuple[Path, bool] | None

    @property
    def plan(self) -> Plan | None:
        return self.root.plan if self.root is not None else None

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.root is None:
            if not torch.is_grad_enabled() and not self._stand_ins and not has_meta_tensors(self.module):
                return self.module(*args, **kwargs)  # a forward without gradients before the plan: the whole model
            self._strategy._plan_and_apply(self, args, kwargs)
        assert self.root is not None
        if torch.is_grad_enabled() and self.module.training:
            self._strategy._step_started(self.root)
        return self.root(*args, **kwargs)

    @override
    def train(self, mode: bool = True) -> OSDPFabricModule:
        super().train(mode)
        if self.root is not None:
            self.root.train(mode)  # DDP's and the FSDP2 root's own flags
        return self

    @contextmanager
    def paused_gradient_sync(self) -> Iterator[None]:
        """``fabric.no_backward_sync``: no gradient reduction by any part of the plan (DDP's replicated part and the
        FSDP2 units) while open; a plan made inside it is paused at once."""
        with ExitStack() as stack:
            object.__setattr__(self, "_pause", stack)
            try:
                if self.root is not None:
                    self._strategy._accumulating()
                    stack.enter_context(no_gradient_sync(self.root))
                yield
            finally:
                object.__setattr__(self, "_pause", None)


class _PausedSync(BackwardSyncControl):
    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, OSDPFabricModule):
            raise TypeError(
                f"fabric.no_backward_sync needs the model fabric.setup returned under strategy='osdp', got "
                f"{type(module).__name__}"
            )
        return module.paused_gradient_sync()


class OSDPFabricStrategy(ParallelStrategy):
    """Optimal Sharded Data Parallel for Fabric: ``Fabric(strategy="osdp")`` or ``Fabric(strategy=OSDPFabricStrategy(
    ...))``. The model is planned at its first training forward (see [Note: the profile's batch under Fabric]) unless a
    plan is given. The arguments mean what :class:`~lightning_osdp.OSDPStrategy`'s do (``docs/configuration.md``), and
    are checked the same way (:mod:`lightning_osdp.options`); ``docs/fabric.md`` says what Fabric's calls do.

    Args:
        memory_budget: per-device bytes the plan must fit (``"6GiB"``, ``4e9``); ``None``: the device's.
        plan: a :class:`~lightning_osdp.Plan` or a plan file (``osdp plan``'s, a Trainer run's ``osdp_plan.json``),
            applied in ``setup_module``: no profile, no deferred planning.
        process_group_backend: ``None`` (``"gloo"`` on CPU, ``"nccl"`` on CUDA) or any backend of this torch build.
        timeout: how long a collective waits for a rank (a ``timedelta`` or seconds).
        memory_steps: on CPU, the first optimizer steps measured by the live-storage tracker (0: none).
        state_dict_type: ``"sharded"`` (DCP directories, every rank writes) or ``"full"`` (one file from rank 0).
        modes: the modes the planner may choose (``("full_shard",)`` is FSDP, ``("no_shard",)`` DDP).
        max_split: the largest operator-splitting factor the planner may choose (1 disables splitting).
        activation_checkpointing: ``"auto"``, ``"selective"``, ``"full"``/``True`` or ``False``.
        solver_time_limit: the ILP solver's wall-clock safety net, in seconds.
        memory_headroom: the fraction of the budget the planner keeps free.
        solver: the ILP's solver (``"highs"``).
        solver_gap: the relative optimality gap the solve stops at.
        mixed_precision: ``None``, ``"bf16"`` or a ``MixedPrecisionPolicy`` for the sharded units, with Fabric's
            ``precision="bf16-mixed"`` (``lightning_osdp/strategy.py`` [Note: mixed precision]).
        plan_out: where a plan solved at the first forward is saved with its profile (``None``: printed only).
        **kwargs: nothing else is accepted; the arguments of ``FSDPStrategy``, ``ModelParallelStrategy`` and DeepSpeed
            are refused with what OSDP does instead (:mod:`lightning_osdp.migration`).
    """

    strategy_name = "osdp"

    def __init__(
        self,
        memory_budget: int | float | str | None = None,
        plan: Any = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = None,
        memory_steps: int = 3,
        state_dict_type: osdp_checkpoint.StateDictType = "sharded",
        modes: Sequence[str] = MODES,
        max_split: int = 8,
        activation_checkpointing: bool | Literal["auto", "selective", "full"] = "auto",
        solver_time_limit: float = 10.0,
        memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
        solver: str = "highs",
        solver_gap: float = DEFAULT_GAP,
        mixed_precision: str | MixedPrecisionPolicy | None = None,
        plan_out: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_foreign(kwargs)
        with _named_in_errors():
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
                precision=precision,
            )
            self._process_group_backend = options.check_process_group_backend(process_group_backend)
            self._timeout = options.check_timeout(
                timeout, solver_time_limit=self._planner.solver_time_limit, planning=self._plan is None
            )
            self._memory_budget = options.check_memory_budget(memory_budget)
            self._requested_budget = self._memory_budget
            self._memory_steps = options.check_memory_steps(memory_steps)
            self._state_dict_type: osdp_checkpoint.StateDictType = options.check_state_dict_type(state_dict_type)
            self._plan_out = options.check_plan_out(plan_out)
        self._num_nodes = 1
        self._meshes: Meshes | None = None
        self._profile: ModelProfile | None = None
        self._profile_file: Path | None = None
        self._monitor: OSDPMonitor | None = None
        self._optimizers: list[Optimizer] = []
        self._models: list[OSDPFabricModule] = []
        self._said_accumulating = False
        self._backward_sync_control = _PausedSync()

    # ------------------------------------------------------------------ what users read
    @property
    def plan(self) -> Plan | None:
        """The plan in force (after the first training forward, or ``setup_module`` with a plan), or the one given."""
        return self._plan

    @property
    def memory_budget(self) -> int | None:
        """Per-device budget in bytes: the one given, or once planned the device's capacity."""
        return self._memory_budget

    @property
    def planner_options(self) -> PlannerOptions:
        """The planner's options (modes, split, recomputation, solver limits, headroom), as ``OSDPStrategy``'s."""
        return self._planner

    @property
    def profile(self) -> ModelProfile | None:
        """The profile the plan was solved from (``None`` for a given plan), with any measured correction."""
        return self._monitor.profile if self._monitor is not None else self._profile

    @property
    def monitor(self) -> OSDPMonitor | None:
        """The measured steps and the prediction check (after planning)."""
        return self._monitor

    @property
    def peak_memory_bytes(self) -> int | None:
        """This rank's measured peak memory of a training step (largest over the measured steps)."""
        return self._monitor.peak_memory_bytes if self._monitor is not None else None

    @property
    def step_time(self) -> float | None:
        """This rank's median measured step time in seconds (first step excluded)."""
        return self._monitor.step_time if self._monitor is not None else None

    def summary(self) -> str:
        """One line: the plan, and this rank's measured step time and peak memory beside the prediction."""
        return self._monitor.summary(None, self.global_rank) if self._monitor is not None else "no plan yet"

    @property
    def topology(self) -> Topology:
        """The run's nodes and ranks per node, what the cost model prices collectives with."""
        return Topology(self.num_nodes, max(self.num_processes, 1), None)

    @property
    def device_mesh(self) -> Any:
        """The 1-D mesh over every rank."""
        return self._mesh().world

    def _mesh(self) -> Meshes:
        if self._meshes is None:
            raise RuntimeError("the device meshes exist once the processes are initialised (fabric.launch())")
        return self._meshes

    # ------------------------------------------------------------------ Fabric's process protocol
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        if precision is not None:
            with _named_in_errors():
                options.check_precision_for_policy(self._mp_policy, str(getattr(precision, "precision", "")))
        self._precision = precision

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Optimal Sharded Data Parallel (per-module DDP/ZeRO plan)"
        )

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            environment, processes, nodes = self.cluster_environment, self.num_processes, self.num_nodes
            self._launcher = FabricSubprocessScriptLauncher(environment, processes, nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._process_group_backend = processes.join_process_group(self, self._process_group_backend, self._timeout)
        self._meshes = build_meshes(self.root_device.type, self.topology)

    def _set_world_ranks(self) -> None:
        # Fabric's connector calls it at construction, as on its own DDP strategy, once the devices are known: on CPU
        # the budget is the process's memory from here on (lightning_osdp/memory.py [Note: resident memory on CPU]).
        return_freed_blocks_on(self.parallel_devices)
        processes.set_world_ranks(self)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        processes.barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return processes.broadcast(obj, src)

    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        return processes.reduce(tensor, group, reduce_op)

    # ------------------------------------------------------------------ model and optimizers
    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta_tensors(module):  # a meta model materializes after sharding, as its plan keeps it
            module.to(self.root_device)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: parameters on meta, allocated as the plan keeps them (see [Note: a
        meta model's parameters before the plan]); otherwise as Fabric's."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(meta_parameters())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def setup_module(self, module: nn.Module) -> OSDPFabricModule:
        if isinstance(module, (OSDPFabricModule, OSDPModule, ReplicatedModule)):
            raise ValueError("this model is already set up by OSDP: pass the model itself to fabric.setup once")
        if self._models:
            raise NotImplementedError(
                "OSDPFabricStrategy plans and shards one model per Fabric (its plan, profile, monitor and checkpoints "
                "are the model's); a second fabric.setup is not supported yet"
            )
        model = OSDPFabricModule(module, self)
        self._models.append(model)
        if self._plan is not None:
            self._plan.validate(module)  # a given plan that does not fit fails before anything is changed
            self._apply(model, self._plan, profile=None, log=SetupLog())
        elif has_meta_tensors(module):
            _stand_in(model)
        return model

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        model = self.setup_module(module)
        return model, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer set up before the plan is pointed at the sharded parameters when the plan is applied; one set
        up after it is built on them already."""
        self._optimizers.append(optimizer)
        for model in self._models:
            # `fabric.setup(model, optimizer)`: built over the meta parameters the stand-ins replaced.
            replaced = model._replaced
            for group in optimizer.param_groups:
                group["params"] = [replaced[id(p)][1] if id(p) in replaced else p for p in group["params"]]
        if self._plan is not None and self._monitor is not None:
            prepare_optimizers([optimizer])
        return optimizer

    def _plan_and_apply(self, model: OSDPFabricModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At the first training forward: profile ``model`` on its arguments, solve, apply, re-point the optimizers
        (see [Note: the profile's batch under Fabric])."""
        module = model.module
        for optimizer in self._optimizers:
            if optimizer.state:
                raise RuntimeError(
                    "OSDP plans at the model's first training forward, and an optimizer set up with fabric.setup "
                    "already has state (it stepped before): its state would not follow the sharded parameters. Run "
                    "the first forward before the first optimizer step, or pass OSDPFabricStrategy(plan=...)"
                )
        _unstand_in(model, self._optimizers)
        log = SetupLog()
        if self._memory_budget is None:
            self._memory_budget = device_memory_capacity(self.root_device, self.num_processes)
        planner = RunPlanner(
            self._planner,
            budget=self._memory_budget,
            requested_budget=self._requested_budget,
            topology=self.topology,
            world_size=self.world_size,
            device=self.root_device,
            mp_policy=self._mp_policy,
            # Already inside `_FabricModule.forward`'s precision context.
            step_context=nullcontext,
            node_groups=self._mesh().node_groups(),
            plan_out=self._plan_out,
            is_global_zero=self.is_global_zero,
            log=log,
        )
        batch = _as_batch(module, args, kwargs)
        optimizers = [o for o in self._optimizers if _owns_all(module, o)]
        resolution = planner.resolve_with(
            given=None,
            resumed=None,
            profile=lambda: _in_training_mode(
                module,
                lambda: planner.profile_batch(
                    module,
                    batch,
                    source=_BATCH_SOURCE.format(kind="training " if torch.is_grad_enabled() else "(gradient-free) "),
                    step="forward",
                    accumulation=2 if model._pause is not None else 1,
                    optimizer=optimizers or None,
                ),
            ),
            plan_file=lambda: self._plan_out,
        )
        self._profile, self._profile_file = resolution.profile, planner.profile_file
        self._apply(model, resolution.plan, profile=resolution.profile, log=log)

    def _apply(self, model: OSDPFabricModule, plan: Plan, *, profile: ModelProfile | None, log: SetupLog) -> None:
        module = model.module
        before = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        meta = has_meta_tensors(module)
        with log.stage("applying the plan" + (" and materializing the shards" if meta else "")):
            root = apply_plan(
                module,
                plan,
                mesh=self._mesh().world,
                hybrid_mesh=self._mesh().hybrid,
                mp_policy=self._mp_policy,
                device=self.root_device,
            )
        pending = model._pending_weights
        object.__setattr__(model, "_pending_weights", None)
        if pending is not None and not pending[1]:  # `fabric.load_raw(..., strict=False)`
            with log.stage(f"reading {pending[0]} into the shards"):
                loaded = osdp_checkpoint.load_pretrained(module, pending[0], strict=False)
            rank_zero_info(f"OSDP: {loaded.describe()}")
        else:
            # The Trainer's: the weights into the shards, and a warning naming what neither they nor a
            # `reset_parameters()` initialized.
            with log.stage(f"reading {pending[0]} into the shards") if pending is not None else nullcontext():
                osdp_checkpoint.initialize_weights(
                    module,
                    root.uninitialized,
                    pretrained=pending[0] if pending is not None else None,
                    prefix=None,
                    resuming=False,
                )
        _repoint(self._optimizers, module, before)
        prepare_optimizers(self._optimizers)
        object.__setattr__(model, "root", root)
        root.train(module.training)
        if model._pause is not None:
            model._pause.enter_context(no_gradient_sync(root))
        self._plan = plan
        self._monitor = OSDPMonitor(
            self.root_device,
            plan=plan,
            profile=profile,
            topology=self.topology,
            memory_budget=self._memory_budget,
            profile_file=self._profile_file,
            memory_steps=self._memory_steps,
        )
        budget = f", memory budget {format_bytes(self._memory_budget)} per device" if self._memory_budget else ""
        rank_zero_info(f"OSDP: {plan.summary()} on {self.world_size} ranks{budget}")
        log.finish()

    # ------------------------------------------------------------------ steps
    def _accumulating(self) -> None:
        """Told when ``no_backward_sync`` pauses a planned model: a plan solved without accumulation (its first forward
        ran outside the context, a validation's say) left the gradients held between micro-batches out; said once."""
        profile = self._profile
        if profile is not None and profile.gradient_accumulation == 1 and not self._said_accumulating:
            self._said_accumulating = True
            rank_zero_warn(
                "OSDP: the plan was solved from a first forward outside fabric.no_backward_sync, so its prediction "
                "leaves out the unsharded gradients accumulation holds between micro-batches; the step monitor "
                "measures them and reports the peak against the budget after the first steps (memory_headroom is "
                "the margin meanwhile; a first training forward inside no_backward_sync plans for them)"
            )

    def _step_started(self, root: nn.Module) -> None:
        if self._monitor is not None and not self._monitor.steps.running:
            self._monitor.steps.start(root, *self._optimizers)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if self._monitor is not None:
            measurement = self._monitor.steps.stop()
            if measurement is not None and self._monitor.steps.check_due(measurement) and self.is_global_zero:
                self._monitor.announce_check()
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """By global norm over the plan's replicated (plain) and sharded (DTensor) gradients alike."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(
            self.precision.main_params(optimizer), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    # ------------------------------------------------------------------ checkpoints
    def _context(self) -> osdp_checkpoint.CheckpointContext:
        return osdp_checkpoint.CheckpointContext(self.world_size, self._plan, self.profile, self._requested_budget)

    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save``: the model and its optimizers as OSDP checkpoints hold them (the model's own keys, the plan
        and profile stored; ``docs/checkpointing.md``), everything else in ``state`` beside them."""
        if filter is not None:
            raise NotImplementedError("fabric.save(..., filter=...) is not supported under strategy='osdp'")
        key, model = _the_model(state, "fabric.save")
        if model.root is None:
            raise RuntimeError(
                "fabric.save before the model's first training forward: OSDP plans the model then, and a checkpoint "
                "holds the sharded model; save after it (or pass OSDPFabricStrategy(plan=...))"
            )
        module = model.module
        optimizers = [(k, v) for k, v in state.items() if isinstance(v, Optimizer)]
        other = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items() if k != key}
        for k, _ in optimizers:
            other.pop(k)
        kind = self._state_dict_type
        checkpoint = {
            "state_dict": osdp_checkpoint.model_state(module, kind),
            "optimizer_states": [osdp_checkpoint.optimizer_state(module, o, kind) for _, o in optimizers],
            "fabric": {"model": key, "optimizers": [k for k, _ in optimizers], "state": other},
        }

        def write_file(content: dict[str, Any], file: Path) -> None:
            self.checkpoint_io.save_checkpoint(content, file, storage_options=storage_options)

        osdp_checkpoint.save_checkpoint(
            checkpoint,
            path,
            module=module,
            context=self._context(),
            state_dict_type=self._state_dict_type,
            write_file=write_file,
            storage_options=storage_options,
        )

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load`` of what ``fabric.save`` wrote (under any plan or world size: DCP reshards), and
        ``fabric.load_raw(path, model)`` of a full state-dict file (a ``torch.save`` file, a Lightning checkpoint, a
        ``.safetensors`` file or a Hugging Face folder), each rank reading only its shards. A model not planned yet
        loads a checkpoint under the checkpoint's plan, and a raw file into the whole model (a meta model: into the
        shards, once planned)."""
        path = Path(self.broadcast(str(path)))
        if isinstance(state, OSDPFabricModule):
            self._load_raw(state, path, strict)
            return {}
        if isinstance(state, (nn.Module, Optimizer)) or not state:
            raise ValueError(
                "under strategy='osdp', fabric.load takes the state dict with the model set up by fabric.setup "
                "(fabric.load(path, {'model': model, 'optimizer': optimizer, ...})) and fabric.load_raw the model"
            )
        key, model = _the_model(state, "fabric.load")
        checkpoint = osdp_checkpoint.load_checkpoint(
            path,
            read_file=lambda p: self.checkpoint_io.load_checkpoint(p, weights_only=weights_only),
            weights_only=weights_only,
        )
        saved = checkpoint.get("fabric")
        if not isinstance(saved, Mapping):
            raise osdp_checkpoint.CheckpointError(
                f"{str(path)!r} is not a checkpoint fabric.save wrote under strategy='osdp' (no 'fabric' entry)"
            )
        if model.root is None:
            saved_plan = osdp_checkpoint.saved_plan(path)
            plan = saved_plan.plan if saved_plan is not None else None
            if plan is None:
                raise osdp_checkpoint.CheckpointError(
                    f"{str(path)!r} holds no plan, and the model has none yet: run a training forward first"
                )
            rank_zero_info(f"OSDP: the model is not planned yet: applying the plan of {path}")
            _unstand_in(model, self._optimizers)
            self._apply(model, plan, profile=None, log=SetupLog())
        rank_zero_info(osdp_checkpoint.describe_resume(path, checkpoint, self._context()))
        module = model.module
        osdp_checkpoint.load_model_state(module, checkpoint, strict=strict)
        optimizers = [o for k in saved["optimizers"] if k in state and isinstance(o := state[k], Optimizer)]
        if len(optimizers) != len(saved["optimizers"]) and strict:
            missing = [k for k in saved["optimizers"] if k not in state]
            raise KeyError(f"the checkpoint holds optimizer states for {missing}, which the state given lacks")
        if optimizers:
            states = checkpoint.get("optimizer_states", [])
            chosen = [states[i] for i, k in enumerate(saved["optimizers"]) if k in state]
            osdp_checkpoint.load_optimizer_states(module, optimizers, {**checkpoint, "optimizer_states": chosen})
        remainder = dict(saved["state"])
        for name in list(state):
            if name == key or name in saved["optimizers"]:
                continue
            if name not in remainder:
                if strict:
                    raise KeyError(f"'{name}' is in the state given to fabric.load but not in the checkpoint {path}")
                continue
            value = remainder.pop(name)
            if isinstance(state[name], Stateful):
                state[name].load_state_dict(value)
            else:
                state[name] = value
        return remainder

    def _load_raw(self, model: OSDPFabricModule, path: Path, strict: bool) -> None:
        if model.root is None and model._stand_ins:
            object.__setattr__(model, "_pending_weights", (path, strict))
            rank_zero_info(f"OSDP: {path} will be read into the shards once the model is planned (first forward)")
            return
        loaded = osdp_checkpoint.load_pretrained(model.module, path, strict=strict)
        rank_zero_info(f"OSDP: {loaded.describe()}")


# ---------------------------------------------------------------------------------------------- helpers
@contextmanager
def _named_in_errors() -> Iterator[None]:
    """The argument checks of :mod:`lightning_osdp.options` (shared with the Trainer strategy) name
    ``OSDPStrategy(...)`` in their errors: here the class the user constructed is named instead."""
    try:
        yield
    except (TypeError, ValueError) as err:
        message = str(err).replace("OSDPStrategy(", "OSDPFabricStrategy(")
        if message == str(err):
            raise
        raise type(err)(message) from None


def _refuse_foreign(kwargs: Mapping[str, Any]) -> None:
    """FSDPStrategy's, ModelParallelStrategy's and DeepSpeed's arguments refused as the Trainer strategy refuses them
    (:func:`~lightning_osdp.migration.refuse_foreign_arguments`), with this strategy's own arguments suggested."""
    own = [n for n in inspect.signature(OSDPFabricStrategy.__init__).parameters if n not in ("self", "kwargs")]
    refuse_foreign_arguments(kwargs, strategy="OSDPFabricStrategy", accepted=own)


def _the_model(state: Mapping[str, Any], what: str) -> tuple[str, OSDPFabricModule]:
    found = [(k, v) for k, v in state.items() if isinstance(v, OSDPFabricModule)]
    if len(found) != 1:
        raise ValueError(
            f"{what} under strategy='osdp' takes exactly one model set up by fabric.setup in its state "
            f"({{'model': model, ...}}); found {len(found)}"
        )
    return found[0]


def _as_batch(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward's arguments as the profiler unpacks a batch (a tuple positionally, a dict by keyword)."""
    if not kwargs:
        return args
    if not args:
        return dict(kwargs)
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    return dict(bound.arguments)


def _owns_all(module: nn.Module, optimizer: Optimizer) -> bool:
    ids = {id(p) for p in module.parameters()}
    return all(id(p) in ids for group in optimizer.param_groups for p in group["params"])


def _in_training_mode(module: nn.Module, fn: Callable[[], ModelProfile]) -> ModelProfile:
    """``fn()`` with ``module`` in training mode and gradients on: the first training forward may come while a loop
    left the model in ``eval()`` (a meta model's first forward may even be a validation's)."""
    modes = {m: m.training for m in module.modules()}
    module.train()
    try:
        with torch.enable_grad():
            return fn()
    finally:
        for m, mode in modes.items():
            m.training = mode


def _repoint(optimizers: Sequence[Optimizer], module: nn.Module, before: Mapping[int, str]) -> None:
    """Point each optimizer's parameter groups at ``module``'s parameters of the same names after the plan (a split
    Linear's weight at its slices, in order; a tied parameter by any of its names); parameters of other models stay."""
    slices = SliceMap.of(module)
    after: dict[str, list[nn.Parameter]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        after.setdefault(slices.canonical(name), []).append(param)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params: list[Tensor] = []
            for p in group["params"]:
                held = before.get(id(p))
                if held is not None and held not in after:
                    raise RuntimeError(f"OSDP: the optimizer's parameter {held!r} is not in the model after the plan")
                params.extend(after[held] if held is not None else [p])
            group["params"] = params


def _stand_in(model: OSDPFabricModule) -> None:
    """Replace the meta parameters by expanded one-element stand-ins (see [Note: a meta model's parameters before the
    plan]); tied parameters share one."""
    device = model._strategy.root_device
    made: dict[int, nn.Parameter] = {}
    names = {id(p): n for n, p in model.module.named_parameters(remove_duplicate=False)}
    for owner in model.module.modules():
        for name, param in list(owner._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                stand_in = nn.Parameter(
                    torch.zeros((), dtype=param.dtype, device=device).expand(param.shape),
                    requires_grad=param.requires_grad,
                )
                made[id(param)] = stand_in
                model._stand_ins[id(stand_in)] = names[id(param)]
                model._replaced[id(param)] = (param, stand_in)
            owner._parameters[name] = made[id(param)]
    model.module.register_load_state_dict_pre_hook(_refuse_load_into_stand_ins(model))


def _refuse_load_into_stand_ins(model: OSDPFabricModule) -> Callable[..., None]:
    def hook(*args: Any, **kwargs: Any) -> None:
        if model._stand_ins:
            raise RuntimeError(
                "this model was built with fabric.init_module(empty_init=True) and has no weights before OSDP plans it "
                "(at its first training forward): read weights with fabric.load_raw(path, model), which reads them "
                "into the shards once planned, instead of model.load_state_dict"
            )

    return hook


def _unstand_in(model: OSDPFabricModule, optimizers: Sequence[Optimizer]) -> None:
    """Put meta parameters back in place of the stand-ins (the optimizers with them), before profiling and applying."""
    if not model._stand_ins:
        return
    back: dict[int, nn.Parameter] = {}
    for owner in model.module.modules():
        for name, param in list(owner._parameters.items()):
            if param is not None and id(param) in model._stand_ins:
                if id(param) not in back:
                    back[id(param)] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad
                    )
                owner._parameters[name] = back[id(param)]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [back.get(id(p), p) for p in group["params"]]
    model._stand_ins.clear()
    model._replaced.clear()
