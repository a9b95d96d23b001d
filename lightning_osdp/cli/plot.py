"""``osdp plan --plot`` and ``osdp show --plot``: a plan's predicted memory over the step beside FSDP's, and the plan.

The figure has a fixed size whatever the model (a 126-block model draws as readably as a 4-block one):

* top, one panel per plan (the chosen plan, then FSDP: every block ``full_shard``, nothing recomputed), the memory the
  cost model predicts on rank 0 at each instant of one training step, stacked by category (parameters, gradients,
  optimizer state, activations, gathered parameters, communication buffers), over bands for the phases (forward, loss,
  backward, optimizer step), with the budget and the device's memory as horizontal lines and the peak marked. The
  instants are those :func:`~lightning_osdp.cost_model.predict` takes the peak of
  (:meth:`~lightning_osdp.cost_model.Prediction.memory_timeline`), so the drawing is the prediction, not a second
  model of it; the x axis counts instants (a block is a few of them), not seconds;
* bottom, the plan in forward order: one strip of units coloured by mode (hatched when recomputed), and the units
  folded into runs of identical blocks (``model.layers.0-114 x115 full_shard, recompute full``).

matplotlib is an optional dependency (the ``plot`` extra; the ``dev`` extra that ``scripts/setup.sh`` installs has
it): the error without it names the command that adds it. The figure is drawn with the Agg backend (files only).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_osdp.budget import format_bytes
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cost_model import CATEGORIES, MemoryInstant, Prediction
from lightning_osdp.cost_model.timeline import PHASES
from lightning_osdp.grouping import ROOT, covering_decision
from lightning_osdp.plan import Decision, Plan, Recomputation

if TYPE_CHECKING:
    from lightning_osdp.cli.plan import DryRun, StrategyFigures

__all__ = ["PlanRun", "PlotSide", "fold_plan", "fsdp_plan", "fsdp_sides", "plot_dry_run", "plot_plan"]

#: Figure size in inches, and its resolution: 1,680 x 1,080 pixels for every model.
FIGSIZE = (14.0, 9.0)
DPI = 120

_MODE_COLOURS = {"no_shard": "#4C72B0", "shard_grad_op": "#DD8452", "full_shard": "#55A868", "hybrid_shard": "#8172B3"}
_RECOMPUTE_HATCH = {"none": "", "full": "////", "selective": ".."}
_CATEGORY_COLOURS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_states": "#8C8C8C",
    "activations": "#C44E52",
    "gathered_parameters": "#55A868",
    "communication_buffers": "#CCB974",
}
_PHASE_SHADES = {"forward": "#F2F2F2", "loss": "#FFF2CC", "backward": "#E8EEF7", "optimizer": "#F4E6F4"}
#: Lines of runs under the strip per column, and the longest line that still fits in half the width (at 7.5 pt).
_RUN_ROWS = 13
_COLUMN_CHARS = 110


@dataclass(frozen=True)
class PlotSide:
    """One panel of the memory comparison: a plan, its name and its prediction."""

    name: str
    plan: Plan
    prediction: Prediction


@dataclass(frozen=True)
class PlanRun:
    """Consecutive units of a plan with the same decision (and the same decisions inside them).

    Attributes:
        first, last: the first and last unit's names (the same for a run of one).
        count: units in the run.
        decision: their decision.
        inner: the decisions nested in each of them, by name relative to the unit (``feed_forward.w1``).
    """

    first: str
    last: str
    count: int
    decision: Decision
    inner: tuple[tuple[str, Decision], ...] = ()

    @property
    def label(self) -> str:
        """``model.layers.0-114 x115  full_shard, recompute full`` (inner decisions after a ``|``)."""
        name = self.first or "<root>"
        if self.count > 1:
            name = f"{self.first}-{_index(self.last)[1]} x{self.count}"
        return f"{name}  {_describe(self.decision)}" + "".join(f"; {names} {how}" for names, how in _inner(self.inner))


def _describe(d: Decision) -> str:
    parts = [d.mode]
    if d.split > 1:
        parts.append(f"split {d.split}")
    if d.recomputes:
        parts.append(f"recompute {d.recompute}")
    return ", ".join(parts)


def _inner(inner: Sequence[tuple[str, Decision]]) -> list[tuple[str, str]]:
    """Nested decisions grouped by what they decide: ``[("feed_forward.{w1,w2,w3}", "full_shard")]``."""
    by_how: dict[str, list[str]] = {}
    for rel, d in inner:
        by_how.setdefault(_describe(d), []).append(rel)
    out: list[tuple[str, str]] = []
    for how, names in by_how.items():
        parents: dict[str, list[str]] = {}
        for n in names:
            parent, _, leaf = n.rpartition(".")
            parents.setdefault(parent, []).append(leaf)
        spelled = [
            (f"{parent}." if parent else "") + (leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}")
            for parent, leaves in parents.items()
        ]
        out.append((" ".join(spelled), how))
    return out


def _index(name: str) -> tuple[str, int | None]:
    """``("model.layers.", 12)`` for ``model.layers.12``; ``(name, None)`` for a name not ending in an index."""
    match = re.fullmatch(r"(.*\.)(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else (name, None)


def fold_plan(plan: Plan, order: Sequence[str]) -> list[PlanRun]:
    """``plan``'s top-level units (those no decided module but the root encloses) in ``order`` (module names in
    forward order; units not in it come last), folded into runs of consecutive blocks (``prefix.i``, ``prefix.i+1``,
    ...) with equal decisions, nested decisions included."""
    tops = [n for n in plan.decisions if n == ROOT or covering_decision(plan.decisions, _parent(n)) == ROOT]
    rank = {name: i for i, name in enumerate(order)}
    tops.sort(key=lambda n: (rank.get(n, len(rank)), n))
    runs: list[PlanRun] = []
    for top in tops:
        inner = tuple(
            sorted(
                (n[len(top) + 1 :], d)
                for n, d in plan.decisions.items()
                if top != ROOT and n.startswith(top + ".") and n != top
            )
        )
        decision = plan.decisions[top]
        if runs:
            prev = runs[-1]
            prefix, index = _index(top)
            last_prefix, last_index = _index(prev.last)
            if (
                index is not None
                and last_index is not None
                and prefix == last_prefix
                and index == last_index + 1
                and (prev.decision, prev.inner) == (decision, inner)
            ):
                runs[-1] = PlanRun(prev.first, top, prev.count + 1, decision, inner)
                continue
        runs.append(PlanRun(top, top, 1, decision, inner))
    return runs


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def fsdp_plan(plan: Plan, recompute: Recomputation = "none") -> Plan:
    """FSDP over ``plan``'s top-level units: each ``full_shard``, unsplit, recomputed as ``recompute`` says (the root
    never is), nested decisions dropped. For a plan over a model's blocks this is
    ``Plan.uniform(model, "full_shard", recompute=recompute)``, which ``osdp plan`` compares."""
    tops = [n for n in plan.decisions if n == ROOT or covering_decision(plan.decisions, _parent(n)) == ROOT]
    fsdp = Plan({name: Decision("full_shard", recompute="none" if name == ROOT else recompute) for name in tops})
    fsdp.info["source"] = f"uniform full_shard{'' if recompute == 'none' else ' +' + recompute} (FSDP)"
    return fsdp


def _recomputation(plan: Plan) -> Recomputation:
    """How most of ``plan``'s recomputed units recompute (``"none"`` when none does)."""
    counts = Counter(d.recompute for d in plan.decisions.values() if d.recomputes)
    return counts.most_common(1)[0][0] if counts else "none"


