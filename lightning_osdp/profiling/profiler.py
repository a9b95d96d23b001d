"""``profile``: stage 1 of the pipeline, a :class:`ModelProfile` of the user's model on this device.

[Note: measured and estimated]
*Measured* (the model's step fits): a copy of the model runs real steps on the device (a model on the meta device is
copied with random values). One traced step records activations, FLOPs, gradients and optimizer state and warms up
(it allocates the optimizer state); then ``repeats`` hooked steps (own times per module) alternate with ``repeats``
plain steps (the whole step's time, and the optimizer step's); per-module times are medians over the hooked steps.

*Estimated* (a dry run, or asked for): a copy whose parameters are fake tensors
(``FakeTensorMode``: shapes, dtypes and devices, no memory) runs one traced step, backward and optimizer step
included. Bytes come out exactly as in the measured mode (same operators, same saved tensors); times are the
operators' FLOPs and bytes converted by rates benchmarked on the device (``rates``), or by the rates the caller
gives (another device's, for a dry run). ``.item()`` in the user's step yields a symbolic value, so logging-style
code runs; control flow that depends on tensor values cannot run on fake tensors and is reported as a
:class:`ProfilingError`.

*Blocks* (the model's step does not fit): the estimated mode's fake-tensor trace for the bytes, and times measured
on the device one distinct block at a time (``blocks.py`` [Note: a profile that fits]).

``mode="auto"`` runs the fake-tensor trace first: it gives the peak of a copy's step exactly (a measured step runs
the same operators). When that peak, beside what the model itself holds on the device, fits ``available_memory``
(the strategy passes its memory budget), the copy is measured; otherwise the profile is *blocks*. With the rates of
another device (a dry run), ``"auto"`` is *estimated*.

[Note: the representative batch]
The caller gives the batch; its shapes decide activation sizes and times, so it must be the largest batch of the
run (not a smaller last batch, not a short one of a collator that pads to each batch's longest), on this rank (the
per-device batch). The strategy passes the largest of the first batches of the fit's train dataloader over all ranks
(``lightning_osdp/planning.py`` [Note: batches whose shape varies]), which runs the real ``training_step`` and its
loss; failing that, the LightningModule's
``example_input_array`` with ``step="forward"`` (it is ``forward``'s input, and the loss is then the output's
sum). ``batch_source`` records which. A user who wants another batch profiles it and hands the profile over.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_osdp._compat import fake_tensor_mode, tree_leaves, tree_map
from lightning_osdp.budget import device_memory_capacity, format_bytes
from lightning_osdp.distributed import from_rank_zero
from lightning_osdp.memory import LiveStorageTracker, MemoryMeter, memory_meter
from lightning_osdp.profiling.blocks import measure_blocks
from lightning_osdp.profiling.collectives import (
    DEFAULT_SIZES,
    NodeGroups,
    benchmark_collectives,
    benchmark_levels,
    zero_cost_collectives,
)
from lightning_osdp.profiling.errors import ProfilingError
from lightning_osdp.profiling.loss_region import LossRegionRecorder
from lightning_osdp.profiling.model_profile import CollectiveFit, LossMemory, ModelProfile, ModuleProfile
from lightning_osdp.profiling.optimizer_state import (
    OptimizerSpec,
    OptimizerState,
    configured_optimization,
    rebuild_optimizers,
    state_from_instance,
    state_from_proxy,
    state_from_rule,
)
from lightning_osdp.profiling.parameters import account_parameters, grad_bytes_by_module
from lightning_osdp.profiling.rates import DeviceRates, measure_copy_bandwidth, measure_device_rates
from lightning_osdp.profiling.repeats import RepeatedBlocks, find_repeated_blocks, traced_by_depth
from lightning_osdp.profiling.replay import count_saves, replay_ops, time_full_replay
from lightning_osdp.profiling.replica import fake_replica, measured_replica
from lightning_osdp.profiling.selective import SelectiveFigures, fresh_caches, measure_selective
from lightning_osdp.profiling.step import (
    LossFn,
    StepRunner,
    describe_batch,
    is_lightning_module,
    is_lightning_module_class,
)
from lightning_osdp.profiling.timing import device_clock, timed_section
from lightning_osdp.profiling.tracer import ModuleTracer, OpTally, StepRecord
from lightning_osdp.profiling.values import StandInMethods, StandInValues

__all__ = ["MODES", "profile"]

#: Accepted values of ``profile(mode=...)``.
MODES = ("auto", "measured", "estimated", "blocks")


def _unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def _resolve_device(module: nn.Module, device: torch.device | str | None, on_meta: bool) -> torch.device:
    if device is not None:
        return torch.device(device)
    if on_meta:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return next(iter(module.parameters())).device


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return device_memory_capacity(device)


def _choose_mode(mode: str, rates: DeviceRates | None) -> str:
    """The mode asked for, or ``"auto"`` still to decide after the traced step (see [Note: measured and
    estimated])."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if mode == "auto" and rates is not None:
        return "estimated"  # another device's rates: a dry run
    return mode


