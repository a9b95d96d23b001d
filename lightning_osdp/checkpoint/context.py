"""What a checkpoint records beside the tensors: the plan, profile, world size and budget in force."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_osdp.checkpoint.layout import Manifest
from lightning_osdp.plan import Plan

__all__ = ["CheckpointContext"]


class _Profile(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


@dataclass
class CheckpointContext:
    """The run's facts a save records, so that a resume can tell whether the saved plan still applies.

    Attributes:
        world_size: ranks of the run that saves.
        plan: the plan in force (``None`` outside OSDP).
        profile: the :class:`~lightning_osdp.profiling.ModelProfile` the plan was solved from, if any.
        memory_budget: the per-device budget (bytes) the plan was made for.
    """

    world_size: int
    plan: Plan | None = None
    profile: _Profile | None = None
    memory_budget: int | None = None

    def manifest(self, state_dict_type: str, *, optimizers: int, checkpoint: Mapping[str, Any]) -> Manifest:
        """The manifest of a checkpoint of this run (files are filled in when it is written)."""
        from lightning_osdp import __version__

        return Manifest(
            state_dict_type=state_dict_type,
            world_size=self.world_size,
            memory_budget=self.memory_budget,
            optimizers=optimizers,
            global_step=checkpoint.get("global_step"),
            epoch=checkpoint.get("epoch"),
            # str(): torch.__version__ is a TorchVersion, which `torch.load(weights_only=True)` refuses to unpickle.
            versions={"torch": str(torch.__version__), "lightning_osdp": str(__version__)},
        )

    def full_entry(self, *, optimizers: int, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """The ``"osdp"`` entry of a full checkpoint file: the manifest with the plan and profile inlined."""
        entry = self.manifest("full", optimizers=optimizers, checkpoint=checkpoint).to_dict()
        entry["plan"] = self.plan.to_dict() if self.plan is not None else None
        entry["profile"] = self.profile.to_dict() if self.profile is not None else None
        return entry
