"""Agreeing across ranks on what one rank computed: the plan, the profile, a checkpoint's commit.

[Note: results and errors from rank 0]
Some work runs on rank 0 alone (the ILP solve, a checkpoint's commit) or runs everywhere but must end with one
answer (the profile, whose figures differ a little per rank). Every rank must then leave with rank 0's result,
or every rank must raise: a rank that raised while the others wait in a collective for it would hang them until
the process group's timeout. :func:`from_rank_zero` is that protocol, written once: rank 0's outcome (a result or an
error) is broadcast, and an error is raised on every rank (the error itself where it survives pickling, else a
``RuntimeError`` with its text).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch.distributed as dist

__all__ = ["all_gather", "broadcast", "from_rank_zero", "is_distributed", "rank", "world_size"]

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the default group), 0 without a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: Any = None) -> int:
    """Ranks in ``group`` (the default group), 1 without a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def broadcast(obj: T, src: int = 0, group: Any = None) -> T:
    """Rank ``src``'s ``obj`` (``src`` counted in ``group``) on every rank of ``group``."""
    if not is_distributed() or world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return box[0]


def all_gather(obj: T, group: Any = None) -> list[T]:
    """Every rank's ``obj``, in rank order of ``group``, on every rank of ``group``."""
    if not is_distributed() or world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def from_rank_zero(fn: Callable[[], T], *, what: str, everywhere: bool = False, group: Any = None) -> T:
    """Rank 0's ``fn()`` on every rank of ``group``, or its error raised on every rank (see [Note: results and
    errors from rank 0]).

    Args:
        fn: the work.
        what: what it is, for the error other ranks raise when rank 0's error does not pickle.
        everywhere: run ``fn`` on every rank (it holds collectives every rank must join) and keep rank 0's result;
            an error on any rank is raised on every rank.
        group: the process group (default: the world).
    """
    if not is_distributed() or world_size(group) == 1:
        return fn()
    me = rank(group)
    result: Any = None
    error: BaseException | None = None
    if everywhere or me == 0:
        try:
            result = fn()
        except Exception as err:
            error = err
    if everywhere:
        # Any rank's failure must reach every rank before rank 0's result is awaited.
        failures: list[Any] = [None] * world_size(group)
        dist.all_gather_object(failures, _transportable(error) if error is not None else None, group=group)
        first = next(((r, e) for r, e in enumerate(failures) if e is not None), None)
        if first is not None:
            if error is not None:
                raise error
            raise RuntimeError(f"{what} failed on rank {first[0]}: {first[1]}") from first[1]
    outcome = broadcast((result if me == 0 else None, _transportable(error) if me == 0 and error else None), 0, group)
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise outcome[1]
    return cast(T, result if me == 0 else outcome[0])


def _transportable(error: BaseException) -> BaseException:
    """``error`` itself if it survives pickling (it is sent to every rank), else a ``RuntimeError`` with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
