"""The few collectives a save needs, usable with or without a process group (a single process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (so that all ranks agree on a path or a token)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def all_gather(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def on_rank_zero(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 only; every rank returns once it is done, and every rank raises if it failed (a rank
    left waiting in a later collective for a rank that raised would hang)."""
    from lightning_osdp.checkpoint.errors import CheckpointError

    error: BaseException | None = None
    if rank() == 0:
        try:
            fn()
        except BaseException as err:
            error = err
    failed = broadcast(repr(error) if error is not None else None)
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"{what} failed on rank 0: {failed}")
