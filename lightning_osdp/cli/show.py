"""``osdp show PLAN_OR_CHECKPOINT``: a saved plan as a table, with the figures of its profile when it has one.

It reads a plan file (``osdp_plan.json``, written by the strategy in the log directory, or by ``osdp plan --out``),
a sharded checkpoint directory or a full ``.ckpt`` file (their plan and profile, through
:func:`lightning_osdp.checkpoint.saved_plan`). With a profile (``NAME.profile.json`` beside a plan file, or the one
in the checkpoint) the table shows what each unit keeps, gathers and communicates, as the cost model predicts it
for the saved world size; without one, the decisions only. ``--plot FILE.png`` draws the plan's predicted memory over
the step beside FSDP's, and the plan folded by identical blocks (``plot.py``; needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_osdp.budget import format_bytes
from lightning_osdp.checkpoint import saved_plan
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.output import Output
from lightning_osdp.cost_model import Prediction, predict
from lightning_osdp.plan import Plan
from lightning_osdp.profiling import ModelProfile
from lightning_osdp.profiling.report import print_profile
from lightning_osdp.solver import format_plan

__all__ = ["SavedPlanFile", "load", "plot", "run"]


@dataclass
class SavedPlanFile:
    """A plan as read from disk, with what it was made for.

    Attributes:
        plan: the plan.
        profile: its profile, if one was saved with it.
        world_size: ranks it was made for (0: unknown).
        budget: per-device budget it was solved for, if known.
        source: what was read.
    """

    plan: Plan
    profile: ModelProfile | None
    world_size: int
    budget: int | None
    source: str


def load(path: str | Path) -> SavedPlanFile:
    """Read a plan file, a sharded checkpoint directory or a full checkpoint file."""
    path = Path(path)
    if not path.exists():
        raise CLIError(f"{str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".json":
        plan = Plan.load(path)
        beside = path.with_name(path.stem + ".profile.json")
        profile = _read_profile(ModelProfile.load, beside) if beside.is_file() else None
        report = plan.report
        world_size = report.world_size if report is not None else (profile.world_size if profile else 0)
        return SavedPlanFile(plan, profile, world_size, report.requested_budget_bytes if report else None, str(path))
    saved = saved_plan(path)
    if saved is None:
        raise CLIError(f"{str(path)!r} holds no OSDP plan (a checkpoint saved by another strategy?)")
    profile = _read_profile(ModelProfile.from_dict, saved.profile) if saved.profile else None
    budget = saved.memory_budget
    if budget is None and saved.plan.report is not None:
        budget = saved.plan.report.requested_budget_bytes
    return SavedPlanFile(saved.plan, profile, saved.world_size, budget, saved.source)


def _read_profile(reader: Any, source: Any) -> ModelProfile:
    try:
        profile: ModelProfile = reader(source)
    except (ValueError, KeyError, TypeError) as err:
        raise CLIError(f"the saved profile cannot be read: {err}") from None
    return profile


def _header(saved: SavedPlanFile, world_size: int) -> list[str]:
    info = saved.plan.info  # provenance: where the plan came from, a dry run's settings
    lines = [f"{saved.source}: {saved.plan.summary()}"]
    made = [f"source {info.get('source', '?')}"]
    if world_size:
        made.append(f"{world_size} ranks")
    if saved.budget:
        made.append(f"budget {format_bytes(saved.budget)} per device")
    if saved.plan.report is not None:
        made.append(f"solver {saved.plan.report.status}")
    lines.append("  " + ", ".join(made))
    dry = info.get("dry_run")
    if isinstance(dry, dict):
        lines.append(
            f"  dry run of {dry.get('model')} on {dry.get('hardware')}, batch {dry.get('batch_size')} per device, "
            f"precision {dry.get('precision')}"
        )
    if saved.profile is not None:
        p = saved.profile
        batch = ", ".join(f"{t['dtype']}{t['shape']}" for t in p.batch.get("tensors", [])) or "?"
        lines.append(f"  profile: {p.mode} on {p.device}, batch {batch}, optimizer {p.optimizer or 'none'}")
    return lines


def _decisions_only(saved: SavedPlanFile, out: Output) -> None:
    rows = [[name or "<root>", d.mode, str(d.split)] for name, d in saved.plan]
    report = saved.plan.report
    notes = ["No profile was saved with this plan: the memory and time of each unit need one."]
    if report is not None:
        notes.append(
            f"Predicted when it was solved: peak {format_bytes(report.predicted_peak_bytes)} per device, step "
            f"{report.predicted_step_seconds * 1e3:.1f} ms."
        )
    out.table(f"OSDP plan: {saved.plan.summary()}", ["module", "mode", "split"], rows, right=[2], notes=notes)


def plot(saved: SavedPlanFile, prediction: Prediction, world_size: int, path: str | Path) -> Path:
    """Draw the plan's predicted memory over the step beside FSDP's over its units, and the plan folded by identical
    blocks (``lightning_osdp/cli/plot.py``); save the figure to ``path`` (PNG, SVG or PDF, by its suffix)."""
    from lightning_osdp.cli.hardware import get_hardware
    from lightning_osdp.cli.plot import PlotSide, fsdp_sides, plot_plan

    profile = saved.profile
    assert profile is not None
    sides = [
        PlotSide("saved plan", saved.plan, prediction),
        *fsdp_sides(saved.plan, lambda p: predict(profile, p, world_size)),
    ]
    dry = saved.plan.info.get("dry_run")
    capacity = None
    if isinstance(dry, dict) and dry.get("hardware"):
        with contextlib.suppress(CLIError):  # figures from a file (--hardware-profile): no device memory known here
            capacity = get_hardware(str(dry["hardware"])).memory_bytes
    title = f"{saved.source}: {saved.plan.summary()} on {world_size} ranks"
    return plot_plan(path, sides, budget=saved.budget, capacity=capacity, title=title)


def run(args: argparse.Namespace, out: Output) -> int:
    """Run ``osdp show``; returns the exit status."""
    saved = load(args.path)
    world_size = args.world_size or saved.world_size or (saved.profile.world_size if saved.profile else 0) or 1
    for line in _header(saved, world_size):
        out.print(line)
    out.print("")
    if saved.profile is None:
        if args.plot:
            raise CLIError(f"--plot needs the plan's profile, and {saved.source} has none beside it")
        _decisions_only(saved, out)
        return 0
    prediction = predict(saved.profile, saved.plan, world_size)
    out.print(
        format_plan(
            saved.plan, prediction, budget=saved.budget, rich_markup=out.rich, fold=not args.all_units, legend=True
        )
    )
    if args.profile:
        out.print("")
        if out.rich:
            from rich.console import Console

            print_profile(saved.profile, max_depth=args.depth, console=Console(file=out.stdout, force_terminal=True))
        else:
            from lightning_osdp.profiling import format_profile

            out.print(format_profile(saved.profile, max_depth=args.depth))
    if args.plot:
        with out.step(f"drawing {args.plot}"):
            written = plot(saved, prediction, world_size, args.plot)
        out.print(f"\nwrote {written}")
    return 0