def _uniform(plan: Plan) -> tuple[str, Recomputation] | None:
    """``(mode, recompute)`` of a plan whose units all have one mode and whose units but the root recompute alike."""
    modes = {d.mode for d in plan.decisions.values()}
    recomputes = {d.recompute for name, d in plan.decisions.items() if name != ROOT}
    if len(modes) != 1 or len(recomputes) > 1:
        return None
    return modes.pop(), recomputes.pop() if recomputes else "none"


def fsdp_sides(plan: Plan, predict_plan: Callable[[Plan], Prediction]) -> list[PlotSide]:
    """The FSDP panels ``plan`` is drawn beside: FSDP over its units (:func:`fsdp_plan`) and, when ``plan`` recomputes,
    FSDP with every block recomputed as most of its recomputed units are (``FSDP+AC`` or ``FSDP+SAC``)."""
    sides = [PlotSide("FSDP", fsdp := fsdp_plan(plan), predict_plan(fsdp))]
    how = _recomputation(plan)
    if how != "none":
        recomputed = fsdp_plan(plan, how)
        sides.append(PlotSide(_FSDP_NAMES[how], recomputed, predict_plan(recomputed)))
    return sides


_FSDP_NAMES = {"full": "FSDP+AC", "selective": "FSDP+SAC"}


