"""The checks on :class:`~lightning_osdp.OSDPStrategy`'s arguments, run in its constructor.

Each ``check_*`` function returns the value the strategy keeps (a budget string becomes bytes, seconds become a
``timedelta``) or raises naming the argument, what it accepts and what it got: a bad argument is an error when the
``Trainer`` is built, before any process starts, not a ``TypeError`` from deep inside profiling or the solver minutes
later. Wrong types raise :class:`TypeError`, wrong values :class:`ValueError` (:class:`~lightning_osdp.PlanError`
for plans). Values arrive from Python and from LightningCLI YAML alike; jsonargparse converts YAML by the
constructor's annotations (``timeout: 300`` arrives as ``300.0``, ``"0:05:00"`` as a ``timedelta``).
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_osdp import budget
from lightning_osdp.plan import MODES, Plan, PlanError

__all__ = ["BF16_POLICY", "DEFAULT_TIMEOUT", "START_METHODS", "default_timeout", "planning_wait"]

#: The process-group timeout when none is given (see [Note: the default timeout]).
DEFAULT_TIMEOUT = timedelta(minutes=5)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
StateDictType = Literal["sharded", "full"]

#: How the strategy may start its processes: Lightning's subprocess launcher, or torch.multiprocessing.
START_METHODS: tuple[StartMethod, ...] = ("popen", "spawn", "fork", "forkserver")

# [Note: the default timeout]
# The timeout bounds every collective, so it is how long a run survives a rank that stops (SIGSTOP, a deadlock in
# user code, a lost node) before the others fail: torch's default for gloo, which Lightning passes on, is 30
# minutes. It must still exceed the longest wait that is not a hang, where all ranks wait on one:
# * rank 0 solving the plan while the others wait for it: the solve stops on work limits, with solver_time_limit as a
#   safety net of 3 x solver_time_limit per solve (ilp.py's [Note: work limits]; the minimum-budget solve of an
#   infeasible budget is a second one), plus
#   building the problem (seconds for 2,000 planning units). `planning_wait` allows 6 x solver_time_limit + 60 s
#   (two solves' safety nets): 120 s at the default 10 s limit; the default timeout grows with a larger limit;
# * a "full" checkpoint: rank 0 writes one file while the others wait at Lightning's barrier (sharded checkpoints
#   are written by all ranks at once). 5 minutes is ~150 GB at 500 MB/s;
# * Lightning's `prepare_data`, which runs on local rank 0 only (a dataset download) before a barrier.
# 5 minutes covers the first two with room, as torchtitan's 300 s does its start-up; the third, and a full
# checkpoint larger than that, need `timeout` raised (docs/troubleshooting.md).


def planning_wait(solver_time_limit: float) -> timedelta:
    """How long the other ranks may wait for rank 0's solve: ``6 x solver_time_limit + 60 s`` (see [Note: the
    default timeout])."""
    return timedelta(seconds=6 * solver_time_limit + 60)


def default_timeout(solver_time_limit: float) -> timedelta:
    """The timeout when none is given: :data:`DEFAULT_TIMEOUT`, or :func:`planning_wait` when that is longer."""
    return max(DEFAULT_TIMEOUT, planning_wait(solver_time_limit))


#: ``OSDPStrategy(mixed_precision="bf16")``: FSDP2 gathers parameters and computes in bf16, and reduce-scatters
#: gradients in fp32, as torchtitan trains (its defaults ``mixed_precision_param = "bfloat16"``,
#: ``mixed_precision_reduce = "float32"``).
BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

# The Lightning precision each policy's parameter dtype runs with: autocast in that dtype is what makes the replicated
# (DDP) units compute in it (see OSDPStrategy's [Note: mixed precision]).
_AUTOCAST_FOR = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}


def check_mixed_precision(value: Any) -> MixedPrecisionPolicy | None:
    """``None``, ``"bf16"`` (:data:`BF16_POLICY`) or a ``torch.distributed.fsdp.MixedPrecisionPolicy`` whose
    ``param_dtype`` is bf16, fp16 or unset."""
    accepted = "None, 'bf16' or a torch.distributed.fsdp.MixedPrecisionPolicy"
    if value is None or value == "bf16":
        return None if value is None else BF16_POLICY
    if isinstance(value, MixedPrecisionPolicy):
        if value.param_dtype is not None and value.param_dtype not in _AUTOCAST_FOR:
            raise ValueError(
                f"OSDPStrategy(mixed_precision=...): a policy's param_dtype must be torch.bfloat16, torch.float16 or "
                f"None, got {value.param_dtype}"
            )
        return value
    if isinstance(value, str):
        raise ValueError(f"OSDPStrategy(mixed_precision=...) takes {accepted}, got {value!r}")
    raise TypeError(f"OSDPStrategy(mixed_precision=...) takes {accepted}, got {type(value).__name__}")


def check_precision_for_policy(policy: MixedPrecisionPolicy | None, precision: str) -> None:
    """The Lightning precision a policy runs with: ``bf16-mixed`` for a bf16 ``param_dtype``, ``16-mixed`` for fp16
    (autocast makes the replicated units compute in it), anything for a policy that casts no parameter."""
    if policy is None or policy.param_dtype is None:
        return
    wanted = _AUTOCAST_FOR[policy.param_dtype]
    if precision != wanted:
        raise ValueError(
            f"OSDPStrategy(mixed_precision=...) with param_dtype={policy.param_dtype} needs "
            f"Trainer(precision={wanted!r}), got precision={precision!r}: the replicated (DDP) units compute in "
            f"{policy.param_dtype} under Lightning's autocast (see docs/configuration.md, mixed_precision)"
        )


def check_memory_budget(value: Any) -> int | None:
    """``None`` (the device's capacity) or bytes between 4 KiB and 1 EiB (see
    :func:`~lightning_osdp.budget.check_memory_budget`, and its [Note: how a budget is spelled])."""
    if value is None:
        return None
    try:
        return budget.check_memory_budget(value)
    except ValueError as err:
        raise ValueError(f"OSDPStrategy(memory_budget=...): {err}") from None


def check_plan(value: Any) -> Plan | None:
    """``None``, a :class:`~lightning_osdp.Plan`, or a plan file's path (read now, so that a bad file fails here)."""
    if value is None or isinstance(value, Plan):
        return value
    if isinstance(value, (str, os.PathLike)):
        if str(value) == "":
            raise PlanError("OSDPStrategy(plan=...): the plan file path is empty (pass None to plan automatically)")
        return Plan.load(value)
    raise TypeError(
        f"OSDPStrategy(plan=...) takes a lightning_osdp.Plan or a plan file path (str or os.PathLike), "
        f"got {type(value).__name__}"
    )


