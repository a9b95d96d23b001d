"""The arguments of Lightning's other distributed strategies, carried over to OSDP: one error naming what to do instead.

A user coming from ``FSDPStrategy`` (Trainer or Fabric), ``ModelParallelStrategy``, ``DeepSpeedStrategy`` or
``DDPStrategy`` passes its arguments (``auto_wrap_policy=``, ``sharding_strategy=``, ``cpu_offload=``, ``stage=``) to
the OSDP strategy. Python's own ``TypeError: unexpected keyword argument`` names the argument and nothing else, one at
a time. :func:`refuse_foreign_arguments` raises one ``TypeError`` for all of them, saying for each what OSDP does
instead: the OSDP argument that replaces it (with the value that means the same, where there is one), that OSDP
does it by itself, or that it is not supported yet. A name no strategy takes is a typo: the closest accepted name is
suggested. ``docs/migrating.md`` is the same mapping as tables.

[Note: why the strategies take **kwargs]
The strategy constructors take ``**kwargs`` only to hand them here, before anything else runs. A signature that
lists Lightning's arguments one by one (``auto_wrap_policy: Any = None``) would show them in ``help()``, in the API
reference and in LightningCLI's ``--help`` as if they were options; ``**kwargs`` shows none of them, and
jsonargparse still builds the strategy from the named parameters (it reads ``**kwargs`` only where they are passed on
as ``**kwargs``, which they are not). A YAML config with a foreign key fails in jsonargparse's own check ("Option
'sharding_strategy' is not accepted"), before the constructor runs: :func:`refuse_foreign_arguments` serves Python
callers.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lightning_osdp.plan import MODES

__all__ = ["FOREIGN_ARGUMENTS", "arguments_of", "instead_of", "refuse_foreign_arguments"]

FSDP = "FSDPStrategy"
MODEL_PARALLEL = "ModelParallelStrategy"
DEEPSPEED = "DeepSpeedStrategy"
DDP = "DDPStrategy"
#: Arguments FSDPStrategy passes on to FSDP1's constructor (its ``**kwargs``), and DDPStrategy to DDP's.
FSDP_KWARGS = "FSDPStrategy, passed on to FSDP"
DDP_KWARGS = "DDPStrategy, passed on to DistributedDataParallel"

#: FSDP1's ``ShardingStrategy`` names -> OSDP's modes: the same words, lower case.
_MODE_OF_SHARDING = {mode.upper(): mode for mode in MODES}

_MIGRATING = "docs/migrating.md"
_PLANNER_CHOOSES = "leave `modes` out to let the planner choose per module among all of them"
_NEVER_OFFLOADS = (
    "not supported yet: OSDP keeps parameters, gradients and optimizer states on the device and fits "
    "`memory_budget=` by sharding, operator splitting and recomputation instead"
)
_NO_BUCKETS = (
    "nothing to set: FSDP2 communicates one planning unit at a time, prefetching the next unit's all-gather while "
    "the current one computes, and the cost model prices each unit's collectives; the replicated units use DDP's "
    "default buckets"
)


def _show(value: Any) -> str:
    """A short spelling of an argument's value: classes by name, long reprs cut."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, (set, frozenset, list, tuple)) and value and all(isinstance(v, type) for v in value):
        names = ", ".join(sorted(v.__name__ for v in value))
        return "{" + names + "}" if isinstance(value, (set, frozenset)) else f"[{names}]"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _module_classes(value: Any) -> list[str]:
    """The class names in a wrap or checkpointing policy given as a set of module classes (FSDPStrategy's shorthand);
    ``[]`` for a callable policy."""
    if isinstance(value, type):
        return [value.__name__]
    if isinstance(value, (set, frozenset, list, tuple)) and all(isinstance(v, type) for v in value):
        return sorted(v.__name__ for v in value)
    return []


