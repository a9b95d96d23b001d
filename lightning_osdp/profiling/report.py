"""A profile as a table: rich (coloured) on a terminal, plain text otherwise, folded to a depth on request."""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from lightning_osdp.budget import format_bytes

if TYPE_CHECKING:  # the profile renders itself through this module: a runtime import would be a cycle
    from lightning_osdp.profiling.model_profile import ModelProfile

__all__ = ["format_profile", "print_profile", "profile_tables"]

_SUMMED = (
    "param_count",
    "param_bytes",
    "grad_bytes",
    "optim_state_bytes",
    "activation_bytes",
    "fwd_seconds",
    "bwd_seconds",
    "fwd_flops",
)


def _depth(name: str) -> int:
    return 0 if name == "" else name.count(".") + 1


def _rows(profile: ModelProfile, max_depth: int | None) -> list[tuple[str, str, dict[str, float]]]:
    """``(name, type, figures)`` per shown module; with ``max_depth``, deeper modules fold into their ancestor."""
    rows: dict[str, tuple[str, dict[str, float]]] = {}
    for name, module in profile.modules.items():
        shown = name if max_depth is None or _depth(name) <= max_depth else ".".join(name.split(".")[:max_depth])
        if shown not in rows:
            shown_type = profile.modules[shown].type if shown in profile.modules else module.type
            rows[shown] = (shown_type, dict.fromkeys(_SUMMED, 0.0))
        figures = rows[shown][1]
        for key in _SUMMED:
            figures[key] += getattr(module, key)
    return [(name, type_, figures) for name, (type_, figures) in rows.items()]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _gflop(flops: float) -> str:
    return f"{flops / 1e9:.4f}" if flops else "0"


def _loss_region(profile: ModelProfile) -> str:
    """The loss region's figures and a measured correction, for the summary line (empty when neither is known)."""
    parts = []
    loss = profile.loss
    if loss is not None:
        output, forward, backward = (
            format_bytes(b) for b in (loss.output_bytes, loss.forward_peak_bytes, loss.backward_peak_bytes)
        )
        parts.append(f"loss region: output {output}, forward peak +{forward}, backward peak +{backward}")
    if profile.measured_peak_correction:
        parts.append(f"measured correction {format_bytes(profile.measured_peak_correction)}")
    return "".join(f"{part}, " for part in parts)


def profile_tables(profile: ModelProfile, *, max_depth: int | None = None) -> list[Any]:
    """The renderables :func:`print_profile` prints: a summary line, the module table, the collectives table."""
    rate = f" (state x{profile.optim_state_factor:.2f})" if profile.optimizer else ""
    batch = ", ".join(f"{t['dtype']}{t['shape']}" for t in profile.batch.get("tensors", [])) or "-"
    summary = (
        f"OSDP profile: {profile.mode} on {profile.device}, world size {profile.world_size}, "
        f"optimizer {profile.optimizer or 'none'}{rate}, batch {batch} ({profile.batch.get('source', '?')}); "
        f"step overhead {_ms(profile.step_overhead_seconds)} ms (optimizer {_ms(profile.optimizer_step_seconds)} ms), "
        f"activations outside modules {format_bytes(profile.extra_activation_bytes)}, "
        f"{_loss_region(profile)}profiled in {profile.profiling_seconds:.2f} s"
    )
    table = Table(box=box.SIMPLE_HEAD, title=None, show_footer=True)
    columns = [
        ("module", "left"),
        ("type", "left"),
        ("params", "right"),
        ("param", "right"),
        ("grad", "right"),
        ("optim", "right"),
        ("activ.", "right"),
        ("fwd ms", "right"),
        ("bwd ms", "right"),
        ("fwd GFLOP", "right"),
    ]
    rows = _rows(profile, max_depth)
    totals = dict.fromkeys(_SUMMED, 0.0)
    for _, _, figures in rows:
        for key in _SUMMED:
            totals[key] += figures[key]
    footer = [
        "total",
        "",
        f"{int(totals['param_count']):,}",
        format_bytes(totals["param_bytes"]),
        format_bytes(totals["grad_bytes"]),
        format_bytes(totals["optim_state_bytes"]),
        format_bytes(totals["activation_bytes"] + profile.extra_activation_bytes),
        _ms(totals["fwd_seconds"]),
        _ms(totals["bwd_seconds"]),
        _gflop(totals["fwd_flops"]),
    ]
    for (header, justify), total in zip(columns, footer, strict=True):
        table.add_column(header, justify=justify, footer=total)  # type: ignore[arg-type]
    for name, type_, figures in rows:
        table.add_row(
            "  " * _depth(name) + (name.rsplit(".", 1)[-1] if name else "(root)"),
            type_,
            f"{int(figures['param_count']):,}",
            format_bytes(figures["param_bytes"]),
            format_bytes(figures["grad_bytes"]),
            format_bytes(figures["optim_state_bytes"]),
            format_bytes(figures["activation_bytes"]),
            _ms(figures["fwd_seconds"]),
            _ms(figures["bwd_seconds"]),
            _gflop(figures["fwd_flops"]),
        )
    renderables: list[Any] = [summary, table]
    if profile.collectives:
        comm = Table(box=box.SIMPLE_HEAD)
        for header in ("collective", "ranks", "alpha us", "beta GB/s", "1 MiB ms", "16 MiB ms", "samples"):
            comm.add_column(header, justify="left" if header == "collective" else "right")
        levels = [("", profile.collectives)]
        if profile.inter_node_collectives:
            levels = [(" within a node", profile.collectives), (" across nodes", profile.inter_node_collectives)]
        for op, fit in ((op + level, fit) for level, fits in levels for op, fit in fits.items()):
            beta = "inf" if math.isinf(fit.beta_bytes_per_second) else f"{fit.beta_bytes_per_second / 1e9:.3f}"
            comm.add_row(
                op,
                str(fit.world_size),
                f"{fit.alpha_seconds * 1e6:.1f}",
                beta,
                _ms(fit.seconds(2**20)),
                _ms(fit.seconds(2**24)),
                str(len(fit.samples)),
            )
        renderables.append(comm)
    return renderables


def print_profile(profile: ModelProfile, *, max_depth: int | None = None, console: Console | None = None) -> None:
    """Print the profile: a rich table on a terminal, plain text when the output is not one."""
    console = console or Console()
    for renderable in profile_tables(profile, max_depth=max_depth):
        console.print(renderable)


def format_profile(profile: ModelProfile, *, max_depth: int | None = None, width: int = 160) -> str:
    """The profile as plain text (no colour codes), for logs and ``str(profile)``.

    Each row is a module's *own* figures (exclusive of its children, see ``model_profile``), indented by depth;
    with ``max_depth``, a module deeper than that is added into its ancestor at ``max_depth``, whose row then
    shows the subtree's total. The footer row is the model's total (activations include those outside modules).
    """
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=False, color_system=None, highlight=False)
    print_profile(profile, max_depth=max_depth, console=console)
    return buffer.getvalue()