def _live_bytes(module: nn.Module, device: torch.device) -> int:
    """Bytes ``module`` holds on ``device`` now (parameters, gradients, buffers): what is alive beside a profiled
    copy."""
    storages: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        for u in (t, t.grad):
            if isinstance(u, Tensor) and not u.is_meta and u.device == device:
                storages[u.untyped_storage().data_ptr()] = u.untyped_storage().nbytes()
    return sum(storages.values())


def _free_memory(request: _Request) -> int | None:
    """What the memory the caller counts on (the budget) leaves beside the model: the room of setup's benchmarks."""
    if request.available_memory is None:
        return None
    return max(request.available_memory - _live_bytes(request.module, request.target), 0)


def _floating_dtype(module: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in _unique_parameters(module):
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


class _Session:
    """One profiling run over the work copy: the traced step, then timed steps (measured mode)."""

    def __init__(
        self,
        work: nn.Module,
        runner: StepRunner,
        optimizers: list[Optimizer],
        device: torch.device,
        estimated: bool,
    ) -> None:
        self.work = work
        self.runner = runner
        self.optimizers = optimizers
        self.device = device
        self.estimated = estimated
        self.clock = device_clock(device)
        self.tracer = ModuleTracer(work, self.clock)
        self.state = OptimizerState()
        self.grad_bytes: dict[str, int] = {}  # the largest over the traced step's backwards
        self.failed_optimizers: list[Optimizer] = []
        self.loss_memory: LossMemory | None = None
        # The step running: its tracer, whether it counts gradients and optimizer state (the traced step), the
        # optimizers counted so far, and the seconds its optimizer steps took.
        self._tracer: ModuleTracer | None = None
        self._counting = False
        self._counted: list[Optimizer] = []
        self._optimizer_seconds = 0.0
        # The largest live bytes of a step in steady state (see `traced_step`), and of the traced step before any
        # optimizer state existed.
        self.peak_bytes = 0
        self._meter: MemoryMeter | None = None
        self._stateless_peak = 0

    def _backward(self, loss: Tensor, tracer: ModuleTracer | None, *args: Any, **kwargs: Any) -> None:
        if not loss.requires_grad:
            return  # nothing trainable in the step: no backward to profile
        try:
            if tracer is not None:
                tracer.backward(loss, *args, **kwargs)
            else:
                loss.backward(*args, **kwargs)
        except Exception as error:
            raise ProfilingError(
                f"backward of {self.runner.name}'s loss failed on the example batch: {type(error).__name__}: {error}"
            ) from error
        if self._counting:
            for name, nbytes in grad_bytes_by_module(self.work).items():
                self.grad_bytes[name] = max(self.grad_bytes.get(name, 0), nbytes)

    def _step_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Step ``optimizers``; in the traced step, count their state (by rule, else from the stepped instance, else
        from a proxy when the step cannot run on fake tensors) the first time each steps."""
        new = [o for o in optimizers if self._counting and o not in self._counted]
        if new and not self._counted and isinstance(self._meter, LiveStorageTracker):
            # The forward and backward, before the first state is allocated. (CUDA's allocator meter holds its peak
            # only as of its last mark: there the traced step's own peak stands, the first step's.)
            self._stateless_peak = self._meter.peak
        self._counted.extend(new)
        unknown = state_from_rule(new, self.work, self.state) if new else []
        for optimizer in optimizers:
            if optimizer in self.failed_optimizers:
                continue
            try:
                optimizer.step()
            except Exception as error:
                if not self.estimated:
                    raise ProfilingError(
                        f"{type(optimizer).__name__}.step() failed on the profiled copy of {self.runner.name}: "
                        f"{type(error).__name__}: {error}"
                    ) from error
                self.failed_optimizers.append(optimizer)
        stepped = [o for o in unknown if o not in self.failed_optimizers]
        if stepped:
            state_from_instance(stepped, self.work, self.state)
            self.state.source = "instance"
        failed = [o for o in unknown if o in self.failed_optimizers]
        if failed:
            state_from_proxy(failed, self.work, self.state)

    def _zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if not self.optimizers:
            for p in self.work.parameters():
                p.grad = None
        self.runner.release()  # the end of the step: Lightning drops training_step's output about here

    # ---------------------------------------------------------------- a manual training_step's calls
    # (see lightning_osdp/profiling/step.py [Note: manual optimization while profiling])
    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """``self.manual_backward(loss)`` in the user's step: the backward of the step running."""
        self._backward(loss, self._tracer, *args, **kwargs)

    def manual_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None) -> Any:
        """``opt.step(closure)`` in the user's step: the closure, then the step, timed as the optimizer's."""
        result = closure() if closure is not None else None
        start = self.clock()
        with self._tracer.optimizer() if self._tracer is not None else nullcontext():
            self._step_optimizers([optimizer])
        self._optimizer_seconds += self.clock() - start
        return result

    # ---------------------------------------------------------------- the steps
    def _run_step(self, tracer: ModuleTracer | None, *, counting: bool = False) -> float:
        """One training step (``tracer`` attributes it to modules, when given); returns the optimizer's seconds."""
        self._tracer, self._counting, self._optimizer_seconds = tracer, counting, 0.0
        try:
            with tracer.forward() if tracer is not None else nullcontext():
                loss = self.runner.forward_loss()
            if loss is not None:  # else a manual step, which ran its own backward and steps
                self._backward(loss, tracer)
                self._step_all()
            self._zero_grad()
        finally:
            self._tracer, self._counting = None, False
        return self._optimizer_seconds

    def _step_all(self) -> None:
        """Step every optimizer after an automatic step's backward."""
        start = self.clock()
        with self._tracer.optimizer() if self._tracer is not None else nullcontext():
            self._step_optimizers(self.optimizers)
        self._optimizer_seconds += self.clock() - start

    def traced_step(self) -> StepRecord:
        """The step that records activations, FLOPs, gradients, optimizer state and the loss region's memory."""
        excluded = [*self.work.parameters(), *self.work.buffers(), *tree_leaves(self.runner.batch)]
        meter = self._meter = memory_meter(self.device, fake=self.estimated).start(self.work, *self.optimizers)
        region = LossRegionRecorder(meter)
        try:
            with self.tracer.iteration(memory=True, ops=True, excluded=excluded, region=region) as record:
                self._run_step(self.tracer, counting=True)
        finally:
            peak, self._meter = meter.stop(), None
        # The traced step is the first: its optimizers allocate their state in its optimizer step, after its backward.
        # Every later step runs its forward and backward beside that state, so its peak is that of the first step's
        # forward and backward plus the state.
        self.peak_bytes = max(peak, self._stateless_peak + self.state.total_tensor_bytes)
        self.loss_memory = region.result()
        return record

    def hooked_step(self) -> StepRecord:
        """A step whose time is attributed to modules (hooks, no operator tracing)."""
        with self.tracer.iteration() as record:
            self._run_step(self.tracer)
        return record

    def plain_step(self) -> tuple[float, float]:
        """``(step seconds, optimizer-step seconds)`` of a step without any hook."""
        start = self.clock()
        optimizer = self._run_step(None)
        return self.clock() - start, optimizer


