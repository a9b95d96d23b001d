"""CBC's files and process: every file of one solve in one temporary directory of ours, gone however it ends.

[Note: CBC's files and processes]
pulp runs CBC as a subprocess on files it writes (the model as ``.mps``, the solution as ``.sol``) in its own
temporary directory (``/tmp`` by default), and deletes them only when the run succeeds; our log went into a
second directory. A solve interrupted by a kill left both behind, and CBC itself ran on, orphaned, to its time
limit. Three ways were considered:

- a ``SIGTERM`` handler installed for the life of the process: a library must not change a process's signal
  disposition behind its owner's back (Lightning installs its own once ``fit`` runs, applications theirs);
- starting CBC with ``PR_SET_PDEATHSIG``, so that the kernel kills it with us: pulp builds the command line and
  the ``Popen`` (replacing its ``solve_CBC`` means copying it), a ``preexec_fn`` is not safe in a process with
  threads, and a launcher process in between costs a Python start per CBC run;
- what is done: one directory per solve (:func:`cbc_workspace`), handed to pulp as its ``tmpDir`` and holding
  our log too, named ``osdp_cbc_<host>_<pid>_...`` under :func:`tempfile.gettempdir` (``<host>`` tells apart
  machines and PID namespaces sharing one ``/tmp``). It is removed when the solve ends, normally or by any
  exception (``KeyboardInterrupt`` included), after killing the CBC child still running on it (found by the
  files its command line names). ``SIGTERM`` with the default disposition (nobody handles it) kills a process
  without running ``finally`` blocks, so while a solve runs in the main thread it is turned into an exception;
  once the directory is gone the default disposition is restored and the signal sent again, so the process
  still dies of ``SIGTERM``, a moment later. Where a handler is already installed (the application's), it is
  left alone: that handler decides, and the solve ends normally. What no process can clean after itself
  (``SIGKILL``, ``SIGTERM`` during a solve in another thread) the next solve sweeps: a directory whose owner
  process is gone is removed, and a CBC still running on it is killed (until then, it runs at most to its time
  limit). On systems without ``/proc``, CBC processes are not found: an orphan runs to its time limit.

[Note: one model file per solve]
pulp writes the whole model to an MPS file for every CBC run, and the phases of one solve run CBC up to six times
on the same rows: each changes only bounds (variables fixed, counts held) and categories (binaries made
continuous). Writing the file is pulp formatting every nonzero in Python, about as long as CBC's own LP solve on
deep models (1 s for the 566,774 nonzeros of 2,000 planning units). :class:`CachedMPSProblem` formats the rows, the
columns and the right-hand side once, on the first write, and writes only the integer markers and the bounds again
on the later ones; the file is byte for byte the one pulp writes (``tests/test_solver.py``), so CBC sees the same
model. The cached text is made again when the objective is replaced or a row or variable added (it holds the
objective it was made from and counts the rows and variables); a row's coefficients changed in place are not seen,
so the matrix is not changed in place once written (the planner builds its rows once, in
``PlanningProblem._formulate``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import pulp
from pulp import constants
from pulp.mps_lp import writeMPSBoundLines

__all__ = ["PREFIX", "CachedMPSProblem", "cbc_command", "cbc_workspace", "sweep_abandoned"]

#: Every solve's directory starts with this, under :func:`tempfile.gettempdir`.
PREFIX = "osdp_cbc_"


# pulp's own line formats (``pulp.mps_lp``), kept as %-formats: the file is pulp's byte for byte, and on this
# machine they format the numbers faster than f-strings do.
_COLUMN = "    %-8s  %-8s  % .12e\n"
_RHS = "    RHS       %-8s  % .12e\n"
_INTORG = "    MARK      'MARKER'                 'INTORG'\n"
_INTEND = "    MARK      'MARKER'                 'INTEND'\n"


@dataclass(frozen=True)
class _ModelText:
    """The parts of an MPS file that bounds and categories do not change, with pulp's names for them."""

    variables: list[pulp.LpVariable]
    variable_names: dict[str, str]
    constraint_names: dict[str, str]
    head: str  # NAME, ROWS and the COLUMNS header
    columns: list[str]  # per variable (in ``variables`` order): its coefficient lines and its objective line
    rhs: str  # the RHS section
    objective: pulp.LpAffineExpression  # what the text was made from: the objective (held, so never another's id)
    shape: tuple[int, int]  # and the number of rows and of variables