def plot_dry_run(path: str | Path, run: DryRun, rows: Sequence[StrategyFigures]) -> Path:
    """``osdp plan --plot``: the OSDP row (``rows[0]``) beside the uniform FSDP rows :func:`fsdp_sides` would draw
    (taken from ``rows``, which predicted them), under the budget and the device's memory."""
    chosen = rows[0]
    how = _recomputation(chosen.plan)
    wanted = [("full_shard", "none")] + ([("full_shard", how)] if how != "none" else [])
    baselines = {_uniform(row.plan): row for row in rows[1:]}
    drawn = [chosen, *(baselines[w] for w in wanted if w in baselines)]  # FSDP+SAC needs a selective profile
    sides = [PlotSide(row.name, row.plan, row.prediction) for row in drawn]
    params = sum(u.param_count for u in chosen.prediction.units)
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    title = (
        f"{run.model_name} ({count} parameters) on {run.world_size} x {run.figures.name}, batch "
        f"{run.batch_size} per device, precision {run.precision}"
    )
    return plot_plan(path, sides, budget=run.budget, capacity=run.figures.memory_bytes, title=title)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise CLIError(
            '--plot needs matplotlib: pip install "lightning-osdp[plot]" (the dev extra that scripts/setup.sh '
            "installs has it), or pip install matplotlib"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_plan(
    path: str | Path,
    sides: Sequence[PlotSide],
    *,
    budget: int | None = None,
    capacity: int | None = None,
    title: str = "",
) -> Path:
    """Draw the memory over the step of each of ``sides`` (the first is the chosen plan, folded in the strip below)
    and save the figure to ``path`` (PNG, SVG or PDF, by its suffix).

    Args:
        path: the file to write (its folder is created).
        sides: the plans to draw side by side, the chosen one first (``osdp plan``: OSDP, then FSDP).
        budget: the per-device memory budget, drawn as a line.
        capacity: the device's memory, drawn as a line.
        title: the figure's title (the model, the machine, the batch).

    Returns:
        the path written.
    """
    if not sides:
        raise ValueError("plot_plan needs at least one plan to draw")
    plt = _pyplot()
    from matplotlib.patches import Patch

    fig = plt.figure(figsize=FIGSIZE, dpi=DPI)
    grid = fig.add_gridspec(3, len(sides), height_ratios=[3.2, 0.3, 1.6], hspace=0.42, wspace=0.05)
    chosen = sides[0]
    # One scale for every panel, set by the chosen plan and the budget: a baseline far over the budget (FSDP without
    # recomputation, say) would otherwise flatten the chosen plan to the floor (its peak is written where it is cut),
    # and so would a device much larger than a small budget (said in the note instead of drawn).
    top = max(chosen.prediction.peak_bytes, budget or 0) * 1.18
    off_scale = ""
    if capacity and capacity > 1.5 * top:
        off_scale, capacity = f"; the device's {format_bytes(capacity)} is off the scale", None
    elif capacity:
        top = max(top, capacity * 1.08)
    unit, unit_name = (2**30, "GiB") if top >= 2**30 else (2**20, "MiB")
    memory_axes: list[Any] = []
    for column, side in enumerate(sides):
        ax = fig.add_subplot(grid[0, column], sharey=memory_axes[0] if memory_axes else None)
        memory_axes.append(ax)
        _draw_memory(ax, side, top, unit, budget, capacity)
        if column:
            ax.tick_params(labelleft=False)
        else:
            ax.set_ylabel(f"{unit_name} per device (rank 0)")
    memory_axes[0].set_ylim(0, top / unit)
    legend = [
        Patch(facecolor=_CATEGORY_COLOURS[c], label=c.replace("_", " ").replace("states", "state")) for c in CATEGORIES
    ]
    fig.legend(handles=legend, loc="upper center", ncol=len(CATEGORIES), fontsize=9, bbox_to_anchor=(0.5, 0.97))
    _draw_strip(fig.add_subplot(grid[1, :]), chosen)
    _draw_runs(fig.add_subplot(grid[2, :]), chosen)
    fig.suptitle(title or chosen.plan.summary(), fontsize=11, y=0.995)
    fig.text(
        0.5,
        0.925,
        "predicted memory of one training step on rank 0, in order; each bar is the largest of the cost model's "
        f"instants it covers (phases not to scale), the peak marked{off_scale}",
        ha="center",
        fontsize=8,
        color="#444444",
    )
    fig.subplots_adjust(left=0.05, right=0.99, top=0.865, bottom=0.01)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


#: Bars per panel: each is the largest instant of those it covers (a block is a few instants), so a 126-block step
#: draws as its envelope, the peak included, instead of a comb of single-instant spikes.
_BARS = 180
#: The fewest bars a phase takes (the loss and the optimizer step are an instant or two).
_MIN_PHASE_BARS = 8


def _bars(timeline: Sequence[MemoryInstant]) -> list[MemoryInstant]:
    """``timeline`` as at most about :data:`_BARS` bars, each phase its share of them (at least
    :data:`_MIN_PHASE_BARS`), each bar the largest instant of the ones it covers (repeated when a phase has fewer
    instants than bars)."""
    bars: list[MemoryInstant] = []
    for phase in PHASES:
        instants = [p for p in timeline if p.phase == phase]
        if not instants:
            continue
        m = len(instants)
        n = max(_MIN_PHASE_BARS, round(_BARS * m / len(timeline)))
        for j in range(n):
            lo = j * m // n
            hi = max((j + 1) * m // n, lo + 1)
            bars.append(max(instants[lo:hi], key=lambda p: p.parts.total))
    return bars


def _draw_memory(ax: Any, side: PlotSide, top: float, unit: int, budget: int | None, capacity: int | None) -> None:
    """One panel: the stacked memory over the step, the phases, the lines and the peak (``top`` the scale's top in
    bytes, ``unit`` the bytes of one unit of the y axis)."""
    bars = _bars(side.prediction.memory_timeline())
    xs = list(range(len(bars) + 1))
    ys = [[getattr(b.parts, c) / unit for b in [*bars, bars[-1]]] for c in CATEGORIES]
    ax.stackplot(xs, ys, colors=[_CATEGORY_COLOURS[c] for c in CATEGORIES], linewidth=0, step="post", zorder=2)
    centres, names = [], []
    for phase in PHASES:
        at = [i for i, b in enumerate(bars) if b.phase == phase]
        if not at:
            continue
        ax.axvspan(min(at), max(at) + 1, color=_PHASE_SHADES[phase], zorder=0)
        centres.append((min(at) + max(at) + 1) / 2)
        names.append("opt.\nstep" if phase == "optimizer" else phase)
    ax.set_xticks(centres)
    ax.set_xticklabels(names, fontsize=8)
    ax.tick_params(axis="x", length=0)
    ax.set_xlim(0, len(bars))
    label = {"fontsize": 8, "va": "bottom", "zorder": 4, "bbox": {"fc": "white", "ec": "none", "pad": 0.5}}
    if budget:
        ax.axhline(budget / unit, color="#C0392B", linestyle="--", linewidth=1.2, zorder=3)
        ax.text(1, budget / unit, f"budget {format_bytes(budget)}", color="#C0392B", ha="left", **label)
    if capacity:
        ax.axhline(capacity / unit, color="black", linestyle=":", linewidth=1.2, zorder=3)
        ax.text(len(bars) - 1, capacity / unit, f"device {format_bytes(capacity)}", ha="right", **label)
    prediction = side.prediction
    index = max(range(len(bars)), key=lambda i: bars[i].parts.total)
    fits = "" if budget is None else (", fits" if prediction.peak_bytes <= budget else ", over the budget")
    if prediction.peak_bytes <= top:
        ax.plot([index + 0.5], [prediction.peak_bytes / unit], marker="v", color="black", markersize=6, zorder=4)
    else:
        ax.annotate(
            f"peak {format_bytes(prediction.peak_bytes)}\noff the scale",
            xy=(index + 0.5, top / unit),
            xytext=(index + 0.5, top / unit * 0.8),
            ha="center",
            fontsize=8,
            zorder=5,
            arrowprops={"arrowstyle": "->"},
            bbox={"boxstyle": "round", "fc": "white", "ec": "#888888"},
        )
    ax.set_title(
        f"{side.name}: peak {format_bytes(prediction.peak_bytes)}{fits}\n"
        f"at {_short(prediction.peak_at)}; step {prediction.step_seconds * 1e3:,.1f} ms",
        fontsize=9,
    )


def _short(label: str, width: int = 48) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3) :]