def _module_profiles(
    work: nn.Module, record: StepRecord, session: _Session, times: dict[str, tuple[float, float]]
) -> dict[str, ModuleProfile]:
    own, _ = account_parameters(work)
    names = [name for name, _ in work.named_modules()]
    children: dict[str, list[str]] = {name: [] for name in names}
    parents: dict[str, str | None] = {}
    for name in names:
        parent = None if name == "" else (name.rsplit(".", 1)[0] if "." in name else "")
        while parent is not None and parent not in children:  # a parent deduplicated away by named_modules
            parent = None if parent == "" else (parent.rsplit(".", 1)[0] if "." in parent else "")
        parents[name] = parent
        if parent is not None:
            children[parent].append(name)
    profiles = {}
    for name, mod in work.named_modules():
        figures, traced = own[name], record.modules[name]
        fwd, bwd = times[name]
        profiles[name] = ModuleProfile(
            name=name,
            type=type(mod).__name__,
            parent=parents[name],
            children=children[name],
            param_count=figures.param_count,
            param_bytes=figures.param_bytes,
            param_shapes=figures.param_shapes,
            trainable_param_bytes=figures.trainable_param_bytes,
            grad_bytes=session.grad_bytes.get(name, 0),
            optim_state_bytes=session.state.tensor_bytes.get(name, 0),
            activation_bytes=traced.activation_bytes,
            output_bytes=traced.output_bytes,
            fwd_seconds=fwd,
            bwd_seconds=bwd,
            fwd_flops=traced.fwd_flops,
            fwd_causal_skipped_flops=traced.fwd_causal_skipped_flops,
            buffer_bytes=figures.buffer_bytes,
            optim_scalar_bytes=session.state.scalar_bytes.get(name, 0),
            input_bytes=traced.input_bytes,
            input_saved_bytes=traced.input_saved_bytes,
            backward_transient_bytes=traced.backward_transient_bytes,
            caller=traced.caller,
        )
    return profiles


def _optimizer_traffic_estimate(session: _Session) -> OpTally:
    # An optimizer whose step cannot run on fake tensors: read parameter and gradient, write the parameter, and
    # read and write each state tensor once per step.
    tally = OpTally()
    for optimizer in session.failed_optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None or p.requires_grad:
                    nbytes = p.numel() * p.element_size()
                    tally.memory_ops += 1
                    tally.memory_bytes += 3 * nbytes
    tally.memory_bytes += 2 * session.state.total_tensor_bytes
    return tally


@dataclass
class _Timing:
    modules: dict[str, tuple[float, float]]  # own (forward, backward) seconds
    overhead: float
    optimizer: float


def _measured_timing(session: _Session, record: StepRecord, repeats: int, info: dict[str, Any]) -> _Timing:
    hooked: list[StepRecord] = []
    plain: list[tuple[float, float]] = []
    with timed_section():
        for _ in range(repeats):
            # Alternating the two kinds spreads a change of machine load over both.
            hooked.append(session.hooked_step())
            plain.append(session.plain_step())
    modules = {
        name: (
            statistics.median(r.modules[name].fwd_seconds for r in hooked),
            statistics.median(r.modules[name].bwd_seconds for r in hooked),
        )
        for name in record.modules
    }
    step = statistics.median(s for s, _ in plain)
    optimizer = statistics.median(o for _, o in plain)
    unattributed = step - sum(f + b for f, b in modules.values())
    info["measured_step_seconds"] = step
    info["unattributed_seconds"] = unattributed
    # Noise can make the modules' medians add up to more than the step's: the optimizer step is a floor.
    return _Timing(modules, max(unattributed, optimizer), optimizer)


