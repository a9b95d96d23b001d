"""HiGHS in process, through pulp: the one MILP solver every phase of the solve runs on (``ilp.py``), with the
objective's constant as its offset, its node limits read, its banner kept out of the process's output and the solve's
wall-clock safety net.

[Note: the MILP solver]
Every phase runs on HiGHS, in process, through pulp's ``HiGHS`` interface (the ``highspy`` package): pulp stays the
modelling layer, the rows are built once, in ``ilp.py``'s ``PlanningProblem._formulate``, and each phase changes bounds
or categories and solves again. pulp leaves the objective's constant (the compute every plan pays) out of the model it
hands the solver: HiGHS is given it as its objective offset (``HiGHS``), so that its gap, dual bound and cutoff
(``objective_bound``) are of the whole step time. Until 0.1.x CBC, pulp's bundled binary run as a subprocess on files,
was the default; it needed a directory per solve, its cleanup on ``SIGTERM`` and after a kill, a cached MPS writer, its
log read back for the bound and an absolute gap for the constant it did not see. With the same phases neither solver was
faster at every budget (``docs/benchmarks.md``, "Planning speed"), so the one in process stayed. ``solver="cbc"`` still
plans, on HiGHS, with a ``FutureWarning`` (``ilp.check_solver``).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, cast

import pulp

__all__ = ["Clock", "HiGHS", "SolveResult", "SolverError", "relative_gap", "run_mip"]


class SolverError(RuntimeError):
    """The ILP's solver (HiGHS) found no plan within its limits."""


class Clock:
    """The solve's wall-clock safety net (see ``ilp.py``'s [Note: work limits]): each HiGHS run may take ``time_limit``
    seconds, the whole solve :data:`RUNS` times that; :attr:`hit` says whether either limit was reached (a run stopped
    by it, or a phase not started for it)."""

    def __init__(self, time_limit: float, started: float | None = None) -> None:
        self.time_limit = time_limit
        self.deadline = (time.perf_counter() if started is None else started) + RUNS * time_limit
        self.hit = False

    def left(self) -> float:
        """Seconds the next run may take: ``time_limit``, or what is left of the solve's (negative once past it)."""
        return min(self.time_limit, self.deadline - time.perf_counter())

    def expired(self) -> bool:
        """Whether the solve's limit is past; once it is, :attr:`hit` is set."""
        if self.deadline - time.perf_counter() <= 0:
            self.hit = True
        return self.hit


@dataclass(frozen=True)
class SolveResult:
    """How a solve (or one branch and bound run) ended; ``bound`` names what proves the gap (see [Note: solving]).

    ``lower`` is the lower bound the run proved (``None``: none), ``complete`` whether it searched to the end (no
    limit stopped it): only a complete run that finds nothing under a cutoff proves that no plan is under it.
    ``stopped`` names the limit that stopped an incomplete run: ``"work limit"`` (its nodes) or ``"time limit"``
    (the safety net; see ``ilp.py``'s [Note: work limits])."""

    status: str
    gap: float | None
    seconds: float
    objective: float
    bound: str = "branch and bound"
    lower: float | None = None
    complete: bool = True
    stopped: str | None = None


def relative_gap(value: float, lower: float) -> float:
    return max((value - lower) / max(abs(value), 1e-12), 0.0)


#: The safety net of a whole solve, in time limits (of one run each; see ``ilp.py``'s [Note: work limits]).
RUNS = 3

#: The shortest time limit HiGHS is given for the LP relaxation (a time limit of 0 is refused).
MIN_SECONDS = 1e-3