def _units_of(value: Any) -> str:
    """The ``units=`` expression of ``Plan.uniform`` that names the modules a policy of module classes wraps."""
    classes = _module_classes(value)
    if not classes:
        return "units=[the names of the modules your policy wraps]"
    isinstance_of = classes[0] if len(classes) == 1 else "(" + ", ".join(classes) + ")"
    return f"units=[name for name, m in model.named_modules() if isinstance(m, {isinstance_of})]"


def _sharding_strategy(value: Any) -> str:
    name = str(getattr(value, "name", value)).upper()  # ShardingStrategy.FULL_SHARD or "full_shard"
    if name == "_HYBRID_SHARD_ZERO2":
        return (
            "`modes=('hybrid_shard',)` is the nearest: it shards within a node and replicates across nodes as "
            "_HYBRID_SHARD_ZERO2 does, but frees the gathered parameters after forward (ZeRO-3 within the node); "
            f"{_PLANNER_CHOOSES}"
        )
    mode = _MODE_OF_SHARDING.get(name)
    if mode is None:
        return f"`modes=` takes OSDP's names of FSDP's sharding strategies, a subset of {MODES}"
    also = ""
    if "HYBRID" in name:
        also = " (`shard_group_size=` sets the ranks each unit shards over; default: one node's)"
    return f"`modes=('{mode}',)` gives every planning unit {name}{also}; {_PLANNER_CHOOSES}"


def _auto_wrap_policy(value: Any) -> str:
    return (
        "the planner chooses the units itself (each block of a ModuleList or Sequential, its large Linears, tied "
        "parameters together); to fix them, pass a plan: `plan=Plan.uniform(model, 'full_shard', "
        f"{_units_of(value)})` (or the path of a plan file saved from one)"
    )


def _activation_checkpointing_policy(value: Any) -> str:
    return (
        "`activation_checkpointing=` says how: 'auto' (the default) lets the planner recompute the units where it "
        "pays, 'full' (or True) recomputes every unit that saves activations, 'selective' keeps their matrix-product "
        "and attention outputs, False never; to recompute exactly the modules your policy names, pass a plan: "
        f"`plan=Plan.uniform(model, 'full_shard', {_units_of(value)}, recompute='full')`"
    )


def _cpu_offload(value: Any) -> str:
    if value is None or value is False or getattr(value, "offload_params", True) is False:
        return "nothing to do: OSDP does not offload (drop the argument)"
    return _NEVER_OFFLOADS


def _offload(value: Any) -> str:
    return "nothing to do: OSDP does not offload (drop the argument)" if not value else _NEVER_OFFLOADS