def check_modes(value: Any) -> tuple[str, ...]:
    """A non-empty sequence of :data:`~lightning_osdp.MODES`."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(
            f"OSDPStrategy(modes=...) takes a list of modes such as ['full_shard'] (a subset of {list(MODES)}), "
            f"got {value!r}"
        )
    unknown = [m for m in value if m not in MODES]
    if unknown or not value:
        raise ValueError(f"OSDPStrategy(modes=...) must be a non-empty subset of {MODES}, got {tuple(value)!r}")
    return tuple(dict.fromkeys(value))


def check_max_split(value: Any) -> int:
    """An integer >= 1."""
    return _integer("max_split", value, minimum=1)


def check_activation_checkpointing(value: Any) -> bool | Literal["auto", "selective", "full"]:
    """``"auto"``, ``"selective"``, ``"full"``, ``True`` (``"full"``) or ``False`` (YAML's ``true``/``false``; the
    strings ``"true"``/``"false"`` too; ``"none"`` is ``False``)."""
    if isinstance(value, str) and value.lower() in ("true", "false", "none"):
        return value.lower() == "true"
    if value is True or value is False:
        return bool(value)
    if value in ("auto", "selective", "full"):
        return cast(Literal["auto", "selective", "full"], value)
    raise ValueError(
        f"OSDPStrategy(activation_checkpointing={value!r}): expected 'auto' (the planner chooses per unit among "
        "keeping its activations, selective and full recomputation, where each pays), 'selective' (every unit that "
        "saves activations keeps only its matrix-product and attention outputs and recomputes the rest), 'full' or "
        "True (every such unit keeps only its inputs and recomputes its whole forward) or False (none recomputes)"
    )


def check_shard_group_size(value: Any) -> int | None:
    """``None`` (one node's ranks) or an integer >= 1; whether it tiles the nodes is checked when the Trainer has
    given the strategy its ``num_nodes`` and ``devices`` (:meth:`~lightning_osdp.OSDPStrategy.topology`)."""
    if value is None:
        return None
    return _integer("shard_group_size", value, minimum=1)


def check_memory_steps(value: Any) -> int:
    """An integer >= 0 (0: CPU runs measure no peak memory)."""
    return _integer("memory_steps", value, minimum=0)


def check_solver_time_limit(value: Any) -> float:
    """A positive, finite number of seconds."""
    return _seconds("solver_time_limit", value)


def check_solver_gap(value: Any) -> float:
    """A relative optimality gap in ``[0, 1)`` (``lightning_osdp.solver.ilp.check_gap``)."""
    from lightning_osdp.solver.ilp import check_gap

    try:
        return check_gap(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"OSDPStrategy(solver_gap=...): {err}") from None


def check_solver(value: Any) -> str:
    """``"highs"`` (``"cbc"``, removed, maps to it with a ``FutureWarning``: ``solver.ilp.check_solver``)."""
    from lightning_osdp.solver.ilp import check_solver

    try:
        return check_solver(value)
    except ValueError as err:
        raise ValueError(f"OSDPStrategy(solver=...): {err}") from None


def check_memory_headroom(value: Any) -> float:
    """A fraction in ``[0, 0.5)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"OSDPStrategy(memory_headroom=...) takes a number in [0, 0.5), got {value!r}")
    if not 0.0 <= float(value) < 0.5:  # NaN fails this too
        raise ValueError(f"OSDPStrategy(memory_headroom=...) must be in [0, 0.5), got {value!r}")
    return float(value)