@functools.cache
def _without_banner() -> None:
    """Make the process's first HiGHS object with the C library's standard output sent nowhere: HiGHS prints its
    banner ("Running HiGHS ...") there when the first one is made, before any option (pulp's ``msg=False``) can say
    otherwise, into the middle of a run's log or ``osdp plan``'s report; later objects print none."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class HiGHS(pulp.HiGHS):
    """pulp's in-process HiGHS, given the objective's constant as HiGHS's offset (pulp leaves it out): HiGHS's
    relative gap, bound and cutoff are then of the whole predicted step time, as the solve's gap is."""

    def createAndConfigureSolver(self, lp: pulp.LpProblem) -> None:
        _without_banner()
        super().createAndConfigureSolver(lp)

    def buildSolverModel(self, lp: pulp.LpProblem) -> None:
        super().buildSolverModel(lp)
        constant = lp.objective.constant if lp.objective is not None else 0.0
        if constant:
            lp.solverModel.changeObjectiveOffset(float(constant))

    def findSolutionValues(self, lp: pulp.LpProblem) -> tuple[int, int]:
        """pulp's reading of the solution, and of HiGHS's node and leaf limits, which pulp does not map (its
        lookup fails after the values are assigned): read as it reads the time limit. The solve's own status is
        read from HiGHS (:func:`run_mip`), not from pulp's."""
        import highspy

        try:
            return cast(tuple[int, int], super().findSolutionValues(lp))
        except KeyError:
            if lp.solverModel.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
                raise
            if lp.solverModel.getInfo().primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible:
                return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


def run_mip(
    prob: pulp.LpProblem,
    read: Callable[[], dict[Hashable, Hashable]],
    *,
    gap: float,
    clock: Clock,
    nodes: int,
    cutoff: float | None = None,
    seconds: float = 0.0,
    first: bool = False,
) -> tuple[dict[Hashable, Hashable] | None, SolveResult]:
    """Branch and bound on HiGHS, in process, for at most ``nodes`` nodes, stopped by the safety net ``clock`` (or after
    ``seconds``, if longer; see ``ilp.py``'s [Note: work limits]); with ``cutoff`` (of the whole objective) only better
    plans are searched, and a search under it that finds nothing proves the cutoff a lower bound (``lower``); ``first``
    stops at the first plan found under it; ``read`` gives the plan of the solution pulp holds. The status, the dual
    bound and whether the search ran to its end are read from HiGHS itself (pulp reads every limit as "Optimal"). Raises
    :class:`SolverError` when no plan was found and the search did not end."""
    import highspy

    time_limit = max(clock.left(), seconds)
    if time_limit <= 0:
        clock.hit = True
        raise SolverError("the ILP solver (HiGHS) was not run: the solve's time limit is past")
    options: dict[str, Any] = {}
    if cutoff is not None:
        options["objective_bound"] = float(cutoff)  # HiGHS prunes every node at or above it
        if first:
            options["mip_max_improving_sols"] = 1
    solver = HiGHS(msg=False, gapRel=gap, timeLimit=time_limit, mip_max_nodes=nodes, **options)
    started = time.perf_counter()
    prob.solve(solver)
    elapsed = time.perf_counter() - started
    highs = prob.solverModel
    model_status = highs.getModelStatus()
    info = highs.getInfo()
    statuses = highspy.HighsModelStatus
    # Only these end a search: every other status (a limit, an interrupt) stops it on the way.
    complete = model_status in (statuses.kOptimal, statuses.kInfeasible, statuses.kUnboundedOrInfeasible)
    stopped = None if complete else "time limit" if model_status == statuses.kTimeLimit else "work limit"
    if stopped == "time limit":
        clock.hit = True
    if model_status in (statuses.kInfeasible, statuses.kUnboundedOrInfeasible):
        return None, SolveResult("infeasible", None, elapsed, math.nan, lower=cutoff, complete=True)
    if info.primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        limit = f"{time_limit:g} s" if stopped == "time limit" else f"{nodes} nodes"
        raise SolverError(
            f"the ILP solver (HiGHS) found no plan within {limit} (status {highs.modelStatusToString(model_status)}); "
            "raise solver_time_limit or restrict the options (modes, max_split)"
        )
    value, lower = float(info.objective_function_value), float(info.mip_dual_bound)
    achieved = relative_gap(value, lower)
    if stopped is not None:
        status = stopped
    elif achieved > 1e-9:
        status = f"within gap {gap:g}"
    else:
        status = "optimal"
    bound = lower if math.isfinite(lower) else None
    if cutoff is not None and bound is not None:
        # HiGHS's dual bound is of the plans under the cutoff only: those at or above it it never looked at, and
        # its bound can exceed the cutoff (and the incumbent). Every plan is at least the smaller of the two.
        bound = min(bound, float(cutoff))
    return read(), SolveResult(status, achieved, elapsed, value, lower=bound, complete=complete, stopped=stopped)