def _strip_units(side: PlotSide) -> list[tuple[str, Decision]]:
    """The chosen plan's top-level units in forward order, each with its decision (a unit nested in one is listed
    with its run, not drawn)."""
    order = [u.name for u in side.prediction.units]
    out: list[tuple[str, Decision]] = []
    for run in fold_plan(side.plan, order):
        prefix, start = _index(run.first)
        names = [run.first] if start is None else [f"{prefix}{start + i}" for i in range(run.count)]
        out.extend((n, run.decision) for n in names)
    return out


def _draw_strip(ax: Any, side: PlotSide) -> None:
    """The plan as one strip, a cell per top-level unit in forward order, coloured by mode, hatched when recomputed."""
    from matplotlib.patches import Patch, Rectangle

    units = _strip_units(side)
    for i, (_, d) in enumerate(units):
        ax.add_patch(
            Rectangle(
                (i, 0),
                1,
                1,
                facecolor=_MODE_COLOURS[d.mode],
                hatch=_RECOMPUTE_HATCH[d.recompute],
                edgecolor="white",
                linewidth=0.3 if len(units) > 60 else 0.8,
            )
        )
    ax.set_xlim(0, len(units))
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ticks = _strip_ticks(len(units))
    ax.set_xticks([t + 0.5 for t in ticks])
    labels = ax.set_xticklabels([units[t][0] or "<root>" for t in ticks], fontsize=7)
    labels[0].set_horizontalalignment("left")
    labels[-1].set_horizontalalignment("right")
    for spine in ax.spines.values():
        spine.set_visible(False)
    modes = sorted({d.mode for _, d in units}, key=list(_MODE_COLOURS).index)
    recomputes = sorted({d.recompute for _, d in units if d.recomputes})
    handles = [Patch(facecolor=_MODE_COLOURS[m], label=m) for m in modes]
    handles += [
        Patch(facecolor="white", edgecolor="black", hatch=_RECOMPUTE_HATCH[r], label=f"recompute {r}")
        for r in recomputes
    ]
    ax.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.02), ncol=len(handles), fontsize=8, frameon=False
    )
    ax.set_title(f"{side.name}: units in forward order", fontsize=9, loc="left", pad=4)


