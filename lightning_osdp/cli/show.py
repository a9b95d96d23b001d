"""``osdp show PLAN_OR_CHECKPOINT``: a saved plan as a table, with the figures of its profile when it has one.

It reads a plan file (``osdp_plan.json``, written by the strategy in the log directory, or by ``osdp plan --out``),
a sharded checkpoint directory or a full ``.ckpt`` file (their plan and profile, through
:func:`lightning_osdp.checkpoint.saved_plan`). With a profile (``NAME.profile.json`` beside a plan file, or the one
in the checkpoint) the table shows what each unit keeps, gathers and communicates, as the cost model predicts it
for the saved world size; without one, the decisions only. ``--plot FILE.png`` draws each unit's memory,
communication and added time under each mode, the chosen one outlined (needs matplotlib:
``pip install "lightning-osdp[plot]"``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_osdp.budget import format_bytes
from lightning_osdp.checkpoint import saved_plan
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.output import Output
from lightning_osdp.cost_model import Prediction, predict
from lightning_osdp.plan import MODES, Decision, Plan
from lightning_osdp.profiling import ModelProfile
from lightning_osdp.profiling.report import print_profile
from lightning_osdp.solver import format_plan

__all__ = ["SavedPlanFile", "load", "mode_figures", "plot", "run"]

_MODE_COLOURS = {"no_shard": "#4C72B0", "shard_grad_op": "#DD8452", "full_shard": "#55A868", "hybrid_shard": "#8172B3"}


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


def mode_figures(profile: ModelProfile, plan: Plan, world_size: int) -> dict[str, Prediction]:
    """``plan`` with every decision switched to each mode (splits kept), predicted: mode -> prediction. The units
    are the plan's, so each unit's figures can be compared across modes."""
    out = {}
    for mode in MODES:
        variant = Plan({name: Decision(mode, d.split) for name, d in plan.decisions.items()})
        out[mode] = predict(profile, variant, world_size)
    return out


def plot(saved: SavedPlanFile, prediction: Prediction, world_size: int, path: str | Path) -> Path:
    """Draw each unit's memory, communication and added time under each mode, the plan's choice outlined; save
    the figure to ``path`` (PNG, SVG or PDF, by its suffix)."""
    try:
        import matplotlib
    except ImportError:
        raise CLIError(
            'osdp show --plot needs matplotlib: pip install "lightning-osdp[plot]" (or pip install matplotlib)'
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    assert saved.profile is not None
    by_mode = {
        mode: {u.name: u for u in p.units} for mode, p in mode_figures(saved.profile, saved.plan, world_size).items()
    }
    units = [u.name for u in prediction.units]
    chosen = {u.name: u.mode for u in prediction.units}
    width = 0.8 / len(MODES)
    fig, (ax_mem, ax_comm, ax_time) = plt.subplots(3, 1, figsize=(max(8.0, 0.45 * len(units) + 2), 9.5), sharex=True)
    for i, mode in enumerate(MODES):
        xs = [j + (i - (len(MODES) - 1) / 2) * width for j in range(len(units))]
        figures = [by_mode[mode].get(name) for name in units]
        kept = [u.kept.total / 2**20 if u else 0.0 for u in figures]
        # no_shard and shard_grad_op hold their gathered parameters from forward to backward, across every later
        # unit's compute: that is what full_shard saves. Its own gathers last one module's compute only.
        held = [u.gathered / 2**20 if u and mode not in ("full_shard", "hybrid_shard") else 0.0 for u in figures]
        comm = [u.time.communication * 1e3 if u else 0.0 for u in figures]
        added = [u.time.added * 1e3 if u else 0.0 for u in figures]
        lines = [1.5 if chosen[name] == mode else 0.0 for name in units]
        colour = _MODE_COLOURS[mode]
        ax_mem.bar(xs, kept, width, color=colour, edgecolor="black", linewidth=lines)
        ax_mem.bar(
            xs, held, width, bottom=kept, color=colour, alpha=0.45, hatch="//", edgecolor="black", linewidth=lines
        )
        ax_comm.bar(xs, comm, width, color=colour, edgecolor="black", linewidth=lines)
        ax_time.bar(xs, added, width, color=colour, edgecolor="black", linewidth=lines)
    ax_mem.set_ylabel("MiB per device\nkept (solid) + gathered,\nheld fwd to bwd (hatched)")
    ax_comm.set_ylabel("communication\nper step (ms)")
    ax_time.set_ylabel("added to the step (ms)\nexposed comm, copies,\noptimizer, hooks")
    ax_time.set_xticks(range(len(units)))
    recomputed = {n: d.recompute for n, d in saved.plan.decisions.items() if d.recomputes}
    labels = [
        (n or "<root>") + {"full": " (recompute)", "selective": " (selective)"}.get(recomputed.get(n, ""), "")
        for n in units
    ]
    ax_time.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    handles = [Patch(facecolor=_MODE_COLOURS[mode], label=mode) for mode in MODES]
    ax_mem.legend(handles=handles, title="mode (outlined: chosen)", fontsize=8)
    ax_mem.set_title(
        f"{saved.plan.summary()} on {world_size} ranks\npredicted peak {format_bytes(prediction.peak_bytes)} per "
        f"device, step {prediction.step_seconds * 1e3:.1f} ms",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    out.print(format_plan(saved.plan, prediction, budget=saved.budget, rich_markup=out.rich))
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
