"""The blocks' figures under selective recomputation: what each keeps, the live bytes its forward adds, its replay.

[Note: measuring selective recomputation]
Under ``recompute="selective"`` (``lightning_osdp/apply/recompute.py`` [Note: selective recomputation]) a block keeps,
from its forward to its backward, the outputs of its kept operators, and its recomputation in backward runs the
block's forward code with those operators served from the checkpoint's cache. The profiler measures both on its
replica, after the traced step and the full-recomputation pass, by running the step's forward once more with every
block checkpointed selectively, as the executor does it:

* *kept bytes*: the live bytes at the end of the block's forward less those at its start and less its output (the
  inputs were live already), read off the memory meter at the block's forward hooks: the storages torch's caching
  mode holds, whatever the policy keeps;
* *forward bytes*: the largest live bytes between those hooks, above the start (the meter's window);
* *replay*: the block's forward run again the way the recomputation runs it, the kept operators served from the
  forward's cache (the executor's two modes, ``KeepOutputs`` and ``ReplayKept``, filled by one more forward of the
  block in its forward hook), stopped at the forward's last saved tensor as torch stops it (``replay.py`` [Note: the
  recomputation stops at the last saved tensor]). Measured mode times it on the device, with what the caching mode
  adds to the forward (the modes dispatch every operator through Python: on a small model on the CPU that is more than
  the kernels themselves; on a GPU-sized block, noise): the median of ``repeats`` such figures, each with its cache
  filled anew.
  The estimated mode records the replay's operators (FLOPs and bytes, as the tracer does) for the rates to turn into
  seconds, and counts no dispatch cost (the rates have no term for it); the blocks mode times the replay as measured
  mode does, on the block's representative (``blocks.py``), and uses the rates' figure only for a block it could
  not time. Each of the three forwards of one figure gets arguments of its own where the block changes one: a
  key/value cache (``tracer.py`` [Note: a cache argument]) is replaced by an empty one, or each forward would append
  to it and attend over keys the step never has.

The replay under the hook runs with gradients enabled (the recomputation records a graph too) on the block's own
arguments; what it builds is dropped at once. Only blocks (the parameter-owning children of a
``ModuleList``/``Sequential``, what the planner recomputes) are measured. A block whose forward changes a kept output
in place (``nn.ReLU(inplace=True)`` after an ``nn.Linear``) gets no figures: selective recomputation cannot run it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_osdp._compat import tree_leaves, tree_map
from lightning_osdp.apply.recompute import KeepOutputs, RecomputedForward, ReplayKept, recompute_modules
from lightning_osdp.memory import memory_meter
from lightning_osdp.profiling.replay import OpsTally, count_saves, until_last_save
from lightning_osdp.profiling.timing import timed_section
from lightning_osdp.profiling.tracer import OpTally, _OpRecorder, empty_cache

__all__ = ["SelectiveFigures", "fresh_caches", "measure_selective", "time_replay"]


@dataclass
class SelectiveFigures:
    """One block under selective recomputation (see [Note: measuring selective recomputation]).

    Attributes:
        kept_bytes: what its forward keeps for backward beyond its inputs and output.
        forward_bytes: the largest live bytes its forward adds.
        replay_seconds: the seconds selective recomputation adds to a step of it, timed: its replay, and what the
            caching mode adds to its forward (a Python dispatch per operator); ``None`` on fake tensors.
        replay_ops: its replay's operators (recorded on fake tensors only).
        mutated: the kept operators whose outputs its forward changes in place: selective recomputation cannot
            replay it (the figures are then not used).
    """

    kept_bytes: int = 0
    forward_bytes: int = 0
    replay_seconds: float | None = None
    replay_ops: OpTally = field(default_factory=OpTally)
    mutated: list[str] = field(default_factory=list)


def _output_bytes(output: Any) -> int:
    seen: dict[int, int] = {}
    for t in tree_leaves(output):
        if isinstance(t, Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr() if not _fake(t) else id(storage)] = storage.nbytes()
    return sum(seen.values())


def _fake(t: Tensor) -> bool:
    from lightning_osdp._compat import is_fake

    return is_fake(t)


def fresh_caches(arguments: Any) -> Any:
    """``arguments`` with every key/value cache replaced by an empty one of its class (see [Note: measuring
    selective recomputation])."""

    def fresh(leaf: Any) -> Any:
        empty = empty_cache(leaf)
        return leaf if empty is None else empty

    return tree_map(fresh, arguments)


def time_replay(
    forward: Callable[..., Any], arguments: Callable[[], tuple[Any, Any]], clock: Callable[[], float], saves: int
) -> float:
    """One figure of what selective recomputation adds to a block's step (see [Note: measuring selective
    recomputation]): ``forward`` run plainly, under the caching mode and as the replay (stopped at its ``saves``-th
    saved tensor, as torch stops it: ``replay.py``), each on ``arguments()`` (made before the clock starts), with
    gradients enabled."""
    calls = [arguments() for _ in range(3)]
    caching = KeepOutputs()
    cached = ReplayKept(caching)
    # Timed without the memory meter's mode (timing.py [Note: what a timed section runs without]).
    with torch.enable_grad(), timed_section():
        start = clock()
        forward(*calls[0][0], **calls[0][1])
        plain = clock()
        with caching:
            forward(*calls[1][0], **calls[1][1])
        cached_forward = clock()
        with cached, until_last_save(saves):
            forward(*calls[2][0], **calls[2][1])
        end = clock()
    # The forward's own cost of the caching mode (a Python dispatch per operator), and the replay.
    return max(cached_forward - plain - (plain - start), 0.0) + (end - cached_forward)


def measure_selective(
    work: nn.Module,
    blocks: list[str],
    forward: Callable[[], Any],
    device: torch.device,
    *,
    fake: bool,
    clock: Callable[[], float],
    repeats: int = 3,
    roots: tuple[Any, ...] = (),
) -> dict[str, SelectiveFigures]:
    """Per block of ``work``, its :class:`SelectiveFigures`: ``forward()`` runs the step's forward once with every
    block checkpointed selectively (the blocks stay so). ``fake``: the replica is on fake tensors (no timing, the
    replay's operators recorded instead); ``clock``: the device's (it waits for the device); ``roots``: what the
    memory meter counts as live besides ``work`` (the optimizers)."""
    if not blocks:
        return {}
    recompute_modules(work, blocks, "selective")
    for name in blocks:
        # A block that changes a kept output in place is recorded, not refused: the plan then never recomputes it so.
        work.get_submodule(name).__dict__["forward"].strict = False
    meter = memory_meter(device, fake=fake)
    started: dict[str, int] = {}
    figures: dict[str, SelectiveFigures] = {name: SelectiveFigures() for name in blocks}
    handles = []

    def replay(module: nn.Module, args: Any, kwargs: Any, figure: SelectiveFigures) -> None:
        inner = module.__dict__["forward"]
        assert isinstance(inner, RecomputedForward)
        saves = count_saves(inner.inner, *fresh_caches((args, kwargs)))
        if not fake:
            figure.replay_seconds = statistics.median(
                time_replay(inner.inner, lambda: fresh_caches((args, kwargs)), clock, saves)
                for _ in range(max(repeats, 1))
            )
            return
        caching = KeepOutputs()
        cached = ReplayKept(caching)
        with torch.enable_grad():
            with caching:
                inner.inner(*fresh_caches(args), **fresh_caches(kwargs))
            tally = OpsTally()
            # The recorder outside the cache's mode: it sees only what the replay runs (a kept operator is served by
            # the cache and never reaches it).
            with _OpRecorder(tally), cached, until_last_save(saves):  # type: ignore[arg-type]
                inner.inner(*fresh_caches(args), **fresh_caches(kwargs))
        figure.replay_ops = tally.ops

    for name in blocks:
        module = work.get_submodule(name)

        def pre(*_: Any, name: str = name) -> None:
            started[name] = meter.mark()[1]

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            window, live = meter.mark()
            figure = figures[name]
            forward = module.__dict__["forward"]
            if forward.mutated_kept:
                figure.mutated = list(forward.mutated_kept)
                return
            out = _output_bytes(output)
            figure.kept_bytes = max(figure.kept_bytes, live - started[name] - out)
            figure.forward_bytes = max(figure.forward_bytes, window - started[name])
            replay(module, args, kwargs, figure)
            meter.mark()  # the replay's own window is no block's

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    meter.start(work, *roots)
    try:
        loss = forward()
        del loss
    finally:
        meter.stop()
        for handle in handles:
            handle.remove()
    return figures