def _strip_ticks(n: int) -> list[int]:
    """At most 7 tick positions over ``n`` cells, the first and last included."""
    if n <= 7:
        return list(range(n))
    step = (n - 1) / 6
    return sorted({round(i * step) for i in range(7)})


def _draw_runs(ax: Any, side: PlotSide) -> None:
    """The plan folded into runs of identical blocks, as text: two columns when the lines are short enough, as many
    runs as fit, and how many are left out."""
    runs = fold_plan(side.plan, [u.name for u in side.prediction.units])
    ax.axis("off")
    labels = [f"{i + 1:>2}. {run.label}" for i, run in enumerate(runs)]
    columns = 2 if max(len(line) for line in labels) <= _COLUMN_CHARS else 1
    room = _RUN_ROWS * columns
    if len(labels) > room:
        labels = [*labels[: room - 1], f"... and {len(labels) - room + 1} more runs (osdp show lists every unit)"]
    per_column = -(-len(labels) // columns)
    heading = f"{side.name}: identical consecutive units folded, {len(runs)} runs"
    ax.text(0.0, 1.0, heading, fontsize=9, va="top", ha="left", transform=ax.transAxes)
    for c in range(columns):
        ax.text(
            0.5 * c,
            0.88,
            "\n".join(labels[c * per_column : (c + 1) * per_column]),
            fontsize=7.5,
            family="monospace",
            va="top",
            ha="left",
            transform=ax.transAxes,
        )
