"""``osdp plan``: will it fit, and how fast? A dry run of OSDP and its baselines, with no GPU and no cluster.

The model is built on the meta device (a billion parameters cost no memory), profiled on fake tensors with the
target hardware's rates (``estimate.py``, ``hardware.py``), and planned by the same solver the strategy runs.
Beside the OSDP plan it predicts the plain strategies OSDP chooses among, each applied uniformly with one unit per
block as Lightning users wrap them (``Plan.uniform``): DDP (all ``no_shard``), ZeRO-2 (all ``shard_grad_op``), FSDP
(all ``full_shard``) and, on several nodes, HSDP (all ``hybrid_shard``); and for each the largest per-device batch
size whose predicted peak fits the budget.

Several nodes: ``--nodes N --gpus-per-node G`` (or a ``--world-size`` larger than one machine of the ``--hardware``
entry); the network between them is the entry's own or ``--network NAME`` (``hardware.py``'s [Note: the network
between nodes]).

Example, a GPT-2-XL-shaped model (1.3B parameters) on 8 GeForce RTX 4090s::

    osdp plan --model examples/gpt/gpt.py:GPTModule \\
        --init-args '{"width": 2048, "depth": 24, "heads": 16, "context_length": 1024, "vocab_size": 50304}' \\
        --world-size 8 --memory 24GiB --hardware rtx4090-pcie --batch-size 4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_osdp.budget import CUDA_RESERVE_BYTES, check_memory_budget, format_bytes
from lightning_osdp.cli.batch import BatchSource, batch_source
from lightning_osdp.cli.batch_search import AnyPlanFits, Probe, largest_batch
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.estimate import BatchScaledProfile, estimated_profile
from lightning_osdp.cli.hardware import HARDWARE, HardwareFigures, get_hardware, get_network, hardware_from_file
from lightning_osdp.cli.model import (
    RunConfig,
    build_on_meta,
    discover_cli_model,
    import_object,
    parse_init_args,
    read_configs,
)
from lightning_osdp.cli.output import Output
from lightning_osdp.cli.parsers import OPTIMIZERS, PRECISIONS
from lightning_osdp.cost_model import Prediction, predict
from lightning_osdp.cost_model.device_memory import DeviceMemory, plan_device_memory, plan_memory_line
from lightning_osdp.options import BF16_POLICY
from lightning_osdp.plan import MODES, Plan, Recomputation
from lightning_osdp.profiling import ModelProfile
from lightning_osdp.solver import InfeasibleBudgetError, format_plan
from lightning_osdp.solver.candidates import Recompute
from lightning_osdp.solver.policy import DEFAULT_MEMORY_HEADROOM, PlannerOptions, planned_budget
from lightning_osdp.solver.reuse import reusing_problems
from lightning_osdp.topology import Topology, TopologyError

__all__ = ["BASELINES", "MFU_CONVENTIONS", "DryRun", "StrategyFigures", "model_flops_utilization", "run"]

#: The uniform strategies compared with OSDP: (name, mode, how every block recomputes). "+AC": activation checkpointing
#: of every block (``recompute="full"``), as Lightning users configure it by hand; "+SAC": selective (per-operator)
#: activation checkpointing of every block (``recompute="selective"``), torchtitan's setting. HSDP only where its shard
#: groups are not the world (on one node of one group it is FSDP); HSDP+AC and HSDP+SAC are the published
#: several-node settings of foundation-model-stack's and torchtitan's FSDP runs.
BASELINES: tuple[tuple[str, str, Recomputation], ...] = (
    ("DDP", "no_shard", "none"),
    ("ZeRO-2", "shard_grad_op", "none"),
    ("FSDP", "full_shard", "none"),
    ("HSDP", "hybrid_shard", "none"),
    ("DDP+SAC", "no_shard", "selective"),
    ("ZeRO-2+SAC", "shard_grad_op", "selective"),
    ("FSDP+SAC", "full_shard", "selective"),
    ("HSDP+SAC", "hybrid_shard", "selective"),
    ("DDP+AC", "no_shard", "full"),
    ("ZeRO-2+AC", "shard_grad_op", "full"),
    ("FSDP+AC", "full_shard", "full"),
    ("HSDP+AC", "hybrid_shard", "full"),
)

#: ``--mfu-convention``: each convention's name in the report and what its legend adds (the default first, as
#: ``parsers.MFU_CONVENTIONS`` spells them). See :func:`model_flops_utilization`.
MFU_CONVENTIONS: dict[str, tuple[str, str]] = {
    "palm": (
        "PaLM convention, causal attention counted in full",
        "as PaLM's appendix B, torchtitan and docs/benchmarks.md count it",
    ),
    "flash-attention": (
        "FlashAttention convention, causal attention at the scores computed",
        "about half of them, as FlashAttention's benchmarks count it",
    ),
}


@dataclass
class DryRun:
    """Everything a dry run was asked for, resolved from the options and configs."""

    model: nn.Module
    model_name: str
    model_spec: str
    init_args: dict[str, Any]
    figures: HardwareFigures
    world_size: int
    topology: Topology
    budget: int
    budget_source: str
    batch_size: int
    batch: BatchSource
    precision: str
    optimizer: Any
    optimizer_note: str
    #: the planner's options, as OSDPStrategy holds them (``--modes``, ``--max-split``, ``--activation-checkpointing``,
    #: ``--solver-time-limit``, ``--memory-headroom``, ``--solver``, ``--solver-gap``)
    planner: PlannerOptions
    #: tokens a sample trains on (``--tokens-per-sample``, else the batch's: a token window's ``context_length``);
    #: ``None``: unknown, no tokens/s columns
    tokens_per_sample: int | None = None
    #: micro-batches per optimizer step (``--accumulate-grad-batches``, else the config's trainer's): a step trains
    #: ``batch_size`` samples this many times
    accumulation: int = 1
    #: wall seconds of the stages, for the closing note (profiling, the OSDP solve, the batch search)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def planned_budget(self) -> int:
        """The budget every row is judged against: ``budget`` less the planner's headroom (as the strategy plans)."""
        return planned_budget(self.budget, self.planner.memory_headroom)

    @property
    def card_bytes(self) -> int | None:
        """The GPU's memory, against which a row's device total is judged (``None``: not a GPU, or not known)."""
        return self.figures.memory_bytes if self.figures.device.startswith("cuda") else None

    def device_memory(self, row: StrategyFigures) -> DeviceMemory | None:
        """``row``'s device memory on the GPU (reserved peak, NCCL's buffers, the CUDA context; ``None``: no card)."""
        return None if self.card_bytes is None else plan_device_memory(row.prediction, row.plan, self.topology)

    def fits(self, row: StrategyFigures) -> bool:
        """Whether ``row`` fits: its allocated peak within the budget less the headroom, and on a GPU its device
        total within the card (``cost_model/device_memory.py``)."""
        return self.fits_prediction(row.plan, row.prediction)

    def fits_prediction(self, plan: Plan, prediction: Prediction) -> bool:
        """:meth:`fits` for ``plan`` predicted as ``prediction`` (at any batch size: the batch search asks it)."""
        if prediction.peak_bytes > self.planned_budget:
            return False
        card = self.card_bytes
        return card is None or plan_device_memory(prediction, plan, self.topology).fits(card)