class CachedMPSProblem(pulp.LpProblem):
    """A ``pulp.LpProblem`` whose MPS file is formatted once and then only updated in its bounds and integer
    markers (see [Note: one model file per solve]); the file is the one ``pulp.LpProblem.writeMPS`` writes."""

    _text: _ModelText | None = None

    def writeMPS(
        self, filename: str, mpsSense: int = 0, rename: int = 0, mip: int = 1, with_objsense: bool = False
    ) -> Any:
        """pulp's ``writeMPS``; with ``rename`` (as pulp's CBC runs call it) from the cached text."""
        objective = self.objective
        if (
            not rename
            or with_objsense
            or mpsSense not in (0, self.sense)
            or objective is None
            or objective.isNumericalConstant()  # pulp adds a dummy variable to it while writing
        ):
            return super().writeMPS(filename, mpsSense=mpsSense, rename=rename, mip=mip, with_objsense=with_objsense)
        text = self._text
        if (
            text is None
            or text.objective is not objective
            or text.shape != (len(self.constraints), len(self._variables))
        ):
            text = self._text = self._format(objective)
        objective.name = "OBJ"  # as pulp's writer names it
        integer = pulp.LpInteger
        parts = [f"*SENSE:{constants.LpSenses[self.sense]}\n", text.head]
        for v, lines in zip(text.variables, text.columns, strict=True):
            parts.extend((_INTORG, lines, _INTEND) if mip and v.cat == integer else (lines,))
        parts.append(text.rhs)
        parts.append("BOUNDS\n")
        names = text.variable_names
        for v in text.variables:
            parts.extend(writeMPSBoundLines(names[v.name], v, bool(mip)))
        parts.append("ENDATA\n")
        with open(filename, "w") as f:
            f.write("".join(parts))
        return text.variables, names, text.constraint_names, "OBJ"

    def _format(self, objective: pulp.LpAffineExpression) -> _ModelText:
        """Rows, columns and right-hand side as pulp's ``writeMPS(rename=1)`` writes them."""
        constraint_names, variable_names, _ = self.normalisedNames()
        variables = list(self._variables)  # normalisedNames sorted them, as pulp's writer does
        to_mps = constants.LpConstraintTypeToMps
        rows = "".join(f" {to_mps[c.sense]}  {constraint_names[k]}\n" for k, c in self.constraints.items())
        lines: dict[str, list[str]] = {v.name: [] for v in variables}
        for k, c in self.constraints.items():
            row = constraint_names[k]
            for v, value in c.items():
                lines[v.name].append(_COLUMN % (variable_names[v.name], row, value))
        for v, value in objective.items():
            lines[v.name].append(_COLUMN % (variable_names[v.name], "OBJ", value))
        rhs = "".join(
            _RHS % (constraint_names[k], -c.constant if c.constant != 0 else 0) for k, c in self.constraints.items()
        )
        return _ModelText(
            variables=variables,
            variable_names=variable_names,
            constraint_names=constraint_names,
            head=f"NAME          MODEL\nROWS\n N  OBJ\n{rows}COLUMNS\n",
            columns=["".join(lines[v.name]) for v in variables],
            rhs="RHS\n" + rhs,
            objective=objective,
            shape=(len(self.constraints), len(variables)),
        )


def cbc_command(workdir: str, **options: Any) -> pulp.PULP_CBC_CMD:
    """pulp's bundled CBC with ``options``, writing its model and solution files in ``workdir``."""
    solver = pulp.PULP_CBC_CMD(**options)
    # pulp's temporary files go to `tmpDir` (set from TMPDIR when the solver is made); `keepFiles` must stay False,
    # or pulp writes them to the current directory instead.
    solver.tmpDir = workdir
    return solver


@contextlib.contextmanager
def cbc_workspace(workdir: str | None = None) -> Iterator[str]:
    """A directory for every file of one solve, removed when the block ends (see [Note: CBC's files and
    processes]). With ``workdir`` (an enclosing solve's), that directory, left to its owner."""
    if workdir is not None:
        yield workdir
        return
    with _TerminateCleanly() as terminate:
        sweep_abandoned()
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{_machine()}_{os.getpid()}_")
        failed = True
        try:
            yield path
            failed = False
        finally:
            terminate.defer()  # a SIGTERM from here on waits for the cleanup
            if failed:
                _stop_children(path)
            shutil.rmtree(path, ignore_errors=True)


class _Terminated(BaseException):
    """SIGTERM arrived while a solve ran (re-sent once its directory is removed)."""


class _TerminateCleanly:
    """Turns SIGTERM into :class:`_Terminated` while a solve runs in the main thread and nobody else handles it;
    on exit restores the default disposition and, if SIGTERM came, sends it again."""

    def __init__(self) -> None:
        self.installed = False
        self.deferred = False
        self.received = False

    def __enter__(self) -> _TerminateCleanly:
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._handle)
            self.installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if not self.deferred:
            self.deferred = True
            raise _Terminated()

    def defer(self) -> None:
        """From now on SIGTERM is only recorded (the cleanup must not be cut short)."""
        self.deferred = True

    def __exit__(self, *exc: object) -> None:
        if not self.installed:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.received:
            os.kill(os.getpid(), signal.SIGTERM)


@functools.cache
def _machine() -> str:
    """Eight hex digits naming this boot of this machine and this PID namespace: a directory's owner PID means
    something only there."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:8]


def _cbc_processes(directory: str) -> list[int]:
    """Live processes whose command line names a file in ``directory`` (CBC's model and solution files); empty
    where there is no ``/proc``."""
    prefix = os.path.join(directory, "").encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(arg.startswith(prefix) for arg in argv):
            found.append(int(entry))
    return found


def _stop_children(directory: str) -> None:
    """Kill and reap the CBC child of this process still running on ``directory`` (an interrupted solve)."""
    for pid in _cbc_processes(directory):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue  # not our child
        if done == 0:  # ours and running: no other process can have its PID until it is reaped
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) until ``pids`` have exited (gone, or zombies awaiting their parent)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except OSError:
                break
            time.sleep(0.005)


def sweep_abandoned() -> list[str]:
    """Remove the solve directories of this machine whose owner process is gone, killing any CBC still running on
    them (see [Note: CBC's files and processes]); returns the directories removed."""
    root = tempfile.gettempdir()
    mine = f"{PREFIX}{_machine()}_"
    removed = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(mine):
                continue
            owner = entry.name[len(mine) :].split("_", 1)[0]
            if not owner.isdigit() or _alive(int(owner)) or not entry.is_dir(follow_symlinks=False):
                continue
            orphans = _cbc_processes(entry.path)
            for pid in orphans:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            _wait_gone(orphans, timeout=1.0)  # not ours to reap: wait until they write no more
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed
