"""No rank outlives the run: the ranks Lightning's subprocess launcher starts end with rank 0, and rank 0 with them.

[Note: processes left behind]
Under ``start_method="popen"`` rank 0 is the user's own process; Lightning's ``_SubprocessScriptLauncher`` starts
ranks 1..N-1 by running the same script with ``Popen``, and watches them with a thread that SIGKILLs everything when
one exits with an error (within its 5 s poll). Nothing ends those ranks when rank 0 ends:

* a rank that stops (SIGSTOP, a deadlock in user code) leaves the others in a collective until the process-group
  timeout; rank 0 then raises and exits, and the stopped rank can stay behind, an orphan, for good;
* rank 0 killed (OOM killer, SIGKILL) before the ranks connect leaves the others waiting in the rendezvous (the
  TCPStore of ``init_process_group``) for the whole timeout.

torchrun's agent avoids this by owning every rank and killing their process groups when one fails. Here rank 0 is
both a rank and the launcher, so each side does its part:

* every rank started here is tied to rank 0 when it reaches the launcher: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux)
  makes the kernel kill it when rank 0 dies, however rank 0 dies, even while it is stopped; it then checks that its
  parent is still rank 0 (rank 0 may have died before the call). Elsewhere a thread polls the parent instead (it
  cannot end a stopped process). ``torch.multiprocessing`` ties its spawned workers to their parent the same way
  (with SIGINT);
* rank 0 watches its ranks every 0.5 s: one that exits with an error while rank 0 still runs ends rank 0 with status
  1 (the others killed), naming the rank, where Lightning's observer SIGKILLs rank 0 within 5 s. Once rank 0's own
  run has raised, the watch leaves it to exit with its traceback;
* at exit, rank 0 waits for its ranks as torchrun's agent does (they may still be finishing the script), up to the
  process-group timeout, then kills what is left. When the run failed (an exception left ``trainer.fit``, such as
  the timeout of a collective with a stopped rank) it kills them at once: a rank blocked in a collective with rank 0
  cannot finish while rank 0 lives.

The death signal belongs to the *thread* that started the ranks: ``trainer.fit`` called from a thread that ends before
the process does ends the ranks with it. Ranks started by torchrun, SLURM or another external launcher are not
touched. ``start_method="spawn"`` (``torch.multiprocessing``) has its own clean-up: when a rank fails, the main
process sends the others SIGTERM, then SIGKILL 30 s later.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_osdp._compat import SubprocessScriptLauncher, set_num_threads_if_needed

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__: list[str] = []

#: Set by rank 0 in the environment of the ranks it starts: its process id.
LAUNCHER_PID_ENV = "LIGHTNING_OSDP_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_SECONDS = 0.5


class _OSDPSubprocessScriptLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess launcher, with no rank left behind (see [Note: processes left behind]).

    Args:
        exit_wait: how long rank 0, exiting after a run that did not fail, waits for its ranks to finish before it
            kills them (the process-group timeout).
    """

    def __init__(
        self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int, *, exit_wait: timedelta
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._exit_wait = exit_wait

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        global _WATCH
        if self.cluster_environment.creates_processes_externally:
            # A rank started by rank 0 (or rank 0 itself, in a second `fit`: Lightning left LOCAL_RANK set).
            tie_to_launcher()
            return _run(super().launch, function, *args, trainer=trainer, **kwargs)
        # Lightning's `launch`, with `_RankWatch` in place of its child-process observer.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        # Only the ranks started here may see the marker: not rank 0's later subprocesses (a torchrun job, say).
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        try:
            self._call_children_scripts()  # copies os.environ into each rank's environment
        finally:
            del os.environ[LAUNCHER_PID_ENV]
        if self.procs:
            _WATCH = _RankWatch(self.procs, exit_wait=self._exit_wait.total_seconds())
        set_num_threads_if_needed(self.num_processes)
        return _run(function, *args, **kwargs)


def _run(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, recording in rank 0's watch whether it failed."""
    try:
        result = function(*args, **kwargs)
    except SIGTERMException:
        # Every rank stops after the same step (preemption.py): rank 0 waits for the others, as after a run that
        # ended, since they may still be saving a checkpoint in `on_exception`.
        if _WATCH is not None:
            _WATCH.failed = False
        raise
    except BaseException:
        if _WATCH is not None:
            _WATCH.failed = True
        raise
    if _WATCH is not None:
        _WATCH.failed = False
    return result


class _RankWatch:
    """Rank 0's watch over the ranks it started: ends rank 0 when one fails, ends them when rank 0 exits."""

    def __init__(self, procs: list[subprocess.Popen], *, exit_wait: float) -> None:
        self.procs = procs
        self.exit_wait = exit_wait
        #: Whether the last launched function raised: at exit, the ranks are killed without waiting.
        self.failed = False
        self._closing = threading.Event()
        threading.Thread(target=self._watch, name="osdp-rank-watch", daemon=True).start()
        atexit.register(self.close)

    def _watch(self) -> None:
        while not self._closing.wait(_POLL_SECONDS):
            codes = [p.poll() for p in self.procs]
            for rank, (proc, code) in enumerate(zip(self.procs, codes, strict=True), start=1):
                # Not once rank 0's own run has failed: it is on its way out, and its traceback says more.
                if code and not self._closing.is_set() and not self.failed:
                    _say(f"rank {rank} (pid {proc.pid}) {_exit_status(code)}: ending the run")
                    self._kill()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(1)  # the main thread may be blocked in a collective: end the process from here
            if all(code == 0 for code in codes):
                return

    def close(self) -> None:
        """At rank 0's exit: wait for the ranks (not after a failure), then kill what is left, saying which."""
        self._closing.set()
        if not self.failed:
            deadline = time.monotonic() + self.exit_wait
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(deadline - time.monotonic(), 0.0))
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is None:
                after = "failed" if self.failed else f"ended {self.exit_wait:g} s ago"
                _say(f"rank {rank} (pid {proc.pid}) still runs and rank 0 {after}: killing it")
            elif code and self.failed:
                _say(f"rank {rank} (pid {proc.pid}) {_exit_status(code)}")
        self._kill()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL: it also ends a stopped process or one blocked in a collective
        for proc in self.procs:
            proc.wait()


#: Rank 0's watch over the ranks it started (Lightning starts them once per process); ``None`` in other processes.
_WATCH: _RankWatch | None = None


def tie_to_launcher() -> None:
    """In a rank started by rank 0's launcher: die when rank 0 dies; raise if it is already gone."""
    # Taken out of the environment, so that this rank's own subprocesses do not take it for their launcher.
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is None:
        return  # not started by our launcher (torchrun, SLURM, rank 0 itself), or tied already by an earlier `fit`
    parent = int(launcher)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            _watch_parent(parent)
    else:
        _watch_parent(parent)
    if os.getppid() != parent:
        raise RuntimeError(
            f"rank 0 (pid {parent}), which started this process, has exited: this rank ends too (rank 0's output says "
            "why it ended)"
        )


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="osdp-parent-watch", daemon=True).start()


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _say(message: str) -> None:
    print(f"lightning_osdp: {message}", file=sys.stderr, flush=True)
