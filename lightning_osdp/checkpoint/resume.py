"""Which plan a resumed run takes: the saved one when nothing it was made for has changed, a new one otherwise.

A plan is solved for a world size and a per-device memory budget from a profile of the model. When a run resumes
with the same world size and budget, the saved plan (and profile) still hold: reusing them skips profiling and
solving, and keeps the placements the optimizer state was saved under. When either changed, the saved plan may not
fit or may waste memory, so the strategy plans again; the checkpoint loads under the new plan all the same (its keys
do not depend on the plan).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_osdp.checkpoint import layout
from lightning_osdp.checkpoint.errors import CheckpointError
from lightning_osdp.plan import Plan

__all__ = ["PlanChoice", "SavedPlan", "resume_plan", "saved_plan"]


@dataclass
class SavedPlan:
    """The plan a checkpoint was saved under, and what it was made for.

    Attributes:
        plan: the plan.
        profile: the model profile's JSON document (``ModelProfile.from_dict`` reads it), or ``None``.
        world_size: ranks of the saving run.
        memory_budget: per-device budget in bytes the saving run planned for, or ``None`` if unknown.
        source: the checkpoint path.
    """

    plan: Plan
    profile: dict[str, Any] | None
    world_size: int
    memory_budget: int | None
    source: str


@dataclass(frozen=True)
class PlanChoice:
    """What :func:`resume_plan` decided: the plan to reuse (``None``: plan again) and the reason, for the log."""

    plan: Plan | None
    profile: dict[str, Any] | None
    reason: str

    @property
    def reuse(self) -> bool:
        return self.plan is not None


def saved_plan(path: str | os.PathLike[str]) -> SavedPlan | None:
    """The plan saved in checkpoint ``path`` (a sharded directory or a full file), or ``None`` if it has none
    (a checkpoint of another strategy). Cheap: reads the manifest and plan files, or only the ``"osdp"`` entry of a
    full file (memory-mapped, tensors untouched). No collective; call it on every rank or broadcast the result.

    Raises:
        IncompleteCheckpointError: a directory whose save did not complete.
    """
    path = Path(path)
    if not path.exists():
        raise layout.missing_checkpoint_error(path)
    if path.is_dir():
        manifest = layout.read_manifest(path)
        if manifest.plan is None:
            return None
        profile = json.loads((path / manifest.profile).read_text()) if manifest.profile else None
        return SavedPlan(
            Plan.load(path / manifest.plan), profile, manifest.world_size, manifest.memory_budget, str(path)
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # a truncated or foreign file: say which
        raise CheckpointError(f"cannot read checkpoint file {str(path)!r}: {err}") from err
    entry = checkpoint.get("osdp") if isinstance(checkpoint, dict) else None
    if not entry or not entry.get("plan"):
        return None
    return SavedPlan(
        Plan.from_dict(entry["plan"], source=f"{path}['osdp']['plan']"),
        entry.get("profile"),
        int(entry.get("world_size", 0)),
        entry.get("memory_budget"),
        str(path),
    )


def resume_plan(saved: SavedPlan | None, *, world_size: int, memory_budget: int | None) -> PlanChoice:
    """Reuse ``saved`` if it was made for this world size and budget, else say why the strategy must plan again.

    The returned ``reason`` is meant for the log, e.g. ``"reusing the plan saved in ckpt/last.ckpt (same 2 ranks
    and 6.0 GiB budget): no profiling"``.
    """
    from lightning_osdp.budget import format_bytes

    if saved is None:
        return PlanChoice(None, None, "the checkpoint holds no OSDP plan: planning")
    if saved.world_size != world_size:
        return PlanChoice(
            None,
            None,
            f"re-planning: the checkpoint {saved.source} was saved on {saved.world_size} ranks, this run has "
            f"{world_size} (its keys load under any plan)",
        )
    if saved.memory_budget != memory_budget:
        before = format_bytes(saved.memory_budget) if saved.memory_budget is not None else "unknown"
        now = format_bytes(memory_budget) if memory_budget is not None else "unknown"
        return PlanChoice(
            None,
            None,
            f"re-planning: the memory budget changed from {before} (checkpoint {saved.source}) to {now} per device",
        )
    budget = format_bytes(memory_budget) if memory_budget is not None else "unknown"
    return PlanChoice(
        saved.plan,
        saved.profile,
        f"reusing the plan saved in {saved.source} (same {world_size} ranks and {budget} budget per device): "
        "no profiling or solving",
    )
