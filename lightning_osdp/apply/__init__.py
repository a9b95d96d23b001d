"""Stage 3 of the pipeline: apply a plan to a model (operator splitting, then FSDP2 per unit)."""

from lightning_osdp.apply.executor import (
    OSDPModule,
    ReplicatedModule,
    Unit,
    apply_plan,
    plan_units,
)
from lightning_osdp.apply.split import SplitLinear, split_linear

__all__ = [
    "OSDPModule",
    "ReplicatedModule",
    "SplitLinear",
    "Unit",
    "apply_plan",
    "plan_units",
    "split_linear",
]