@dataclass
class StrategyFigures:
    """One row of the comparison.

    Attributes:
        name: ``"OSDP"`` or a baseline's (:data:`BASELINES`: ``"DDP"``, ``"ZeRO-2"``, ``"FSDP"``, ``"HSDP"``, each
            also with ``"+AC"``, every block recomputed, and ``"+SAC"``, every block recomputed selectively).
        plan: the plan predicted (OSDP's from the solver).
        prediction: its prediction at the requested batch size.
        max_batch: the largest per-device batch size at which the row fits (:meth:`DryRun.fits_prediction`; 0: none;
            ``None``: not searched).
        max_batch_seconds: the predicted step time at ``max_batch``.
    """

    name: str
    plan: Plan
    prediction: Prediction
    max_batch: int | None = None
    max_batch_seconds: float | None = None


def _precision_plugin(precision: str) -> Any:
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    if precision == "bf16-fsdp":
        # Lightning's bf16-mixed (autocast) under FSDP2's policy: see OSDPStrategy(mixed_precision=...).
        return MixedPrecision("bf16-mixed", "cpu")
    if precision.endswith("-mixed"):
        # The autocast dtype is what matters for the profile; device "cpu": the fake tensors live there.
        return MixedPrecision(precision, "cpu")  # type: ignore[arg-type]
    if precision in ("bf16-true", "16-true"):
        return HalfPrecision(precision)  # type: ignore[arg-type]
    return Precision()


def _model_spec(args: argparse.Namespace, config: RunConfig, out: Output) -> str:
    if args.model:
        return str(args.model)
    if config.model:
        return config.model
    if args.config:
        found = discover_cli_model(args.config[-1])
        if found is not None:
            spec, script = found
            out.note(f"model class {spec.rpartition(':')[2]} from the LightningCLI call in {script}")
            return spec
    raise CLIError(
        "no model given: pass --model module:Class (or path/to/file.py:Class), or a --config whose model: section "
        "has a class_path"
    )


