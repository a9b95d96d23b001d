"""Block-wise timing: each distinct block of a model measured on the device on its own, one at a time.

[Note: a profile that fits]
The measured profile runs a copy of the whole model with its gradients and optimizer state: a model whose step does
not fit the budget cannot be profiled that way, and a model built on the meta device has no values to run. The
*blocks* profile takes its bytes from one fake-tensor trace of the step (exact, as the estimated mode's) and its
times from the device: every block (a ``ModuleList``/``Sequential`` element, :func:`~lightning_osdp.plan.default_units`)
is keyed by its class, its parameters' names, shapes and dtypes, and the arguments the trace recorded for its first
call; one representative of each key is materialized on the device (random values: a time does not depend on them),
run forward and backward ``repeats`` times under the module tracer on inputs of the recorded shapes, and freed
before the next. Every block of the key gets the measured own times of its modules. A Transformer of any depth is
timed by materializing one block, so the cost grows with the number of distinct block types, not with depth.

What is not in a block (embeddings, the final norm, the head, the loss) keeps the times the estimated mode gives it
from its FLOPs and bytes at the device's measured rates; so do blocks whose arguments cannot be rebuilt (a value that
is not a tensor, a number, a string, ``None`` or a key/value cache, or a size that depends on tensor values). A
cache (Hugging Face's ``DynamicCache``, which its decoders pass to every layer in training too) is rebuilt empty
(``tracer.py`` [Note: a cache argument]).
Each block is materialized alone, with its gradients and activations at the traced batch: at most what a plan's
step holds of it at once.
"""

from __future__ import annotations

import copy
import gc
import statistics
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_osdp._compat import tree_leaves, tree_map
from lightning_osdp.profiling.replay import count_saves, time_full_replay
from lightning_osdp.profiling.replica import materialize_randomly
from lightning_osdp.profiling.selective import time_replay
from lightning_osdp.profiling.timing import device_clock, timed_section
from lightning_osdp.profiling.tracer import EmptyCacheSpec, ModuleTracer, StepRecord, TensorSpec

__all__ = ["BlockTimes", "measure_blocks"]

_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass
class BlockTimes:
    """Measured own ``(forward, backward)`` seconds of the modules of every block timed, by full module name, and
    what was timed: ``timed`` maps each representative to the blocks it stands for, ``skipped`` names the blocks left
    with estimated times and why."""

    modules: dict[str, tuple[float, float]] = field(default_factory=dict)
    timed: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    #: Per block, what selective recomputation adds to its step (``selective.py``'s ``time_replay``), for the blocks
    #: asked for.
    replay: dict[str, float] = field(default_factory=dict)
    #: Per block, what its full recomputation runs in backward (``replay.py``'s ``time_full_replay``).
    full_replay: dict[str, float] = field(default_factory=dict)


def _key(block: nn.Module, inputs: Any) -> tuple[Any, ...]:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    leaves = tuple(
        (leaf.shape, leaf.dtype, leaf.requires_grad) if isinstance(leaf, TensorSpec) else repr(leaf)
        for leaf in tree_leaves(inputs)
    )
    return (type(block).__module__, type(block).__qualname__, params, leaves)


def _unrebuildable(inputs: Any) -> str | None:
    for leaf in tree_leaves(inputs):
        if isinstance(leaf, TensorSpec):
            if -1 in leaf.shape:
                return "an argument's size depends on tensor values"
        elif not isinstance(leaf, (*_SIMPLE, EmptyCacheSpec)):
            return f"an argument of type {type(leaf).__name__} cannot be rebuilt"
    return None


def _rebuild(inputs: Any, device: torch.device) -> Any:
    def make(leaf: Any) -> Any:
        if isinstance(leaf, EmptyCacheSpec):
            return leaf.build()  # a new one for every run: the block appends to it
        if not isinstance(leaf, TensorSpec):
            return leaf
        if leaf.dtype.is_floating_point or leaf.dtype.is_complex:
            return torch.randn(leaf.shape, dtype=leaf.dtype, device=device).requires_grad_(leaf.requires_grad)
        return torch.zeros(leaf.shape, dtype=leaf.dtype, device=device)  # ids, masks, positions

    return tree_map(make, inputs)


def measure_blocks(
    module: nn.Module,
    blocks: list[str],
    record: StepRecord,
    device: torch.device,
    *,
    repeats: int = 3,
    step_context: Callable[[], AbstractContextManager[Any]] | None = None,
    selective: Collection[str] = (),
) -> BlockTimes:
    """Time each distinct block of ``module`` on ``device`` (see [Note: a profile that fits]).

    Args:
        module: the user's model (on the meta device or not); it is not modified.
        blocks: the names of its blocks.
        record: the traced step (fake tensors), which recorded each block's first arguments.
        device: where to run.
        repeats: timed runs per representative, after one untimed warm-up.
        step_context: the context the step's forward runs in (the precision plugin's autocast).
        selective: the blocks whose replay under selective recomputation is timed too.
    """
    result = BlockTimes()
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name in blocks:
        inputs = record.modules[name].inputs if name in record.modules else None
        if inputs is None:
            result.skipped[name] = "it did not run in the traced step"
            continue
        reason = _unrebuildable(inputs)
        if reason is not None:
            result.skipped[name] = reason
            continue
        groups.setdefault(_key(module.get_submodule(name), inputs), []).append(name)
    context = step_context or nullcontext
    clock = device_clock(device)
    for members in groups.values():
        representative = members[0]
        times, replay, full_replay = _time_one(
            module.get_submodule(representative),
            record.modules[representative].inputs,
            device,
            repeats,
            context,
            clock,
            replay=representative in selective,
        )
        result.timed[representative] = members
        for member in members:
            for inner, figures in times.items():
                result.modules[f"{member}.{inner}" if inner else member] = figures
            if replay is not None:
                result.replay[member] = replay
            result.full_replay[member] = full_replay
        gc.collect()
    return result


def _time_one(
    block: nn.Module,
    inputs: Any,
    device: torch.device,
    repeats: int,
    context: Callable[[], AbstractContextManager[Any]],
    clock: Callable[[], float],
    *,
    replay: bool,
) -> tuple[dict[str, tuple[float, float]], float | None, float]:
    replica = copy.deepcopy(block)
    materialize_randomly(replica, device)
    replica.train(block.training)
    tracer = ModuleTracer(replica, clock)

    def step(traced: bool) -> None:
        args, kwargs = _rebuild(inputs, device)  # outside the modules' timed intervals
        forward = tracer.forward() if traced else nullcontext()
        with forward, context():
            out = replica(*args, **kwargs)
        floats = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
        if floats:
            loss = torch.stack([t.float().sum() for t in floats]).sum()
            tracer.backward(loss) if traced else loss.backward()
        replica.zero_grad(set_to_none=True)

    step(False)  # warm-up: the allocator's and the kernels' first calls
    records: list[StepRecord] = []
    with timed_section():
        for _ in range(repeats):
            with tracer.iteration() as record:
                step(True)
            records.append(record)
    times = {
        name: (
            statistics.median(r.modules[name].fwd_seconds for r in records),
            statistics.median(r.modules[name].bwd_seconds for r in records),
        )
        for name in records[0].modules
    }
    with context():
        saves = count_saves(replica, *_rebuild(inputs, device))
        full = [time_full_replay(replica, lambda: _rebuild(inputs, device), clock, saves) for _ in range(repeats)]
        if not replay:
            return times, None, statistics.median(full)
        replays = [time_replay(replica, lambda: _rebuild(inputs, device), clock, saves) for _ in range(repeats)]
    return times, statistics.median(replays), statistics.median(full)