def check_plan_out(value: Any) -> Path | None:
    """``None`` or the path of a file the plan can be written to (not a directory, not under a file)."""
    if value is None:
        return None
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"OSDPStrategy(plan_out=...) takes a file path (str or os.PathLike), got {value!r}")
    path = Path(value)
    if str(value) == "":
        raise ValueError("OSDPStrategy(plan_out=...) is an empty path (pass None for the logger's directory)")
    if path.is_dir():
        raise ValueError(
            f"OSDPStrategy(plan_out=...) must name a file, got the directory {str(value)!r} (for example "
            f"{str(path / 'osdp_plan.json')!r})"
        )
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"OSDPStrategy(plan_out=...): {str(value)!r} cannot be created: {parent} is a file")
            break
    return path


def check_process_group_backend(value: Any) -> str | None:
    """``None`` (by device), a backend ``torch.distributed`` knows and this build has (``"gloo"``, ``"nccl"``,
    ``"mpi"``, ``"ucc"``, a registered third-party one), or per-device backends such as ``"cpu:gloo,cuda:nccl"``."""
    import torch.distributed as dist

    if value is None:
        return None
    known = [b for b in dist.Backend.backend_list if b != dist.Backend.UNDEFINED]
    accepted = f"None, one of {known}, or per-device backends such as 'cpu:gloo,cuda:nccl'"
    if not isinstance(value, str):
        raise TypeError(f"OSDPStrategy(process_group_backend=...) takes {accepted}, got {value!r}")
    if ":" in value:
        try:
            names = [str(b) for b in dist.BackendConfig(dist.Backend(value)).get_device_backend_map().values()]
        except ValueError:
            raise ValueError(
                f"OSDPStrategy(process_group_backend=...): cannot read {value!r} as per-device backends "
                "'<device>:<backend>,...' such as 'cpu:gloo,cuda:nccl'"
            ) from None
    else:
        names = [value]
    for name in names:
        if name.lower() not in known:
            raise ValueError(f"OSDPStrategy(process_group_backend=...) takes {accepted}, got {value!r}")
        if not dist.is_backend_available(name):
            raise ValueError(
                f"OSDPStrategy(process_group_backend=...): backend {name.lower()!r} is not available in this build "
                "of torch"
            )
    return str(dist.Backend(value))