def _optimizer_factory(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> optimizer`` for an ``--optimizer`` name (``parsers.OPTIMIZERS``)."""
    cls, kwargs = OPTIMIZERS[name]
    return functools.partial(getattr(torch.optim, cls), **kwargs)


def _optimizer(choice: str, model: nn.Module) -> tuple[Any, str]:
    if choice != "auto":
        return _optimizer_factory(choice), f"--optimizer {choice}"
    configure = getattr(model, "configure_optimizers", None)
    if configure is None:
        return _optimizer_factory("adamw"), "assumed: the model has no configure_optimizers(); --optimizer to choose"
    try:
        configure()
    except Exception as err:
        # Often a learning-rate schedule that asks the (absent) Trainer for its number of steps: the optimizer's
        # type, which is all the profile needs, is then unknown.
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:100]
        note = f"assumed: configure_optimizers() needs a Trainer ({reason}); --optimizer to choose"
        return _optimizer_factory("adamw"), note
    return None, "from configure_optimizers()"


def _modes(text: str | None, config: RunConfig) -> tuple[str, ...]:
    names = [m.strip() for m in text.split(",")] if text else (config.modes or list(MODES))
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise CLIError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(MODES)}")
    return tuple(names)


#: The flag that fills each of the planner's options (``PlannerOptions``' fields, the strategy's arguments).
_PLANNER_FLAGS = {
    "modes": "--modes",
    "max_split": "--max-split",
    "activation_checkpointing": "--activation-checkpointing",
    "solver_time_limit": "--solver-time-limit",
    "memory_headroom": "--memory-headroom",
    "solver": "--solver",
    "solver_gap": "--solver-gap",
}


def resolve(args: argparse.Namespace, out: Output) -> DryRun:
    """Read the options and configs, build the model on the meta device; every user error is a :class:`CLIError`."""
    config = read_configs(args.config)
    nodes = _nodes(args, config)
    world_size = nodes * args.gpus_per_node if args.nodes is not None else (args.world_size or config.world_size)
    if not world_size or world_size < 1:
        raise CLIError(
            "give --world-size N (the number of GPUs), --nodes N --gpus-per-node G, or a config whose trainer.devices "
            "is a number"
        )
    network = get_network(args.network) if args.network else None
    precision_flag = args.precision or config.precision or "32-true"
    if precision_flag not in PRECISIONS:
        raise CLIError(
            f"precision {precision_flag!r} is not supported by the dry run; use one of {', '.join(PRECISIONS)}"
        )
    precision = PRECISIONS[precision_flag]
    if args.hardware and args.hardware_profile:
        raise CLIError("give --hardware or --hardware-profile, not both")
    if args.hardware:
        figures = get_hardware(args.hardware).figures(world_size, precision, nodes=nodes, network=network)
    elif args.hardware_profile:
        figures = hardware_from_file(args.hardware_profile, world_size, nodes=nodes, network=network)
    else:
        raise CLIError(f"give --hardware NAME (known: {', '.join(HARDWARE)}) or --hardware-profile FILE")
    shard_group_size = args.shard_group_size if args.shard_group_size is not None else config.shard_group_size
    try:
        topology = Topology(figures.nodes, world_size // figures.nodes, shard_group_size)
    except TopologyError as err:
        raise CLIError(f"--shard-group-size: {err}") from None
    memory = args.memory if args.memory is not None else config.memory_budget
    try:
        if memory is not None:
            budget, budget_source = check_memory_budget(memory), "given"
        elif figures.memory_bytes:
            budget = figures.memory_bytes - CUDA_RESERVE_BYTES
            budget_source = f"the GPU's {format_bytes(figures.memory_bytes)} less {format_bytes(CUDA_RESERVE_BYTES)}"
        else:
            raise CLIError("give --memory (the per-device budget): the hardware profile does not say the GPU's memory")
    except ValueError as err:
        raise CLIError(f"--memory: {err}") from None
    spec = _model_spec(args, config, out)
    init_args = {**config.init_args, **parse_init_args(args.init_args, args.init_arg)}
    cls = import_object(spec)
    with out.step(f"building {getattr(cls, '__name__', spec)} on the meta device"):
        model = build_on_meta(cls, init_args)
    source = batch_source(args.batch, model)
    batch_size = args.batch_size or config.batch_size or source.default_size
    if not batch_size or batch_size < 1:
        raise CLIError("give --batch-size N (per device, at least 1), or a config with data.batch_size")
    tokens_per_sample = args.tokens_per_sample if args.tokens_per_sample is not None else source.tokens_per_sample
    if tokens_per_sample is not None and tokens_per_sample < 1:
        raise CLIError(f"--tokens-per-sample must be at least 1, got {tokens_per_sample}")
    accumulation = args.accumulate_grad_batches
    if accumulation is None:
        accumulation = config.accumulate_grad_batches or 1
    if accumulation < 1:
        raise CLIError(f"--accumulate-grad-batches must be at least 1, got {accumulation}")
    optimizer, optimizer_note = _optimizer(args.optimizer, model)
    headroom = args.memory_headroom if args.memory_headroom is not None else config.memory_headroom
    try:
        # Checked once, where the strategy checks its arguments; the errors name the flags.
        planner = PlannerOptions.checked(
            modes=_modes(args.modes, config),
            max_split=args.max_split if args.max_split is not None else (config.max_split or 8),
            activation_checkpointing=_recompute(args.activation_checkpointing, config),
            solver_time_limit=args.solver_time_limit,
            memory_headroom=DEFAULT_MEMORY_HEADROOM if headroom is None else headroom,
            solver=args.solver,
            solver_gap=args.solver_gap,
        )
    except (TypeError, ValueError) as err:
        message = str(err)
        for argument, flag in _PLANNER_FLAGS.items():
            message = message.replace(f"OSDPStrategy({argument}=...)", flag)
        raise CLIError(message) from None
    return DryRun(
        model=model,
        model_name=type(model).__name__,
        model_spec=spec,
        init_args=init_args,
        figures=figures,
        world_size=world_size,
        topology=topology,
        budget=budget,
        budget_source=budget_source,
        batch_size=batch_size,
        batch=source,
        precision=precision,
        optimizer=optimizer,
        optimizer_note=optimizer_note,
        planner=planner,
        tokens_per_sample=tokens_per_sample,
        accumulation=accumulation,
    )


def _recompute(flag: str | None, config: RunConfig) -> Recompute:
    """``--activation-checkpointing`` (``none``: ``False``), else the config's strategy's, else ``"auto"``."""
    from lightning_osdp.options import check_activation_checkpointing

    chosen = flag if flag is not None else config.activation_checkpointing
    return "auto" if chosen is None else check_activation_checkpointing(chosen)


def _nodes(args: argparse.Namespace, config: RunConfig) -> int | None:
    """``--nodes`` (checked with ``--gpus-per-node`` and ``--world-size``), else the config's ``num_nodes`` when more
    than one, else ``None`` (as many as the hardware needs)."""
    if (args.nodes is None) != (args.gpus_per_node is None):
        raise CLIError("give --nodes N and --gpus-per-node G together (the world size is N x G)")
    if args.nodes is None:
        return config.nodes if config.nodes and config.nodes > 1 and not args.world_size else None
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise CLIError(f"--nodes and --gpus-per-node must be at least 1, got {args.nodes} and {args.gpus_per_node}")
    if args.world_size and args.world_size != args.nodes * args.gpus_per_node:
        raise CLIError(
            f"--world-size {args.world_size} is not --nodes {args.nodes} x --gpus-per-node {args.gpus_per_node}; "
            "give one or the other"
        )
    return int(args.nodes)


def _profiles(run: DryRun, out: Output) -> BatchScaledProfile:
    plugin = _precision_plugin(run.precision)
    model = plugin.convert_module(run.model) if run.precision.endswith("-true") else run.model
    profiles = []
    started = time.perf_counter()
    for size in (run.batch_size, 2 * run.batch_size):
        with out.step(f"profiling {run.model_name} at batch {size} (fake tensors, estimated)"):
            profile = estimated_profile(
                model,
                run.batch.make(size),
                run.figures,
                step=run.batch.step,
                optimizer=run.optimizer,
                step_context=plugin.train_step_context,
                batch_source=run.batch.description,
                mixed_precision=BF16_POLICY if run.precision == "bf16-fsdp" else None,
                world_size=run.world_size,
            )
            profiles.append(dataclasses.replace(profile, gradient_accumulation=run.accumulation))
    run.seconds["profiling"] = time.perf_counter() - started
    return BatchScaledProfile(profiles[0], run.batch_size, profiles[1], 2 * run.batch_size)


def _solve(run: DryRun, profile: ModelProfile) -> Plan:
    """OSDP's plan under the budget, and on a GPU one whose device total fits the card as well (the strategy's call:
    ``PlannerOptions.plan``'s [Note: the plan within the card])."""
    return run.planner.plan(profile, run.budget, run.topology, card_bytes=run.card_bytes)


def _fits_osdp(run: DryRun, scaled: BatchScaledProfile) -> AnyPlanFits:
    return AnyPlanFits(run.planner, run.topology, run.budget, scaled.at, card_bytes=run.card_bytes)


def _infeasible(run: DryRun, err: InfeasibleBudgetError, scaled: BatchScaledProfile, out: Output) -> CLIError:
    with out.step("searching the largest batch any plan fits"):
        largest = largest_batch(_fits_osdp(run, scaled), run.budget, limit=run.batch_size - 1)
    hint = f"; the largest per-device batch any plan fits is {largest}" if largest else ""
    return CLIError(
        f"no plan fits the budget of {format_bytes(run.budget)} per device on {run.world_size} ranks at batch "
        f"{run.batch_size}: the minimum budget is {format_bytes(err.minimum)} ({err.minimum} bytes){hint}; "
        "raise --memory, add ranks or lower --batch-size"
    )


def compare(run: DryRun, scaled: BatchScaledProfile, out: Output, *, search: bool = True) -> list[StrategyFigures]:
    """OSDP's plan and the uniform baselines at the requested batch size, and (``search``) each one's largest
    batch size under the budget. Raises :class:`CLIError` when no plan fits at the requested batch size."""
    profile = scaled.at(run.batch_size)
    infeasible: InfeasibleBudgetError | None = None
    started = time.perf_counter()
    with out.step(f"solving the OSDP plan under {format_bytes(run.budget)} per device"):
        try:
            osdp_plan = _solve(run, profile)
        except InfeasibleBudgetError as err:
            infeasible = err
    run.seconds["solve"] = time.perf_counter() - started
    if infeasible is not None:  # outside the step above: one progress display at a time
        raise _infeasible(run, infeasible, scaled, out) from None
    rows = [StrategyFigures("OSDP", osdp_plan, predict(profile, osdp_plan, run.topology))]
    for name, mode, recompute in BASELINES:
        if mode == "hybrid_shard" and run.topology.replicas == 1:
            continue  # one shard group: HSDP is FSDP
        if recompute == "selective" and not _measured_selectively(profile):
            continue  # a profile from before selective figures: no such row
        plan = Plan.uniform(run.model, mode, recompute=recompute)
        plan.info["source"] = f"uniform {mode}, every block recompute={recompute!r} ({name})"
        rows.append(StrategyFigures(name, plan, predict(profile, plan, run.topology)))
    if not search:
        return rows
    started = time.perf_counter()
    with out.step("searching the largest batch size under the budget for each strategy"):
        for row in rows:
            # Predictions already made (at the requested batch size, and a baseline's probes) are not made again.
            known = {run.batch_size: row.prediction}
            if row.name == "OSDP":
                row.max_batch = largest_batch(_fits_osdp(run, scaled), run.budget)
            else:
                row.max_batch = largest_batch(_fits_plan(run, scaled, row.plan, known), run.planned_budget)
            if row.max_batch:
                if row.max_batch not in known:
                    at_max = scaled.at(row.max_batch)
                    plan = _solve(run, at_max) if row.name == "OSDP" else row.plan
                    known[row.max_batch] = predict(at_max, plan, run.topology)
                row.max_batch_seconds = known[row.max_batch].step_seconds
    run.seconds["batch search"] = time.perf_counter() - started
    return rows


def _measured_selectively(profile: ModelProfile) -> bool:
    """Whether the profile measured its blocks under selective recomputation (every block a uniform plan decides)."""
    return any(m.selective_kept_bytes is not None for m in profile.modules.values())


def _fits_plan(
    run: DryRun, scaled: BatchScaledProfile, plan: Plan, known: dict[int, Prediction]
) -> Callable[[int], Probe]:
    """Whether ``plan`` fits at a batch size, from its prediction there (kept in ``known``, by batch size)."""

    def fits(batch_size: int) -> Probe:
        if batch_size not in known:
            known[batch_size] = predict(scaled.at(batch_size), plan, run.topology)
        return Probe(run.fits_prediction(plan, known[batch_size]), known[batch_size].peak_bytes)

    return fits


def _rates(run: DryRun, batch_size: int, seconds: float | None) -> list[str]:
    """Samples/s over all ranks and, where the tokens per sample are known, tokens/s per GPU."""
    batch_size *= run.accumulation  # samples a step trains, per device
    samples = f"{batch_size * run.world_size / seconds:,.1f}" if seconds else "-"
    if run.tokens_per_sample is None:
        return [samples]
    return [samples, f"{batch_size * run.tokens_per_sample / seconds:,.0f}" if seconds else "-"]


def _comparison_rows(run: DryRun, rows: Sequence[StrategyFigures]) -> list[list[str]]:
    table = []
    none = ["-"] * len(_rates(run, 1, None))
    for row in rows:
        p = row.prediction
        fits = run.fits(row)
        memory = run.device_memory(row)
        # A baseline's name says how its blocks recompute (+AC, +SAC); its modes column, the one mode of its units.
        modes = row.plan.counts() if row.name == "OSDP" else f"all {row.plan.decisions[''].mode}"
        if row.max_batch is None:
            largest, at_max, rates = "-", "-", none
        elif row.max_batch == 0:
            largest, at_max, rates = "none", "-", none
        else:
            largest = str(row.max_batch)
            at_max = f"{row.max_batch_seconds * 1e3:,.1f}" if row.max_batch_seconds else "-"
            rates = _rates(run, row.max_batch, row.max_batch_seconds)
        table.append(
            [
                row.name,
                modes,
                format_bytes(p.peak_bytes),
                *([format_bytes(memory.device_total)] if memory is not None else []),
                "yes" if fits else "no",
                f"{p.step_seconds * 1e3:,.1f}",
                *(_rates(run, run.batch_size, p.step_seconds) if fits else none),
                largest,
                at_max,
                *rates,
            ]
        )
    return table


#: The comparison's throughput columns: samples/s over all ranks, tokens/s per GPU (where the tokens are known).
_RATE_HEADERS = ("samples/s", "tokens/s/GPU")

#: The columns of the step-parts table: ``Prediction.step_parts`` keys and their headers.
_PARTS: tuple[tuple[str, str], ...] = (
    ("compute", "compute"),
    ("recompute", "recompute"),
    ("exposed_communication", "exposed comm"),
    ("contention", "contention"),
    ("copies", "copies"),
    ("optimizer", "optimizer"),
    ("overhead", "overhead"),
)


def model_flops_utilization(
    profile: ModelProfile, step_seconds: float, peak_flops: float, convention: str = "palm"
) -> float | None:
    """The step's model FLOPs over the step time and the device's data-sheet peak; ``None`` without a peak.

    The model FLOPs are three times the traced forward's (forward and backward, no recomputation), with causal
    attention counted as ``convention`` (:data:`MFU_CONVENTIONS`) says: ``"palm"`` in full (PaLM's appendix B, whose
    ``6N + 12 L H Q T`` per token torchtitan computes: for a causal Llama, three times its traced forward so
    counted), ``"flash-attention"`` at the scores its fused kernels compute (about half;
    ``lightning_osdp/profiling/tracer.py`` [Note: causal attention]). A profile from before version 6 does not say
    what causal attention skips: both conventions read its FLOPs as traced.
    """
    if convention not in MFU_CONVENTIONS:
        raise ValueError(f"unknown MFU convention {convention!r}; choose from {', '.join(MFU_CONVENTIONS)}")
    if not peak_flops or step_seconds <= 0:
        return None
    flops = sum(m.fwd_flops for m in profile.modules.values())
    if convention == "palm":
        flops += sum(m.fwd_causal_skipped_flops for m in profile.modules.values())
    # A step of accumulated micro-batches runs the model once per micro-batch.
    return 3 * flops * max(profile.gradient_accumulation, 1) / step_seconds / peak_flops


def _parts_table(
    run: DryRun, profile: ModelProfile, rows: Sequence[StrategyFigures], out: Output, *, mfu_convention: str = "palm"
) -> None:
    """What each strategy's step is made of, its communication by cause, and the hardware figures each part comes
    from, so that a reader can check every term against the hardware."""
    table, comm_table = [], []
    for row in rows:
        p = row.prediction
        parts = p.step_parts
        mfu = model_flops_utilization(profile, p.step_seconds, run.figures.peak_flops, mfu_convention)
        table.append(
            [
                row.name,
                *(f"{parts[key] * 1e3:,.1f}" for key, _ in _PARTS),
                f"{p.step_seconds * 1e3:,.1f}",
                f"{mfu:.1%}" if mfu is not None else "-",
            ]
        )
        causes = p.exposed_by_cause
        comm_table.append(
            [
                row.name,
                f"{p.communication_seconds * 1e3:,.1f}",
                f"{(p.communication_seconds - p.exposed_seconds) * 1e3:,.1f}",
                f"{causes['not_hidden'] * 1e3:,.1f}",
                f"{causes['unoverlapped'] * 1e3:,.1f}",
                f"{causes['contention'] * 1e3:,.1f}",
            ]
        )
    rates, fits = run.figures.rates, run.figures.collectives
    probe = 256 * 2**20
    collective = ", ".join(
        f"{op.replace('_', '-')} of 256 MiB {fits[op].seconds(probe) * 1e3:.2f} ms" for op in sorted(fits)
    )
    other = next(c for c in MFU_CONVENTIONS if c != mfu_convention)
    other_mfu = model_flops_utilization(profile, rows[0].prediction.step_seconds, run.figures.peak_flops, other)
    notes = [
        "The step's parts add up to it (step); compute is the same figure as in the plan's summary.",
        f"compute: each operator's FLOPs and bytes ({rates.dtype}; see the figures below) plus "
        f"{rates.matmul_op_seconds * 1e6:.0f}/{rates.memory_op_seconds * 1e6:.0f} us per matmul/other kernel, "
        f"other operators' bytes at {rates.memory_bytes_per_second / 1e9:,.0f} GB/s; recompute: the forward of the "
        "fully recomputed blocks, run again in backward up to each one's last saved tensor (where torch's "
        "recomputation stops), and the replay of the selective ones (their operators but "
        "the matrix products, attention and convolutions); exposed comm and contention: see the next table.",
        f"copies: FSDP2's copy-out after each all-gather, DDP's gradient copy into its buckets, and side-stream "
        f"copies compute does not hide, at {run.figures.copy_bytes_per_second / 1e9:,.0f} GB/s; optimizer: its step "
        "over each rank's local parameters (traced on the target's rates); overhead: the loss, the training loop, "
        "and FSDP2's hooks where they outlast their units' compute (lightning_osdp/cost_model/config.py [Note: the "
        "target's figures]).",
        f"MFU ({', '.join(MFU_CONVENTIONS[mfu_convention])}): three times the traced forward FLOPs (no "
        "recomputation) per "
        "step over "
        + (
            f"the data sheet's {run.figures.peak_flops / 1e12:,.0f} TFLOPS dense peak; OSDP's in the other "
            f"convention (--mfu-convention {other}): {other_mfu:.1%}."
            if run.figures.peak_flops and other_mfu is not None
            else "the data sheet's dense peak, which the figures do not give (-)."
        ),
    ]
    out.table(
        f"Step parts per device at batch {run.batch_size} (ms; MFU: {MFU_CONVENTIONS[mfu_convention][0]})",
        ["strategy", *(h for _, h in _PARTS), "step", "MFU"],
        table,
        right=list(range(1, len(_PARTS) + 3)),
        notes=notes,
    )
    out.print("")
    out.table(
        f"Communication per device and step at batch {run.batch_size} (ms)",
        ["strategy", "all comm", "hidden", "exposed: not hidden", "exposed: nothing to overlap", "contention"],
        comm_table,
        right=list(range(1, 6)),
        notes=[
            "hidden: behind its unit's compute (FSDP2 and DDP communicate on their own streams); not hidden: more than "
            "that compute; nothing to overlap: the root's gathers, before the step's first compute, and the reductions "
            "of FSDP2's final callback, after its last (lightning_osdp/cost_model/structure.py unit_time); contention: "
            "the compute the hidden collectives slow down (cost_model/config.py [Note: the target's figures]).",
            f"collective fits within a node: {collective}.",
            *(f"figures: {note}" for note in run.figures.notes),
        ],
    )


def _report(
    run: DryRun,
    scaled: BatchScaledProfile,
    rows: Sequence[StrategyFigures],
    out: Output,
    *,
    mfu_convention: str = "palm",
    all_units: bool = False,
) -> None:
    profile = scaled.at(run.batch_size)
    params = sum(m.param_count for m in profile.modules.values())
    param_bytes = sum(m.param_bytes for m in profile.modules.values())
    batch = ", ".join(f"{t['dtype']}{t['shape']}" for t in profile.batch.get("tensors", []))
    out.print(
        f"Dry run of {run.model_name} ({run.model_spec}): {params / 1e9:.2f}B parameters "
        f"({format_bytes(param_bytes)}), optimizer {profile.optimizer or 'none'} ({run.optimizer_note})"
    )
    out.print(f"on {run.figures.description}")
    out.print(
        f"budget {format_bytes(run.budget)} per device ({run.budget_source}), planned against "
        f"{format_bytes(run.planned_budget)} ({run.planner.memory_headroom:.0%} headroom); precision {run.precision}"
    )
    tokens = (
        f"; {run.accumulation * run.batch_size * run.tokens_per_sample:,} tokens per device and step"
        if run.tokens_per_sample is not None
        else "; tokens per sample unknown (--tokens-per-sample T for tokens/s)"
    )
    if run.accumulation > 1:
        tokens += f"; {run.accumulation} micro-batches per optimizer step"
    out.print(f"batch {run.batch_size} per device: {batch}, {run.batch.description}{tokens}")
    out.print("")
    osdp = rows[0]
    out.print(
        format_plan(
            osdp.plan, osdp.prediction, budget=run.budget, rich_markup=out.rich, fold=not all_units, legend=True
        )
    )
    if run.figures.device.startswith("cuda"):
        out.print(plan_memory_line(osdp.prediction, osdp.plan, run.topology, run.figures.memory_bytes))
    if "card" in osdp.plan.info:
        out.print(f"OSDP's plan was {osdp.plan.info['card']}")
    out.print("")
    headers = [
        "strategy",
        "modes",
        "peak/device",
        *(["device total"] if run.card_bytes is not None else []),
        "fits",
        "step ms",
        *_RATE_HEADERS[: len(_rates(run, 1, None))],
        "max batch",
        "step ms @max",
        *(f"{h} @max" for h in _RATE_HEADERS[: len(_rates(run, 1, None))]),
    ]
    searched = rows[0].max_batch is not None
    tokens = (
        f"tokens/s/GPU: {run.tokens_per_sample:,} tokens per sample, per device."
        if run.tokens_per_sample is not None
        else "tokens/s/GPU: not shown, the tokens per sample are unknown (--tokens-per-sample T)."
    )
    notes = [
        "strategy: OSDP, the solver's plan; the others each block in one mode, the rest of the model one unit: DDP "
        "no_shard, ZeRO-2 shard_grad_op, FSDP full_shard, HSDP hybrid_shard (sharded within a node, replicated "
        'across nodes); +AC: every block recomputed in backward (activation checkpointing, recompute="full"); +SAC: '
        'selectively (recompute="selective"; AC and SAC as in the plan table).',
        "modes: the plan's units by mode; peak/device: the predicted peak of allocated memory; "
        + (
            "device total: with the caching allocator's fragmentation, NCCL's buffers and the CUDA context "
            "(lightning_osdp/cost_model/device_memory.py); fits: whether the allocated peak fits the budget less the "
            f"planner's headroom ({format_bytes(run.planned_budget)}) and the device total the card's "
            f"{format_bytes(run.card_bytes)}; "
            if run.card_bytes is not None
            else f"fits: whether it fits the budget less the planner's headroom ({format_bytes(run.planned_budget)}); "
        )
        + f"step ms: the predicted step; samples/s: over all {run.world_size} ranks (- where it does not fit); "
        + tokens,
        (
            "max batch: the largest per-device batch at which the row fits, as 'fits' judges it (OSDP: some plan, "
            "re-planned at each size), and "
            "@max the figures at it; all figures are affine in the batch size, profiled at "
            f"{scaled.low_batch} and {scaled.high_batch} and interpolated."
            if searched
            else "max batch: not searched (--no-search)."
        ),
        "Times are estimates from FLOPs, bytes and the hardware figures (approximations, see "
        "lightning_osdp/cli/hardware.py); memory comes from the traced step and the cost model.",
    ]
    out.table(
        f"Per device at batch {run.batch_size}, budget {format_bytes(run.budget)}",
        headers,
        _comparison_rows(run, rows),
        right=list(range(2, len(headers))),
        notes=notes,
    )
    out.print("")
    _parts_table(run, profile, rows, out, mfu_convention=mfu_convention)


def _save(run: DryRun, scaled: BatchScaledProfile, plan: Plan, path: str, out: Output) -> None:
    plan.info["dry_run"] = {
        "model": run.model_spec,
        "init_args": {
            k: v for k, v in run.init_args.items() if isinstance(v, (int, float, str, bool, list, type(None)))
        },
        "hardware": run.figures.name,
        "world_size": run.world_size,
        **({"nodes": run.topology.nodes} if run.topology.nodes > 1 else {}),
        "batch_size": run.batch_size,
        "precision": run.precision,
    }
    saved = plan.save(path)
    # Beside the plan, under the name the strategy uses (osdp_plan.json -> osdp_plan.profile.json), so that
    # `osdp show` finds it.
    profile_path = scaled.at(run.batch_size).save(saved.with_name(saved.stem + ".profile.json"))
    out.print(f"\nsaved the plan to {saved} and its profile to {profile_path}")


def run(args: argparse.Namespace, out: Output) -> int:
    """Run ``osdp plan``; returns the exit status."""
    start = time.perf_counter()
    dry = resolve(args, out)
    dry.seconds["model"] = time.perf_counter() - start
    scaled = _profiles(dry, out)
    with reusing_problems():  # the same profile is solved more than once (solver/reuse.py)
        rows = compare(dry, scaled, out, search=not args.no_search)
    _report(dry, scaled, rows, out, mfu_convention=args.mfu_convention, all_units=args.all_units)
    if args.out:
        _save(dry, scaled, rows[0].plan, args.out, out)
    if args.plot:
        from lightning_osdp.cli.plot import plot_dry_run

        with out.step(f"drawing {args.plot}"):
            written = plot_dry_run(args.plot, dry, rows)
        out.print(f"\nwrote {written}")
    report = rows[0].plan.report
    stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in dry.seconds.items())
    if report is not None:
        stages += f"; of the solve, HiGHS {report.solver_seconds:.1f} s"
    out.note(f"dry run took {time.perf_counter() - start:.1f} s ({stages})")
    return 0
