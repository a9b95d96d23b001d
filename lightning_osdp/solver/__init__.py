"""Stage 2 of the pipeline: the ILP that chooses each planning unit's mode and split under the memory budget.

``solve(profile, budget, world_size)`` returns a :class:`~lightning_osdp.plan.Plan`; ``minimum_budget`` the
smallest budget any plan meets; ``format_plan`` prints a plan as a table. Nothing here imports Lightning.
"""

from lightning_osdp.solver.candidates import Candidates, SegmentCandidate, planning_units
from lightning_osdp.solver.ilp import InfeasibleBudgetError, PlanningProblem, SolverError, minimum_budget, solve
from lightning_osdp.solver.report import format_plan

__all__ = [
    "Candidates",
    "InfeasibleBudgetError",
    "PlanningProblem",
    "SegmentCandidate",
    "SolverError",
    "format_plan",
    "minimum_budget",
    "planning_units",
    "solve",
]