def check_start_method(value: Any) -> StartMethod:
    """One of :data:`START_METHODS` that this platform offers."""
    if value not in START_METHODS:
        raise ValueError(f"OSDPStrategy(start_method=...) must be one of {START_METHODS}, got {value!r}")
    if value != "popen" and value not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"OSDPStrategy(start_method={value!r}) is not available on this platform "
            f"(it offers {multiprocessing.get_all_start_methods()})"
        )
    return cast(StartMethod, value)


def check_state_dict_type(value: Any) -> StateDictType:
    """``"sharded"`` or ``"full"``."""
    if value not in ("sharded", "full"):
        raise ValueError(f"OSDPStrategy(state_dict_type=...) must be 'sharded' or 'full', got {value!r}")
    return cast(StateDictType, value)


def check_pretrained(value: Any) -> Path | None:
    """``None`` or the path of pretrained weights that exists: a file, or a folder of ``.safetensors`` files."""
    if value is None:
        return None
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)) or str(value) == "":
        raise TypeError(f"OSDPStrategy(pretrained=...) takes the path of a checkpoint file or folder, got {value!r}")
    path = Path(value)
    if not path.exists():
        raise ValueError(f"OSDPStrategy(pretrained=...): {str(value)!r} does not exist")
    if path.is_dir() and not any(path.glob("*.safetensors")):
        raise ValueError(f"OSDPStrategy(pretrained=...): the folder {str(value)!r} holds no .safetensors files")
    return path


def check_pretrained_prefix(value: Any) -> str | None:
    """``None`` or a string (``""`` included: the checkpoint's keys as they are)."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"OSDPStrategy(pretrained_prefix=...) takes a string, got {value!r}")
    return value


def check_pretrained_cast(value: Any) -> bool:
    """``True`` or ``False`` (whether pretrained weights of another dtype than their parameter's, of the same kind,
    are cast to it: ``lightning_osdp/checkpoint/pretrained.py``, [Note: checked before profiling])."""
    if not isinstance(value, bool):
        raise TypeError(f"OSDPStrategy(pretrained_cast=...) takes True or False, got {value!r}")
    return value


def check_find_unused_parameters(value: Any) -> bool | None:
    """``None``, ``True`` or ``False``."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"OSDPStrategy(find_unused_parameters=...) takes None, True or False, got {value!r}")
    return value


def check_timeout(value: Any, *, solver_time_limit: float, planning: bool) -> timedelta:
    """``None`` (:func:`default_timeout`), a positive ``timedelta``, or a positive number of seconds.

    When the strategy will plan (no ``plan`` given), a timeout shorter than :func:`planning_wait` is accepted with a
    warning: the solve usually takes seconds, but the other ranks wait for it in a collective.
    """
    if value is None:
        return default_timeout(solver_time_limit)
    if isinstance(value, timedelta):
        if value <= timedelta(0):
            raise ValueError(
                f"OSDPStrategy(timeout=...) must be a positive timedelta or number of seconds, got {value!r}"
            )
        timeout = value
    else:
        timeout = timedelta(seconds=_seconds("timeout", value, accepts="a positive timedelta or number of seconds"))
    wait = planning_wait(solver_time_limit)
    if planning and timeout < wait:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            f"OSDPStrategy(timeout={timeout.total_seconds():g} s): the other ranks wait for rank 0's plan in a "
            f"collective, and with solver_time_limit={solver_time_limit:g} s the solve may take up to about "
            f"{wait.total_seconds():g} s; a timeout shorter than that can end the run while rank 0 is solving"
        )
    return timeout


def _integer(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"OSDPStrategy({name}=...) takes an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"OSDPStrategy({name}=...) must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _seconds(name: str, value: Any, *, accepts: str = "a positive number of seconds") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"OSDPStrategy({name}=...) takes {accepts}, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"OSDPStrategy({name}=...) takes {accepts}, got {value!r}")
    return float(value)
