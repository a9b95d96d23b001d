"""The plan as a table: module, parameters, mode, split, memory, time; totals and predicted peak vs budget."""

from __future__ import annotations

import io
import sys

from lightning_osdp.budget import format_bytes
from lightning_osdp.cost_model.prediction import Prediction
from lightning_osdp.plan import Plan

__all__ = ["format_plan"]


def format_plan(
    plan: Plan,
    prediction: Prediction,
    *,
    budget: int | None = None,
    rich_markup: bool | None = None,
    width: int = 120,
) -> str:
    """Render ``plan`` with its ``prediction`` as a table (one row per unit, the slices of a split together).

    Args:
        plan: the plan (its ``report`` supplies the solver's status and budget when present).
        prediction: :func:`~lightning_osdp.cost_model.predict` of the plan.
        budget: per-device budget in bytes (default: ``plan.report.requested_budget_bytes``).
        rich_markup: render with rich's box drawing; ``None``: when stdout is a terminal (plain text when piped
            or logged).
        width: table width for rich.

    Columns: the unit's module, its parameters (count), mode, split, how it recomputes its activations in backward
    (``full`` or ``selective`` activation checkpointing; empty: not at all), the bytes it keeps all step on this rank
    (parameters, gradients, optimizer state), the bytes while gathered, its communication and what it adds to the step
    (exposed communication, copies, optimizer, overhead), in milliseconds.
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
                plan.decisions[u.name].recompute
                if u.name in plan.decisions and plan.decisions[u.name].recomputes
                else "",
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
        f"predicted step {prediction.step_seconds * 1e3:.1f} ms (compute {prediction.compute_seconds * 1e3:.1f} ms, "
        f"communication {prediction.communication_seconds * 1e3:.1f} ms, exposed "
        f"{prediction.exposed_seconds * 1e3:.1f} ms) on {prediction.world_size} ranks"
        + (f"; solver: {status}" if status else ""),
    ]
    title = f"OSDP plan: {plan.summary()}"
    if use_rich:
        return _rich(title, headers, rows, total, footer, width)
    return _plain(title, headers, rows, total, footer)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _plain(title: str, headers: list[str], rows: list[list[str]], total: list[str], footer: list[str]) -> str:
    table = [headers, *rows, total]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    right = {1, 3, 5, 6, 7, 8}

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
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i in (0, 2, 4) else "right")
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
