"""Stage 2 of the pipeline: the ILP that chooses each planning unit's mode and split under the memory budget.

``plan_model(profile, memory_budget, world_size, headroom=...)`` is the planning policy that the strategy and
``osdp plan`` share (``policy.py``); ``solve(profile, budget, world_size)`` returns the fastest
:class:`~lightning_osdp.plan.Plan` under exactly ``budget``; ``minimum_budget`` the smallest budget any plan meets
(``minimum_plan``: and that plan); ``format_plan`` prints a plan as a table. Nothing here imports Lightning.
"""

from lightning_osdp.solver.candidates import Candidates, SegmentCandidate, planning_units
from lightning_osdp.solver.ilp import (
    InfeasibleBudgetError,
    PlanningProblem,
    SolverError,
    minimum_budget,
    minimum_plan,
    solve,
)
from lightning_osdp.solver.policy import (
    DEFAULT_MEMORY_HEADROOM,
    plan_model,
    planned_budget,
    smallest_memory_budget,
    smallest_memory_plan,
)
from lightning_osdp.solver.report import format_plan

__all__ = [
    "DEFAULT_MEMORY_HEADROOM",
    "Candidates",
    "InfeasibleBudgetError",
    "PlanningProblem",
    "SegmentCandidate",
    "SolverError",
    "format_plan",
    "minimum_budget",
    "minimum_plan",
    "plan_model",
    "planned_budget",
    "planning_units",
    "smallest_memory_budget",
    "smallest_memory_plan",
    "solve",
]
