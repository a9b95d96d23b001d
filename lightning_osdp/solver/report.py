"""The plan as a table: module, parameters, mode, split, memory, time; totals and predicted peak vs budget."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Sequence

from lightning_osdp.budget import format_bytes
from lightning_osdp.cost_model.prediction import Prediction
from lightning_osdp.plan import RECOMPUTE_NAMES, Plan

__all__ = ["PLAN_LEGEND", "format_plan"]

#: What each column of :func:`format_plan`'s table is, printed below it with ``legend=True``.
PLAN_LEGEND: tuple[str, ...] = (
    "module: the unit (a module, and its descendants no other unit claims); units: how many identical consecutive "
    "blocks the line stands for (their figures are each one's; every unit: osdp plan --all-units); params: its "
    "parameters; mode: how it is sharded; split: the slices its Linear is cut into (gathered one at a time).",
    'recompute: AC (activation checkpointing: its forward run again in backward; recompute="full" in the plan) or '
    "SAC (selective: its matrix products', attention's and convolutions' outputs kept, the rest run again; "
    'recompute="selective"); empty: its activations kept.',
    "kept: the bytes it keeps on this rank all step (its parameters', gradients' and optimizer state's shards, or "
    "replicas); gathered: its unsharded parameters while gathered (the largest slice's); comm ms: its collectives "
    "per step, hidden or not; added ms: what it adds to the step beyond its compute (exposed communication, "
    "contention, copies, optimizer, hooks).",
)


#: How a plan table names a unit's recomputation (``Decision.recompute``), full before selective.
def format_plan(
    plan: Plan,
    prediction: Prediction,
    *,
    budget: int | None = None,
    rich_markup: bool | None = None,
    width: int = 120,
    fold: bool = False,
    legend: bool = False,
) -> str:
    """Render ``plan`` with its ``prediction`` as a table (one row per unit, the slices of a split together).

    Args:
        plan: the plan (its ``report`` supplies the solver's status and budget when present).
        prediction: :func:`~lightning_osdp.cost_model.predict` of the plan.
        budget: per-device budget in bytes (default: ``plan.report.requested_budget_bytes``).
        rich_markup: render with rich's box drawing; ``None``: when stdout is a terminal (plain text when piped
            or logged).
        width: table width for rich.
        fold: one line for each run of consecutive blocks (``prefix.3`` to ``prefix.9``) whose every figure is
            the same, named ``prefix.3-9`` with a ``units`` column (``x7``).
        legend: print :data:`PLAN_LEGEND` below the table.

    Columns: the unit's module, its parameters (count), mode, split, how it recomputes its activations in backward
    (``AC``: fully, ``SAC``: selectively; empty: not at all), the bytes it keeps all step on this rank
    (parameters, gradients, optimizer state), the bytes while gathered, its communication and what it adds to the step
    (exposed communication, contention, copies, optimizer, overhead), in milliseconds.
    """
    if budget is None and plan.report is not None:
        budget = plan.report.requested_budget_bytes
    use_rich = sys.stdout.isatty() if rich_markup is None else rich_markup
    headers = ["module", "params", "mode", "split", "recompute", "kept", "gathered", "comm ms", "added ms"]
    rows = []
    for u in prediction.units:
        rows.append(
            [
                u.name or "<root>",
                _count(u.param_count),
                u.mode,
                str(u.split),
                RECOMPUTE_NAMES.get(plan.decisions[u.name].recompute, "") if u.name in plan.decisions else "",
                format_bytes(u.kept.total),
                format_bytes(u.gathered),
                f"{u.time.communication * 1e3:.2f}",
                f"{u.time.added * 1e3:.2f}",
            ]
        )
    total = [
        "total",
        _count(sum(u.param_count for u in prediction.units)),
        "",
        "",
        "",
        format_bytes(sum(u.kept.total for u in prediction.units)),
        "",
        f"{prediction.communication_seconds * 1e3:.2f}",
        f"{sum(u.time.added for u in prediction.units) * 1e3:.2f}",
    ]
    if fold:
        headers, rows, total = _folded(headers, rows, total)
    fit = ""
    if budget:
        fit = f" of budget {format_bytes(budget)} ({100 * prediction.peak_bytes / budget:.0f}%)"
    status = plan.report.status if plan.report is not None else None
    footer = [
        f"predicted peak {format_bytes(prediction.peak_bytes)}{fit} per device at {prediction.peak_at!r}",
        "  "
        + ", ".join(
            f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in prediction.peak.as_dict().items() if k != "total"
        ),
        # The step's parts as they add up to it (Prediction.step_parts), so that "compute" is one figure wherever
        # it is printed; communication beside them, of which "exposed communication" is the part the step waits for.
        f"predicted step {prediction.step_seconds * 1e3:.1f} ms ("
        + ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.1f}" for k, v in prediction.step_parts.items())
        + f" ms; all communication {prediction.communication_seconds * 1e3:.1f} ms) on {prediction.world_size} ranks"
        + (f"; solver: {status}" if status else ""),
        *(PLAN_LEGEND if legend else ()),
    ]
    title = f"OSDP plan: {plan.summary()}"
    if use_rich:
        return _rich(title, headers, rows, total, footer, width)
    return _plain(title, headers, rows, total, footer)


_BLOCK = re.compile(r"^(.*\.)(\d+)$")


def _folded(
    headers: list[str], rows: list[list[str]], total: list[str]
) -> tuple[list[str], list[list[str]], list[str]]:
    """``rows`` with each run of consecutive blocks (``prefix.i``, ``prefix.i+1``...) that are the same on one line,
    ``prefix.i-j``, and a ``units`` column after the module (the table unchanged when nothing folds). A block is its
    row and the rows of its own units that follow it (a split Linear's, say); two are the same when every cell but the
    names is, and the names below the block's are too."""
    blocks: list[list[list[str]]] = []
    for row in rows:
        if blocks and _BLOCK.match(blocks[-1][0][0]) and row[0].startswith(blocks[-1][0][0] + "."):
            blocks[-1].append(row)  # a unit inside the block before
        else:
            blocks.append([row])
    runs: list[list[list[list[str]]]] = []
    for block in blocks:
        if runs and _follows(runs[-1][-1], block):
            runs[-1].append(block)
        else:
            runs.append([block])
    if all(len(run) == 1 for run in runs):
        return headers, rows, total
    folded = []
    for run in runs:
        first = run[0][0][0]
        end = _BLOCK.match(run[-1][0][0])
        name, units = (f"{first}-{end.group(2)}", f"x{len(run)}") if len(run) > 1 and end else (first, "")
        folded += [[name + row[0][len(first) :], units, *row[1:]] for row in run[0]]
    return [headers[0], "units", *headers[1:]], folded, [total[0], "", *total[1:]]


def _follows(before: list[list[str]], block: list[list[str]]) -> bool:
    """Whether ``block`` is the block after ``before`` (``prefix.i+1`` after ``prefix.i``) with the same figures."""
    a, b = _BLOCK.match(before[0][0]), _BLOCK.match(block[0][0])
    if a is None or b is None or a.group(1) != b.group(1) or int(b.group(2)) != int(a.group(2)) + 1:
        return False
    if len(before) != len(block):
        return False
    cut_a, cut_b = len(before[0][0]), len(block[0][0])
    return all(x[0][cut_a:] == y[0][cut_b:] and x[1:] == y[1:] for x, y in zip(before, block, strict=True))


def _right(headers: Sequence[str]) -> set[int]:
    """The right-aligned (numeric) columns."""
    return {i for i, h in enumerate(headers) if h in ("params", "split", "kept", "gathered", "comm ms", "added ms")}


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _plain(title: str, headers: list[str], rows: list[list[str]], total: list[str], footer: list[str]) -> str:
    table = [headers, *rows, total]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    right = _right(headers)

    def line(r: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    rule = "-" * len(line(headers))
    out = [title, line(headers), rule, *(line(r) for r in rows), rule, line(total), *footer]
    return "\n".join(out)


def _rich(
    title: str, headers: list[str], rows: list[list[str]], total: list[str], footer: list[str], width: int
) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_footer=False, title_justify="left")
    right = _right(headers)
    for i, h in enumerate(headers):
        table.add_column(h, justify="right" if i in right else "left")
    for r in rows:
        table.add_row(*r)
    table.add_section()
    table.add_row(*total, style="bold")
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=True)
    console.print(table)
    for f in footer:
        console.print(f, highlight=False)
    return buffer.getvalue().rstrip("\n")