def _device_mesh(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2:
        return (
            f"`modes=('hybrid_shard',), shard_group_size={value[1]}` shards each unit over groups of {value[1]} ranks "
            f"and replicates across the groups, as device_mesh={value!r} does; the strategy builds its meshes itself"
        )
    return (
        "the strategy builds its meshes itself from the Trainer's devices and num_nodes; `shard_group_size=` sets "
        "the ranks a hybrid_shard unit shards over"
    )


def _stage(value: Any) -> str:
    modes = {0: "no_shard", 1: "shard_grad_op", 2: "shard_grad_op", 3: "full_shard"}
    if not isinstance(value, int) or value not in modes:
        return f"DeepSpeed's stages 0-3 map to `modes=`, a subset of {MODES}"
    nearest = (
        " (OSDP has no ZeRO-1, which shards only the optimizer states: shard_grad_op, ZeRO-2, also shards the "
        "gradients)"
        if value == 1
        else ""
    )
    return f"`modes=('{modes[value]}',)` is ZeRO stage {value}{nearest}; {_PLANNER_CHOOSES}"


def _zero_optimization(value: Any) -> str:
    if value:
        return (
            "ZeRO's stages are OSDP's modes: `modes=` (stage 2: ('shard_grad_op',), 3: ('full_shard',)); "
            + _PLANNER_CHOOSES
        )
    return "`modes=('no_shard',)` replicates every unit (DDP, which DeepSpeed without ZeRO is)"


def _save_distributed_checkpoint(value: Any) -> str:
    return f"`state_dict_type='{'sharded' if value else 'full'}'` (sharded DCP directories, or one file from rank 0)"


def _tensor_parallel_size(value: Any) -> str:
    if value in (1, "auto"):
        return "nothing to set: OSDP is data-parallel over every rank (drop the argument)"
    return (
        "not supported yet: OSDP is data-parallel (its operator splitting cuts a Linear into slices gathered one at "
        "a time, to save memory, not to spread its compute over ranks)"
    )


def _precision(value: Any) -> str:
    return (
        "the precision goes to the Trainer or Fabric (`precision='bf16-mixed'`); FSDP2's parameter cast on the "
        "sharded units is `mixed_precision='bf16'`"
    )


def _text(hint: str) -> Callable[[Any], str]:
    return lambda value: hint


def _entries() -> dict[str, tuple[str, Callable[[Any], str]]]:
    """Each foreign argument -> (the strategy it comes from, what OSDP does instead given its value)."""
    entries: dict[str, tuple[str, Callable[[Any], str]]] = {}

    def add(source: str, instead: Callable[[Any], str] | str, *names: str) -> None:
        for name in names:
            entries.setdefault(name, (source, _text(instead) if isinstance(instead, str) else instead))

    # FSDPStrategy (Trainer and Fabric); `mixed_precision`, `activation_checkpointing` and `state_dict_type` are
    # OSDP's arguments too, checked by their own rules (lightning_osdp/options.py).
    add(FSDP, _sharding_strategy, "sharding_strategy")
    add(FSDP, _auto_wrap_policy, "auto_wrap_policy")
    add(FSDP, _activation_checkpointing_policy, "activation_checkpointing_policy")
    add(FSDP, _cpu_offload, "cpu_offload")
    add(FSDP, _device_mesh, "device_mesh")
    add("Fabric's strategies", _precision, "precision")
    # FSDP1's constructor arguments, which FSDPStrategy passes on.
    add(FSDP_KWARGS, "nothing to set: FSDP2 limits the all-gathers in flight itself", "limit_all_gathers")
    add(
        FSDP_KWARGS,
        "nothing to set: FSDP2 always keeps the original parameters (as DTensors), so any optimizer and parameter "
        "groups work",
        "use_orig_params",
    )
    add(
        FSDP_KWARGS,
        "not an option: replicated units start from rank 0's values (DDP broadcasts them), sharded units from each "
        "rank's shard of the model it built (seed_everything makes every rank build the same one); `pretrained=` "
        "starts from a checkpoint",
        "sync_module_states",
    )
    add(
        FSDP_KWARGS,
        "nothing to set: FSDP2 prefetches the next unit's all-gather in forward and backward, and the cost model "
        "prices that overlap",
        "forward_prefetch",
        "backward_prefetch",
    )
    add(
        FSDP_KWARGS,
        "not supported: every parameter is in the plan; a plan can keep a module's parameters whole "
        "(`Decision('no_shard')` on its unit)",
        "ignored_modules",
        "ignored_states",
    )
    add(
        FSDP_KWARGS,
        "a model built on the meta device (`trainer.init_module(empty_init=True)`) is initialized by each module's "
        "reset_parameters() once sharded (docs/large-models.md)",
        "param_init_fn",
    )
    add(
        FSDP_KWARGS,
        "nothing to set: the strategy places each rank on its device and builds its process groups "
        "(`shard_group_size=` for hybrid_shard's)",
        "device_id",
        "process_group",
    )
    # ModelParallelStrategy (Trainer and Fabric).
    add(
        MODEL_PARALLEL,
        "the strategy applies fully_shard (and DDP) to the LightningModule itself, by the plan; to fix what is "
        "sharded, pass `plan=` (a Plan or a plan file); a model built in configure_model is planned the same way",
        "parallelize_fn",
    )
    add(
        MODEL_PARALLEL,
        "nothing to set: every rank is data-parallel; for two levels (shard within a group, replicate across "
        "groups), `modes=('hybrid_shard',)` with `shard_group_size=`",
        "data_parallel_size",
    )
    add(MODEL_PARALLEL, _tensor_parallel_size, "tensor_parallel_size")
    add(MODEL_PARALLEL, _save_distributed_checkpoint, "save_distributed_checkpoint")
    # DeepSpeedStrategy (Trainer and Fabric).
    add(DEEPSPEED, _stage, "stage")
    add(DEEPSPEED, _zero_optimization, "zero_optimization")
    add(DEEPSPEED, _offload, "offload_optimizer", "offload_parameters", "cpu_checkpointing")
    add(
        DEEPSPEED,
        _NEVER_OFFLOADS,
        "offload_params_device",
        "offload_optimizer_device",
        "nvme_path",
        "params_buffer_count",
        "params_buffer_size",
        "max_in_cpu",
        "optimizer_buffer_count",
        "block_size",
        "queue_depth",
        "single_submit",
        "overlap_events",
        "thread_count",
        "pin_memory",
    )
    add(
        DEEPSPEED,
        _NO_BUCKETS,
        "sub_group_size",
        "contiguous_gradients",
        "overlap_comm",
        "allgather_partitions",
        "reduce_scatter",
        "allgather_bucket_size",
        "reduce_bucket_size",
    )
    add(
        DEEPSPEED,
        "build the model on the meta device with `trainer.init_module(empty_init=True)`: each rank allocates only its "
        "shards (docs/large-models.md)",
        "remote_device",
    )
    add(DEEPSPEED, "nothing to set: any torch optimizer works", "zero_allow_untested_optimizer")
    add(DEEPSPEED, "nothing to set: DeepSpeed's own logging", "logging_batch_size_per_gpu", "logging_level")
    add(
        DEEPSPEED,
        "fp16 loss scaling is the precision plugin's: `precision='16-mixed'` (on CUDA) scales with a sharded grad "
        "scaler, and a `torch.amp.GradScaler(init_scale=..., growth_interval=...)` given to Lightning's "
        "`MixedPrecision('16-mixed', 'cuda', scaler=...)` plugin keeps its settings",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "min_loss_scale",
    )
    add(
        DEEPSPEED,
        "not supported: activations are not partitioned across ranks (that is tensor parallelism's); "
        "`activation_checkpointing=` recomputes them instead of keeping them",
        "partition_activations",
    )
    add(
        DEEPSPEED,
        "nothing to set: OSDP recomputes with torch.utils.checkpoint (non-reentrant), as "
        "`activation_checkpointing=` says",
        "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary",
    )
    add(
        DEEPSPEED,
        "`pretrained=` the full checkpoint: each rank reads only its shards' rows once the plan is applied "
        "(docs/large-models.md)",
        "load_full_weights",
    )
    add(
        DEEPSPEED,
        "not supported yet: OSDP's checkpoints hold every parameter and buffer of the model",
        "exclude_frozen_parameters",
    )
    add(
        DEEPSPEED,
        "DeepSpeed's config is not read: its zero_optimization.stage maps to `modes=` (2: ('shard_grad_op',), 3: "
        "('full_shard',)), its fp16/bf16 section to the Trainer's `precision=`, its offload sections are not supported "
        f"yet ({_MIGRATING})",
        "config",
    )
    # DDPStrategy, and what it passes on to DistributedDataParallel (`find_unused_parameters` is OSDP's argument too).
    add(
        DDP,
        "not supported yet: the replicated units' DDP takes no communication hook",
        "ddp_comm_state",
        "ddp_comm_hook",
        "ddp_comm_wrapper",
    )
    add(DDP, "not supported: OSDP synchronizes gradients every step (no post-local SGD)", "model_averaging_period")
    add(DDP_KWARGS, "not supported yet: the replicated units' DDP runs without a static graph", "static_graph")
    add(DDP_KWARGS, "nothing to set: always on for the replicated units", "gradient_as_bucket_view")
    add(DDP_KWARGS, _NO_BUCKETS, "bucket_cap_mb")
    add(
        DDP_KWARGS,
        "nothing to set: rank 0's buffers are broadcast before each training forward under every plan, as DDP's "
        "default does",
        "broadcast_buffers",
    )
    add(
        DDP_KWARGS,
        "nothing to set: the strategy places each rank on its device and builds its process groups",
        "device_ids",
        "output_device",
    )
    return entries


#: Every argument of Lightning's FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy and DDPStrategy (and of the
#: FSDP and DDP constructors they pass ``**kwargs`` on to) that OSDP does not take: the strategy it comes from and
#: what OSDP does instead, given its value.
FOREIGN_ARGUMENTS: Mapping[str, tuple[str, Callable[[Any], str]]] = _entries()


def instead_of(name: str, value: Any) -> str | None:
    """What OSDP does instead of the foreign argument ``name=value``, prefixed with where it comes from; ``None``
    when no Lightning strategy takes ``name``."""
    entry = FOREIGN_ARGUMENTS.get(name)
    if entry is None:
        return None
    source, instead = entry
    return f"{name}={_show(value)} ({source}): {instead(value)}"


def arguments_of(strategy: type) -> list[str]:
    """The names of ``strategy``'s constructor arguments, in order (``self`` and ``**kwargs`` left out): what
    :func:`refuse_foreign_arguments` suggests and lists."""
    parameters = inspect.signature(strategy).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]


