"""Which plan a resumed run takes: the saved one when nothing it was made for has changed, a new one otherwise.

A plan is solved for a world size and a per-device memory budget from a profile of the model. When a run resumes
with the same world size and budget, the saved plan (and profile) still hold: reusing them skips profiling and
solving, and keeps the placements the optimizer state was saved under. When either changed, the saved plan may not
fit or may waste memory, so the strategy plans again; the checkpoint loads under the new plan all the same (its keys
do not depend on the plan).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_osdp.apply.state_dict import SliceMap
from lightning_osdp.checkpoint import layout
from lightning_osdp.checkpoint.errors import CheckpointMismatchError
from lightning_osdp.checkpoint.files import CheckpointDirectory, read_retrying
from lightning_osdp.checkpoint.keys import check_model_keys
from lightning_osdp.checkpoint.sharded import saved_model_shapes
from lightning_osdp.checkpoint.unpickle import SkimmedTensor, skim
from lightning_osdp.plan import Plan, PlanError

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
        shapes: the checkpoint's model keys (the unsplit model's names) -> shapes, when known: what the plan was
            made for, compared with the model before the plan is reused.
    """

    plan: Plan
    profile: dict[str, Any] | None
    world_size: int
    memory_budget: int | None
    source: str
    shapes: dict[str, tuple[int, ...]] | None = None


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
    (a checkpoint of another strategy). Cheap, and runs no code from the checkpoint: reads the manifest, the plan and
    profile files and DCP's index (each checked against its checksum, all of one save, none through a link: see
    ``files``), or only the pickle of a full file, skimmed
    (see ``unpickle``'s [Note: pickles in a checkpoint]: the plan comes out whatever else the file holds, tensors
    untouched). No collective; call it on every rank or broadcast the result.

    Raises:
        CheckpointError: a directory whose save did not complete, a file that changed since, a manifest or
            ``"osdp"`` entry that is not what a save writes.
    """
    path = Path(path)
    if not path.exists():
        raise layout.missing_checkpoint_error(path)
    if path.is_dir():
        return read_retrying(lambda: _saved_in_directory(path))
    content = skim(path)
    entry = content.get("osdp") if isinstance(content, dict) else None
    if not isinstance(entry, dict) or not entry.get("plan"):
        return None
    source = f"{path}['osdp']"
    manifest = layout.Manifest.from_dict(entry, source, directory=False)
    state = content.get("state_dict")
    shapes = (
        {k: v.shape for k, v in state.items() if isinstance(k, str) and isinstance(v, SkimmedTensor)}
        if isinstance(state, dict)
        else None
    )
    return SavedPlan(
        Plan.from_dict(entry["plan"], source=f"{source}['plan']"),
        entry.get("profile"),
        manifest.world_size,
        manifest.memory_budget,
        str(path),
        shapes or None,
    )


def _saved_in_directory(path: Path) -> SavedPlan | None:
    with CheckpointDirectory(path) as directory:
        manifest = layout.read_manifest(directory)
        if manifest.plan is None:
            return None
        plan, profile = (
            directory.json(name, size=manifest.files.get(name), checksum=manifest.checksums.get(name)) if name else None
            for name in (manifest.plan, manifest.profile)
        )
        shapes = saved_model_shapes(directory, manifest)
    if not isinstance(plan, dict):
        raise PlanError(f"{path / manifest.plan}: a plan must be a JSON object, got {type(plan).__name__}")
    return SavedPlan(
        Plan.from_dict(plan, source=str(path / manifest.plan)),
        profile,
        manifest.world_size,
        manifest.memory_budget,
        str(path),
        shapes,
    )


def resume_plan(
    saved: SavedPlan | None, *, world_size: int, memory_budget: int | None, module: nn.Module | None = None
) -> PlanChoice:
    """Reuse ``saved`` if it was made for this world size, budget and model, else say why the strategy must plan
    again.

    The returned ``reason`` is meant for the log, e.g. ``"reusing the plan saved in ckpt/last.ckpt (same 2 ranks
    and 6.0 GiB budget): no profiling"``.

    Args:
        module: the model about to be trained (unsharded). Given, the checkpoint's model keys and shapes are compared
            with it first, and a plan that does not fit it is not reused.

    Raises:
        CheckpointMismatchError: the checkpoint is of another model (its keys or shapes differ from ``module``'s), so
            the load would fail after profiling and solving: it fails now, naming the keys.
    """
    from lightning_osdp.budget import format_bytes

    if saved is None:
        return PlanChoice(None, None, "the checkpoint holds no OSDP plan: planning")
    if module is not None:
        unfit = _does_not_fit(saved, module)
        if unfit is not None:
            return PlanChoice(
                None, None, f"re-planning: the plan saved in {saved.source} does not fit this model ({unfit})"
            )
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
    budget = format_bytes(memory_budget) if memory_budget is not None else "the default"
    return PlanChoice(
        saved.plan,
        saved.profile,
        f"reusing the plan saved in {saved.source} (same {world_size} ranks and {budget} budget per device): "
        "no profiling or solving",
    )


def _does_not_fit(saved: SavedPlan, module: nn.Module) -> str | None:
    """Why ``saved.plan`` cannot be applied to ``module`` (``None``: it can). A checkpoint whose model keys or
    shapes differ from the module's raises: it will not load either."""
    if saved.shapes is not None:
        slices = SliceMap.of(module)
        live = {k: v.shape for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
        expected = slices.canonical_shapes(live)
        try:
            check_model_keys(
                expected, saved.shapes, strict=bool(getattr(module, "strict_loading", True)), source=repr(saved.source)
            )
        except CheckpointMismatchError as err:
            raise CheckpointMismatchError(f"{err} (found before planning, from the checkpoint's index)") from None
    try:
        saved.plan.validate(module)
    except PlanError as err:
        return str(err)
    return None