def _estimated_timing(session: _Session, record: StepRecord, rates: DeviceRates, info: dict[str, Any]) -> _Timing:
    modules = {name: (rates.seconds(r.fwd_ops), rates.seconds(r.bwd_ops)) for name, r in record.modules.items()}
    optimizer_ops = OpTally()
    optimizer_ops += record.optimizer_ops
    if session.failed_optimizers:
        optimizer_ops += _optimizer_traffic_estimate(session)
        info["optimizer_time"] = "traffic estimate (its step does not run on fake tensors)"
    optimizer = rates.seconds(optimizer_ops)
    overhead = rates.seconds(record.outside.fwd_ops) + rates.seconds(record.outside.bwd_ops) + optimizer
    info["estimated_step_seconds"] = overhead + sum(f + b for f, b in modules.values())
    return _Timing(modules, overhead, optimizer)


def _collective_sizes(param_bytes: int, free: int | None = None) -> list[int]:
    """The buffer sizes the collective benchmark measures: up to the first covering the model's parameter bytes (a
    plan's collectives never exceed them), and, where the budget leaves ``free`` bytes beside the model, only sizes
    whose buffers stay within half of that room (a size's full and sharded buffers, with the previous size's still
    alive when they are allocated: 2.5 times the size at most); two sizes at least, smaller ones if need be."""
    sizes = []
    for size in DEFAULT_SIZES:
        sizes.append(size)
        if size >= param_bytes and len(sizes) >= 2:
            break
    if free is None:
        return sizes
    cap = free // 5
    kept = [size for size in sizes if size <= cap]
    return kept if len(kept) >= 2 else [max(cap // 4, 256), max(cap, 1024)]


def _collectives(
    collectives: Mapping[str, CollectiveFit] | None,
    group: Any,
    node_groups: NodeGroups | None,
    param_bytes: int,
    budget: float,
    free: int | None,
) -> tuple[dict[str, CollectiveFit], dict[str, CollectiveFit]]:
    """The fits within a node (the world's, on one node) and across nodes, measured on buffers that fit in ``free``
    (see ``_collective_sizes``)."""
    if collectives is not None:
        return dict(collectives), {}
    if not (dist.is_available() and dist.is_initialized()):
        return zero_cost_collectives(1), {}
    sizes = _collective_sizes(param_bytes, free)
    if node_groups is not None and node_groups.nodes > 1:
        return benchmark_levels(node_groups, sizes=sizes, time_budget_seconds=budget)
    return benchmark_collectives(group, sizes=sizes, time_budget_seconds=budget), {}


@dataclass
class _Request:
    """What ``profile`` was asked, checked and resolved (the same on every rank but for the memory it sees)."""

    module: nn.Module
    example_batch: Any
    name: str
    target: torch.device
    spec: OptimizerSpec | None
    schedulers: list[Any]  # configure_optimizers' (for a manual training_step's `self.lr_schedulers()`)
    param_names: dict[int, str]
    param_bytes: int
    mode: str
    loss_fn: LossFn | None
    step: str
    step_context: Callable[[], AbstractContextManager[Any]] | None
    repeats: int
    rates: DeviceRates | None
    copy_bytes_per_second: float | None
    batch_source: str
    available_memory: int | None


def _request(
    module: nn.Module,
    optimizer: OptimizerSpec | None,
    device: torch.device | str | None,
    repeats: int,
    mode: str,
    available_memory: int | None,
    copy_bytes_per_second: float | None,
    **passed: Any,
) -> _Request:
    """Check ``profile``'s arguments and resolve the device, the optimizers and the mode."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"profile() takes an nn.Module, not {type(module).__name__}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if copy_bytes_per_second is not None and not copy_bytes_per_second > 0:
        raise ValueError(f"copy_bytes_per_second must be positive, got {copy_bytes_per_second}")
    name = type(module).__name__
    params = _unique_parameters(module)
    if not params:
        raise ProfilingError(f"{name} has no parameters: there is nothing to shard, so nothing to profile")
    on_meta = any(t.is_meta for t in [*params, *module.buffers()])
    target = _resolve_device(module, device, on_meta)
    spec: OptimizerSpec | None = optimizer
    schedulers: list[Any] = []
    if spec is None and is_lightning_module(module):
        spec, schedulers = configured_optimization(module)
    return _Request(
        module=module,
        name=name,
        target=target,
        spec=spec,
        param_names={id(p): n for n, p in module.named_parameters(remove_duplicate=False)},
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        schedulers=schedulers,
        mode=_choose_mode(mode, passed.get("rates")),
        available_memory=available_memory,
        repeats=repeats,
        copy_bytes_per_second=copy_bytes_per_second,
        **passed,
    )


def _replica(stack: ExitStack, request: _Request, fake: bool) -> tuple[nn.Module, Any, StandInValues | None]:
    """The work copy of the model and the batch on the target device (fake tensors when ``fake``, whose mode is
    entered on ``stack`` with the stand-ins that answer the step's value reads, returned third; see ``values.py``)."""
    target = request.target
    if not fake:
        work = stack.enter_context(measured_replica(request.module, target))
        return work, tree_map(lambda t: t.to(target) if isinstance(t, Tensor) else t, request.example_batch), None
    fake_mode = fake_tensor_mode()
    work = stack.enter_context(fake_replica(request.module, target, fake_mode))
    with fake_mode:
        batch = tree_map(
            lambda t: fake_mode.from_tensor(t).to(target) if isinstance(t, Tensor) else t, request.example_batch
        )
    stack.enter_context(fake_mode)
    values = stack.enter_context(StandInValues())
    stack.enter_context(StandInMethods(values))
    return work, batch, values


def _traced(session: _Session, request: _Request) -> StepRecord:
    """The traced step, an estimated mode's failure on fake tensors explained."""
    try:
        return session.traced_step()
    except ProfilingError:
        raise
    except Exception as error:
        if not session.estimated:
            raise
        raise ProfilingError(
            f"{request.name} cannot be estimated on fake tensors ({type(error).__name__}: {error}); its step depends "
            "on tensor values. Profile it in measured mode, on a smaller configuration if it does not fit"
        ) from error


@dataclass
class _FullRecompute:
    """One block under full recomputation: the live bytes its forward adds (``ModuleProfile.recompute_forward_bytes``)
    and its replay in backward (``recompute_replay_seconds``): timed on the device, or, on fake tensors, its
    operators for the rates."""

    forward_bytes: int = 0
    plain_forward_bytes: int = 0
    replay_seconds: float | None = None
    replay_ops: OpTally = field(default_factory=OpTally)


def _full_recompute(session: _Session, repeats: int) -> dict[str, _FullRecompute]:
    """Per block of the replica, its figures under full recomputation: the step's forward once more, every block
    checkpointed as the executor does it, each block's window between its forward hooks read off the memory meter,
    and its replay (``replay.py`` [Note: the recomputation stops at the last saved tensor]) run in its forward hook;
    there too, the window of its forward run plainly, saving for backward (``ModuleProfile.forward_peak_bytes``)."""
    from lightning_osdp.apply.recompute import RecomputedForward, recompute_modules
    from lightning_osdp.plan import default_units

    work = session.work
    blocks = default_units(work)
    if not blocks:
        return {}
    recompute_modules(work, blocks)
    meter = memory_meter(session.device, fake=session.estimated)
    started: dict[str, int] = {}
    figures = {name: _FullRecompute() for name in blocks}
    handles = []

    def plain(module: nn.Module, args: Any, kwargs: Any, figure: _FullRecompute) -> None:
        inner = module.__dict__["forward"]
        fresh_args, fresh_kwargs = fresh_caches((args, kwargs))
        start = meter.mark()[1]
        with torch.enable_grad():
            output = inner.inner(*fresh_args, **fresh_kwargs)
        figure.plain_forward_bytes = max(figure.plain_forward_bytes, meter.mark()[0] - start)
        del output

    def replay(module: nn.Module, args: Any, kwargs: Any, figure: _FullRecompute) -> None:
        inner = module.__dict__["forward"]
        assert isinstance(inner, RecomputedForward)
        saves = count_saves(inner.inner, *fresh_caches((args, kwargs)))
        # A block called more than once a step is recomputed once per call, as its forward seconds count every call.
        if session.estimated:
            fresh_args, fresh_kwargs = fresh_caches((args, kwargs))
            figure.replay_ops += replay_ops(inner.inner, fresh_args, fresh_kwargs, saves)
        else:
            figure.replay_seconds = (figure.replay_seconds or 0.0) + statistics.median(
                time_full_replay(inner.inner, lambda: fresh_caches((args, kwargs)), session.clock, saves)
                for _ in range(max(repeats, 1))
            )

    for name in blocks:
        module = work.get_submodule(name)

        def pre(*_: Any, name: str = name) -> None:
            started[name] = meter.mark()[1]

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            window = meter.mark()[0]
            figure = figures[name]
            figure.forward_bytes = max(figure.forward_bytes, window - started[name])
            plain(module, args, kwargs, figure)
            replay(module, args, kwargs, figure)
            meter.mark()  # the replay's own window is no block's

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    meter.start(work, *session.optimizers)
    try:
        loss = session.runner.forward_loss()
        del loss
    finally:
        meter.stop()
        for handle in handles:
            handle.remove()
        session.runner.output = None
    return figures


def _selective(session: _Session, repeats: int) -> dict[str, SelectiveFigures]:
    """Per block of the replica, its figures under selective recomputation (see ``selective.py``)."""
    from lightning_osdp.plan import default_units

    try:
        return measure_selective(
            session.work,
            default_units(session.work),
            session.runner.forward_loss,
            session.device,
            fake=session.estimated,
            clock=session.clock,
            repeats=repeats,
            roots=tuple(session.optimizers),
        )
    finally:
        session.runner.output = None


@dataclass
class _Traced:
    """A traced step: the profile (its times zero unless it was measured), what the trace recorded, the session it
    ran in, the largest live bytes of the step, and the blocks' figures under selective and full recomputation (whose
    replays the rates time in the estimated modes)."""

    profile: ModelProfile
    record: StepRecord
    session: _Session
    peak_bytes: int
    selective: dict[str, SelectiveFigures] = field(default_factory=dict)
    full: dict[str, _FullRecompute] = field(default_factory=dict)


def _trace(request: _Request, *, fake: bool, cut: tuple[RepeatedBlocks, int] | None = None) -> _Traced:
    """The traced step on a copy of the model (fake tensors when ``fake``); when not ``fake``, timed steps too. ``cut``:
    the copy's list of repeated blocks cut to that many (see ``repeats.py`` [Note: depth by extrapolation])."""
    target, name = request.target, request.name
    info: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": request.repeats}
    copy_rate = request.copy_bytes_per_second
    with ExitStack() as stack:
        # The traced steps run under dispatch modes, where dynamo would mark the user's compiled modules to be
        # skipped for the whole run (see lightning_osdp/step_monitor.py [Note: measured steps and torch.compile]):
        # the profile measures their eager code.
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        # Benchmarked before the fake mode is entered: under it, the benchmark's tensors would be fake too.
        if copy_rate is None:
            size = min(max(request.param_bytes, 4 << 20), 64 << 20)
            free = _free_memory(request)
            if free is not None:
                # Its two buffers are setup's memory too: they stay within half of what the model leaves free.
                size = max(min(size, free // 4), 4 << 10)
            copy_rate = measure_copy_bandwidth(target, size)
        work, batch, values = _replica(stack, request, fake)
        if cut is not None:
            cut[0].cut(work, cut[1])
        runner = StepRunner(
            work, batch, loss_fn=request.loss_fn, step_context=request.step_context, name=name, step=request.step
        )
        stack.enter_context(runner.quiet_logging())
        if fake:
            stack.enter_context(runner.quiet_metrics())
        optimizers = rebuild_optimizers(request.spec, request.param_names, work, name, partial=cut is not None)
        session = _Session(work, runner, optimizers, target, fake)
        if runner.manual:
            stack.enter_context(
                runner.manual_optimization(
                    optimizers, request.schedulers, backward=session.manual_backward, step=session.manual_step
                )
            )
        record = _traced(session, request)
        if fake:
            timing = _Timing({n: (0.0, 0.0) for n in record.modules}, 0.0, 0.0)
        else:
            timing = _measured_timing(session, record, request.repeats, info)
        modules = _module_profiles(work, record, session, timing.modules)
        # Last: they checkpoint the replica's blocks for good (fully, then selectively).
        full = _full_recompute(session, request.repeats)
        for block, recomputed in full.items():
            modules[block].recompute_forward_bytes = recomputed.forward_bytes
            modules[block].forward_peak_bytes = recomputed.plain_forward_bytes
            modules[block].recompute_replay_seconds = recomputed.replay_seconds
        selective = _selective(session, request.repeats)
        for block, figures in selective.items():
            if figures.mutated:
                info.setdefault("selective_refused", {})[block] = figures.mutated
                continue
            modules[block].selective_kept_bytes = figures.kept_bytes
            modules[block].selective_forward_bytes = figures.forward_bytes
            modules[block].selective_replay_seconds = figures.replay_seconds
        _, tied = account_parameters(work)
        if values is not None and (values.reads or values.sized):
            info.update(values.report())
        info["optimizer_state"] = session.state.source if optimizers else "none"
        if record.unsized_tensors:
            # Fake tensors cannot know the size of a value-dependent result (boolean masking, nonzero).
            info["value_dependent_sizes"] = record.unsized_tensors
            warnings.warn(
                f"{name}: {record.unsized_tensors} saved tensors or FLOP counts have value-dependent sizes that "
                "estimated mode counts as 0; its activation bytes and times are lower bounds",
                stacklevel=6,  # profile()'s caller, through from_rank_zero
            )
    trainable_with_grad = sum(session.grad_bytes.values())
    device_name = str(target) + (f" ({torch.cuda.get_device_name(target)})" if target.type == "cuda" else "")
    result = ModelProfile(
        modules=modules,
        device=device_name,
        mode="estimated" if fake else "measured",
        optimizer="+".join(type(o).__name__ for o in optimizers),
        optim_state_factor=session.state.total_tensor_bytes / trainable_with_grad if trainable_with_grad else 0.0,
        tied=tied,
        batch={**describe_batch(request.example_batch), "source": request.batch_source},
        step_overhead_seconds=timing.overhead,
        extra_activation_bytes=record.outside.activation_bytes,
        info=info,
        optimizer_step_seconds=timing.optimizer,
        forward_order=record.forward_order,
        copy_bytes_per_second=copy_rate,
        loss=session.loss_memory,
        step_calls=runner.calls,
    )
    info["step_peak_bytes"] = session.peak_bytes  # the copy's steady-state step, the model's copy included
    return _Traced(result, record, session, session.peak_bytes, selective, full)


def _timed_from_rates(traced: _Traced, request: _Request, *, blocks: bool) -> ModelProfile:
    """The traced profile timed by the rates (the request's, else measured on the device), and, with ``blocks``,
    its blocks timed on the device one at a time (see ``blocks.py`` [Note: a profile that fits])."""
    from lightning_osdp.plan import default_units

    profile, info = traced.profile, traced.profile.info
    free = _free_memory(request)
    budget = free // 2 if free is not None else None
    rates = request.rates or measure_device_rates(request.target, _floating_dtype(request.module), max_bytes=budget)
    timing = _estimated_timing(traced.session, traced.record, rates, info)
    if blocks:
        measured = measure_blocks(
            request.module,
            default_units(request.module),
            traced.record,
            request.target,
            repeats=request.repeats,
            step_context=request.step_context,
            selective=[name for name, figures in traced.selective.items() if not figures.mutated],
        )
        timing.modules.update(measured.modules)
        info["blocks"] = {"timed": {r: len(m) for r, m in measured.timed.items()}, "skipped": measured.skipped}
        info["estimated_step_seconds"] = timing.overhead + sum(f + b for f, b in timing.modules.values())
    for name, (fwd, bwd) in timing.modules.items():
        profile.modules[name].fwd_seconds, profile.modules[name].bwd_seconds = fwd, bwd
    replays = measured.replay if blocks else {}
    for name, figures in traced.selective.items():
        if figures.mutated:
            continue
        replay = replays.get(name)  # timed with its block, else the rates' figure (selective.py)
        profile.modules[name].selective_replay_seconds = rates.seconds(figures.replay_ops) if replay is None else replay
    full_replays = measured.full_replay if blocks else {}
    for name, full in traced.full.items():
        replay = full_replays.get(name)  # likewise (replay.py)
        profile.modules[name].recompute_replay_seconds = rates.seconds(full.replay_ops) if replay is None else replay
    profile.step_overhead_seconds, profile.optimizer_step_seconds = timing.overhead, timing.optimizer
    profile.rates = rates
    profile.mode = "blocks" if blocks else "estimated"
    return profile


def _profile_locally(request: _Request) -> ModelProfile:
    """This rank's profile of the model, without collectives (see [Note: measured and estimated]). Everything it runs
    (the copy's steps, the blocks, the rate benchmarks) draws from a fork of the global RNG: the run's dropout masks
    and data order are the ones it would have without profiling."""
    target = request.target
    devices = (
        [target.index if target.index is not None else torch.cuda.current_device()] if target.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices):
        return _profile_locally_forked(request)


def _profile_locally_forked(request: _Request) -> ModelProfile:
    if request.mode == "measured":
        return _trace(request, fake=False).profile
    if request.mode == "estimated":
        repeated = find_repeated_blocks(request.module)

        def estimated(keep: int | None) -> ModelProfile:
            cut = (repeated, keep) if repeated is not None and keep is not None else None
            return _timed_from_rates(_trace(request, fake=True, cut=cut), request, blocks=False)

        return traced_by_depth(estimated, repeated)
    traced = _trace(request, fake=True)
    if request.mode != "auto":
        return _timed_from_rates(traced, request, blocks=request.mode == "blocks")
    live = _live_bytes(request.module, request.target)
    limit = _available_memory(request.target) if request.available_memory is None else request.available_memory
    needed = live + traced.peak_bytes
    if needed <= limit:
        measured = _trace(request, fake=False).profile
        measured.info["mode"] = (
            f"auto: a copy's step ({format_bytes(needed)} with the model) fits in {format_bytes(limit)}"
        )
        return measured
    profile = _timed_from_rates(traced, request, blocks=True)
    profile.info["mode"] = (
        f"auto: a copy's step ({format_bytes(needed)} with the model) does not fit in {format_bytes(limit)}"
    )
    return profile


def _configure_model(module: nn.Module) -> None:
    """Build the layers a LightningModule makes in ``configure_model`` (the hook Lightning's sharded strategies build
    models in), as the Trainer does before a strategy's setup: profiling the module as it was constructed would
    find no parameters, or only some. Lightning requires the hook to be idempotent (it calls it at every fit,
    validate, test and predict), so a module the Trainer has already configured is unchanged."""
    base = next((cls for cls in type(module).__mro__ if is_lightning_module_class(cls)), None)
    if base is not None and type(module).configure_model is not base.configure_model:  # type: ignore[attr-defined]
        module.configure_model()  # type: ignore[operator]


def profile(
    module: nn.Module,
    example_batch: Any,
    *,
    optimizer: OptimizerSpec | None = None,
    loss_fn: LossFn | None = None,
    step: str = "auto",
    device: torch.device | str | None = None,
    group: Any = None,
    collectives: Mapping[str, CollectiveFit] | None = None,
    node_groups: NodeGroups | None = None,
    repeats: int = 3,
    mode: str = "auto",
    step_context: Callable[[], AbstractContextManager[Any]] | None = None,
    batch_source: str = "argument",
    available_memory: int | None = None,
    collective_time_budget: float = 2.0,
    rates: DeviceRates | None = None,
    copy_bytes_per_second: float | None = None,
) -> ModelProfile:
    """Profile one training step of ``module`` on ``example_batch``: per-module memory and time, and collectives.

    The model itself is left as it was: profiling runs a copy (see ``replica``), the global RNG state is restored,
    and ``self.log`` is a no-op meanwhile. When a process group is initialised this is a collective call: every
    rank of ``group`` must call it, the collectives are benchmarked on ``group``, and every rank returns rank 0's
    profile (so that every rank builds the same plan); an error on any rank is raised on every rank.

    Args:
        module: a LightningModule (the step is ``training_step(batch, 0)``; the loss is its return value or its
            ``"loss"``) or a plain ``nn.Module`` (``forward(batch)``, then ``loss_fn``), see ``step``. Its
            parameters may be on the meta device (estimated mode). A LightningModule's ``configure_model`` runs
            first, as the Trainer runs it before a strategy's setup (the hook is idempotent).
        example_batch: a representative, full-size batch (see [Note: the representative batch]).
        optimizer: the optimizer(s) built on ``module``'s parameters, an optimizer class, or a factory
            ``params -> optimizer``. Default: ``configure_optimizers()`` of a LightningModule; no optimizer for a
            plain module. Its type decides the optimizer-state bytes (see ``optimizer_state``) and its step is timed.
        loss_fn: ``loss_fn(output, batch)``, the loss when the step is ``forward`` (default: the output's sum).
        step: ``"training_step"`` or ``"forward"``; ``"auto"`` is ``training_step`` for a LightningModule and
            ``forward`` otherwise. Use ``"forward"`` with a LightningModule's ``example_input_array``, which is
            ``forward``'s input, not a training batch.
        device: where to run (measured) or what to estimate for; default the parameters' device (CUDA if
            available, else CPU, for a model on the meta device).
        group: the process group whose collectives are measured; default the world, when initialised.
        collectives: fits measured before (a saved profile's): no benchmark then.
        node_groups: on several nodes, this rank's groups within its node and across nodes: the collectives are
            fitted on both levels (``benchmark_levels``) rather than on ``group``.
        repeats: timed steps (measured mode), after one traced warm-up step.
        mode: ``"measured"``, ``"estimated"``, ``"blocks"`` or ``"auto"`` (see [Note: measured and estimated]).
        step_context: factory of the context the forward runs in (the precision plugin's ``forward_context``).
        batch_source: where the batch came from, recorded in ``ModelProfile.batch``.
        available_memory: bytes ``"auto"`` may count on (the memory budget); default what the device has available
            now.
        collective_time_budget: seconds the collective benchmark may take (see ``benchmark_collectives``).
        rates: the rates estimated mode converts FLOPs and bytes into seconds with, recorded as
            ``ModelProfile.rates``; default benchmarked on ``device`` (``measure_device_rates``). Give another device's
            to estimate a step on hardware that is not here. Measured mode times real steps and does not use them.
        copy_bytes_per_second: the bandwidth of FSDP2's own copies, recorded as ``ModelProfile.copy_bytes_per_second``;
            default benchmarked on ``device`` (``measure_copy_bandwidth``).

    Raises:
        ProfilingError: the model has no parameters, the batch does not run through it (the message names the
            class and the batch's shapes), its optimizer cannot be rebuilt, or estimated mode meets code that
            depends on tensor values.
    """
    start = time.perf_counter()
    _configure_model(module)

    def local() -> tuple[dict[str, Any], int, int | None]:
        request = _request(
            module,
            optimizer,
            device,
            repeats,
            mode,
            available_memory,
            copy_bytes_per_second,
            example_batch=example_batch,
            loss_fn=loss_fn,
            step=step,
            step_context=step_context,
            rates=rates,
            batch_source=batch_source,
        )
        return _profile_locally(request).to_dict(), request.param_bytes, _free_memory(request)

    # Every rank checks the arguments and profiles its own replica; an error on one is raised on all, before any rank
    # enters the benchmark's collectives (where the others would wait for it); then every rank takes rank 0's figures.
    what = f"profiling {type(module).__name__}"
    # Rank 0's room sizes every rank's benchmark buffers: the ranks must call the same collectives.
    document, param_bytes, free = from_rank_zero(local, what=what, everywhere=True, group=group)
    result = ModelProfile.from_dict(document, source="rank 0")

    def benchmark() -> tuple[dict[str, CollectiveFit], dict[str, CollectiveFit], float, float]:
        started = time.perf_counter()
        fits, across = _collectives(collectives, group, node_groups, param_bytes, collective_time_budget, free)
        return fits, across, time.perf_counter() - started, time.perf_counter() - start

    # Collectives inside: every rank joins; rank 0's fits and timings are kept.
    fits, across, benchmark_seconds, total_seconds = from_rank_zero(
        benchmark, what="benchmarking collectives", everywhere=True, group=group
    )
    result.collectives = fits
    result.inter_node_collectives = across
    result.nodes = node_groups.nodes if across and node_groups is not None else 1
    result.world_size = (next(iter(fits.values())).world_size if fits else 1) * result.nodes
    result.info["collectives_seconds"] = benchmark_seconds
    result.profiling_seconds = total_seconds
    return result
