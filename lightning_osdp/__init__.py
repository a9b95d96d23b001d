"""lightning_osdp: Optimal Sharded Data Parallel for PyTorch Lightning.

``import lightning_osdp`` registers the strategy name ``"osdp"`` with Lightning, so that
``Trainer(strategy="osdp")`` works. The pipeline, one stage a subpackage:
profile (measure the model) -> solve (ILP under the memory budget) -> apply (FSDP2 per module) -> checkpoint.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_osdp.apply import OSDPModule, SplitLinear, apply_plan
from lightning_osdp.budget import parse_memory_budget
from lightning_osdp.cost_model import Prediction, predict
from lightning_osdp.plan import MODES, Decision, Plan, PlanError, default_units
from lightning_osdp.profiling import ModelProfile, benchmark_collectives, profile
from lightning_osdp.solver import InfeasibleBudgetError, format_plan, minimum_budget, solve
from lightning_osdp.strategy import OSDPStrategy

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "Decision",
    "InfeasibleBudgetError",
    "ModelProfile",
    "OSDPModule",
    "OSDPStrategy",
    "Plan",
    "PlanError",
    "Prediction",
    "SplitLinear",
    "apply_plan",
    "benchmark_collectives",
    "default_units",
    "format_plan",
    "minimum_budget",
    "parse_memory_budget",
    "predict",
    "profile",
    "solve",
]

if OSDPStrategy.strategy_name not in StrategyRegistry:
    OSDPStrategy.register_strategies(StrategyRegistry)
