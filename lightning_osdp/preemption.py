"""SIGTERM to one rank stops every rank, at the same optimizer step, within a step or two.

[Note: preemption]
A scheduler that preempts a job, or a user's ``kill``, sends SIGTERM, often to one process only. Lightning 2.6's
handler (``_SignalConnector._sigterm_notifier_fn``) then runs ``dist.broadcast(src=0)`` on the signalled rank alone:
a collective no other rank joins, in the middle of whatever collectives they are in. Both ranks hung for the whole
process-group timeout (302 s) and exited 1; Lightning's DDP does the same. And the rank that was signalled raises
``SIGTERMException`` at the end of its batch while the others go on, so even without that broadcast they would wait
for it in their next collective.

What every rank must agree on is *the step after which they stop*; how they learn it must not be a collective, since
the ranks are not at the same point of their code when one is signalled. The process group's key-value store (the
rendezvous ``TCPStore`` that every rank already holds a connection to) carries it:

* the signalled rank's handler (which replaces Lightning's notifier for OSDP's runs) writes ``stop after step N`` to
  the store, ``N = s + 2`` with ``s`` the optimizer steps it has completed (a compare-and-set: when several ranks are
  signalled, as a scheduler signals them all, the first one's ``N`` holds), and carries on training (a signal during
  ``fit``'s validation or sanity check counts from the steps done so far);
* every rank, after each optimizer step, checks the store for that key (one round trip to rank 0's store, no
  collective, no device synchronisation), and after step ``N`` marks itself signalled as Lightning's own handler would
  (``trainer.received_sigterm``): Lightning's loop then raises ``SIGTERMException`` at the end of that batch, on every
  rank alike.

Why every rank sees the key by step ``N``: the signalled rank wrote it before it took part in any collective of step
``s + 2``, and no rank can finish that step's gradient reduction without it. So no rank passes step ``N`` unaware, and
none stops before it. The stop comes one or two steps after the signal; a rank blocked in a collective when it is
signalled (a peer hung) handles the signal when the collective returns, at the timeout at worst, as before.

A second SIGTERM to the same rank is not waited on: the rank dies of it (the default action), and the launcher's watch
ends the others (``watchdog``). Outside ``fit`` (``validate``, ``test``, ``predict``: no optimizer steps to agree on)
a signalled rank dies at once the same way; with one process, it takes Lightning's path.

Since every rank raises ``SIGTERMException`` at the same step, a callback's ``on_exception`` may save a checkpoint
there: all ranks reach the (collective, atomic) save together, so it is written whole or not at all
(``docs/checkpointing.md``, "Preemption"). Lightning ends the processes with ``SystemExit`` there, status 0.
"""

from __future__ import annotations

import os
import signal
import sys
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn

from lightning_osdp import distributed
from lightning_osdp._compat import default_store, mark_sigterm, replace_sigterm_notifier

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Preemption", "after_optimizer_step", "install"]

#: Optimizer steps between the signal and the stop (see [Note: preemption]).
STEPS_TO_STOP = 2
_KEY = "lightning_osdp/preemption/stop_after_step"


class Preemption:
    """One trainer's agreement on when to stop after a SIGTERM (see [Note: preemption])."""

    def __init__(self, trainer: pl.Trainer, generation: int) -> None:
        self._trainer = weakref.ref(trainer)
        self._key = f"{_KEY}/{generation}"
        self._store: Any = default_store() if distributed.is_distributed() else None
        self._signalled = False
        self.stop_after: int | None = None

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler Lightning composes in place of its notifier."""
        trainer = self._trainer()
        if self._signalled or trainer is None:
            # A second SIGTERM: die of it, as a process without a handler would; the launcher ends the others.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._signalled = True
        rank = distributed.rank()
        if self._store is None or distributed.world_size() == 1:
            _say("received SIGTERM: stopping")
            mark_sigterm(trainer)  # one process: Lightning's own way (its loop stops at the end of the batch)
            return
        if trainer.state.fn != TrainerFn.FITTING:
            # validate/test/predict count no optimizer steps to agree on: this rank ends now, its launcher the others.
            _say(f"rank {rank} received SIGTERM outside fit: ending the run")
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        proposed = trainer.global_step + STEPS_TO_STOP
        agreed = int(self._store.compare_set(self._key, "", str(proposed)))
        self.stop_after = agreed
        _say(
            f"rank {rank} received SIGTERM after step {trainer.global_step}: every rank stops after step {agreed} "
            "(a second SIGTERM ends this rank at once)"
        )

    def after_optimizer_step(self, trainer: pl.Trainer) -> None:
        """After each optimizer step, on every rank: mark the trainer signalled once the agreed step is done."""
        if self._store is None:
            return
        if self.stop_after is None:
            if not self._store.check([self._key]):
                return
            self.stop_after = int(self._store.get(self._key))
        # Lightning counts the step as completed once this hook returns.
        if trainer.global_step + 1 >= self.stop_after and not trainer.received_sigterm:
            if distributed.rank() == 0:
                _say(f"stopping every rank after step {trainer.global_step + 1} (SIGTERM)")
            mark_sigterm(trainer)


_INSTALLED: weakref.WeakKeyDictionary[Any, Preemption] = weakref.WeakKeyDictionary()
_generation = 0


def install(trainer: pl.Trainer) -> None:
    """Make ``trainer``'s SIGTERM handling agree across ranks (see [Note: preemption]). Called on every rank in the
    strategy's ``setup``, before Lightning registers its signal handlers; each call (each ``fit``) agrees afresh."""
    global _generation
    _generation += 1
    preemption = Preemption(trainer, _generation)
    _INSTALLED[trainer] = preemption
    replace_sigterm_notifier(trainer, preemption.on_sigterm)


def after_optimizer_step(trainer: pl.Trainer | None) -> None:
    """The strategy's call after each optimizer step (a no-op for a trainer :func:`install` did not see)."""
    preemption = _INSTALLED.get(trainer) if trainer is not None else None
    if preemption is not None:
        preemption.after_optimizer_step(trainer)  # type: ignore[arg-type]


def _say(message: str) -> None:
    print(f"lightning_osdp: {message}", file=sys.stderr, flush=True)
