"""What ``OSDPStrategy.setup`` tells the user while it works: each stage as it starts and, when it ends, what it found
and its seconds; one line with the whole setup's seconds.

Setup profiles the model, benchmarks the collectives, solves the plan, applies it and materializes the weights: on a
real model that is minutes after Lightning's "All distributed processes registered", and a run that prints nothing
meanwhile looks hung. The lines go through Lightning's ``rank_zero_info``, so they appear on rank 0 only, as Lightning's
own do, and a user who raises the ``lightning.pytorch`` logger above INFO silences them with Lightning's. They are
plain lines, never redrawn, so they need no progress bar and read the same in a log file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["SetupLog"]

T = TypeVar("T")


class SetupLog:
    """Stages of one setup, each logged when it starts and when it ends with its seconds (see the module docstring)."""

    def __init__(self, log: Callable[[str], None] = rank_zero_info) -> None:
        self._log = log
        self._started = time.perf_counter()
        #: ``(stage, seconds)`` of every stage that ended, in order.
        self.stages: list[tuple[str, float]] = []

    @contextmanager
    def stage(self, what: str, done: Callable[[], str] | None = None) -> Iterator[None]:
        """Log ``what`` as it starts, and as it ends with ``done()`` (what it found) and its seconds."""
        self._log(f"OSDP: {what}...")
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.stages.append((what, seconds))
        found = done() if done is not None else ""
        self._log(f"OSDP: {what}: {found + ', ' if found else ''}done in {seconds:.1f} s")

    def timed(self, what: str, fn: Callable[[], T], done: Callable[[T], str] | None = None) -> T:
        """``fn()`` as a stage; ``done(result)`` says what it found."""
        result: list[T] = []
        with self.stage(what, (lambda: done(result[0])) if done is not None else None):
            result.append(fn())
        return result[0]

    def finish(self) -> float:
        """Log the whole setup's seconds, by stage; returns them. A setup that ran no stage (``trainer.validate``
        after ``fit``, whose plan is already applied) logs nothing."""
        total = time.perf_counter() - self._started
        if not self.stages:
            return total
        parts = ", ".join(f"{what} {seconds:.1f} s" for what, seconds in self.stages)
        self._log(f"OSDP: setup took {total:.1f} s" + (f" ({parts})" if parts else ""))
        return total