def refuse_foreign_arguments(arguments: Mapping[str, Any], strategy: str, *, accepted: Iterable[str]) -> None:
    """Raise one ``TypeError`` for every argument in ``arguments``, the keyword arguments a strategy constructor did
    not recognise, saying what to do instead of each.

    An argument of Lightning's FSDPStrategy (Trainer or Fabric), ModelParallelStrategy, DeepSpeedStrategy or
    DDPStrategy (or of the FSDP and DDP constructors they pass on to) is named with the OSDP argument that replaces it
    and the value that means the same (``sharding_strategy="FULL_SHARD"`` -> ``modes=("full_shard",)``), or with
    what OSDP does by itself, or as not supported yet. Any other name is not an argument: the closest accepted name
    is suggested and the accepted ones listed.

    Args:
        arguments: the unrecognised keyword arguments and their values; nothing is raised when empty.
        strategy: the strategy's name as the message shows it (``"OSDPStrategy"``).
        accepted: the strategy's own arguments, to suggest and list (:func:`arguments_of` the strategy).
    """
    if not arguments:
        return
    own = list(accepted)
    lines = []
    typos = False
    for name, value in arguments.items():
        hint = instead_of(name, value)
        if hint is None:
            close = difflib.get_close_matches(name, [*own, *FOREIGN_ARGUMENTS], n=1)
            if close and close[0] not in own:  # a misspelt foreign argument: what to do instead of the one meant
                hint = f"{name}: not an argument; did you mean {close[0]}? {instead_of(close[0], value)}"
            else:
                typos = True
                hint = f"{name}: not an argument of {strategy}" + (f"; did you mean {close[0]}?" if close else "")
        lines.append(f"  - {hint}")
    accepted_line = f"\n{strategy} takes: {', '.join(own)}." if typos else ""
    count = "an argument" if len(lines) == 1 else f"{len(lines)} arguments"
    raise TypeError(
        f"{strategy} got {count} it does not take:\n"
        + "\n".join(lines)
        + accepted_line
        + f"\n{_MIGRATING} maps every option of FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy and DDPStrategy."
    )
