"""Stage 3 of the pipeline: apply a plan to a model (operator splitting, then FSDP2 per sharded unit and DDP for
the replicated rest)."""

from lightning_osdp.apply.buffers import BufferBroadcast
from lightning_osdp.apply.clip import clip_grad_norm_
from lightning_osdp.apply.executor import (
    OSDPModule,
    ReplicatedModule,
    Unit,
    applied_root,
    apply_plan,
    no_gradient_sync,
    plan_units,
)
from lightning_osdp.apply.recompute import (
    SAVED_OPERATORS,
    is_recomputed,
    recomputation_of,
    recompute_modules,
    selective_contexts,
    selective_policy,
)
from lightning_osdp.apply.split import SplitLinear, split_linear

__all__ = [
    "SAVED_OPERATORS",
    "BufferBroadcast",
    "OSDPModule",
    "ReplicatedModule",
    "SplitLinear",
    "Unit",
    "applied_root",
    "apply_plan",
    "clip_grad_norm_",
    "is_recomputed",
    "no_gradient_sync",
    "plan_units",
    "recomputation_of",
    "recompute_modules",
    "selective_contexts",
    "selective_policy",
    "split_linear",
]
