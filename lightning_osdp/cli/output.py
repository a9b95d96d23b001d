"""Where the commands write: results on stdout, progress on stderr; rich on a terminal, plain text otherwise.

A result goes to stdout as a rich table when stdout is a terminal, and as plain aligned text (no colour codes, no
box drawing) when it is piped or captured, so that ``osdp plan ... > plan.txt`` and a test reading the output see
the same columns. Progress of the long steps (profiling, solving, searching batch sizes) goes to stderr: a rich
spinner on a terminal, one plain line per step otherwise (or nothing with ``quiet``), never mixed into the
result.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["Output", "plain_table"]


def plain_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[int] = (),
    footer: Sequence[Sequence[str]] = (),
) -> str:
    """Rows as aligned plain text: a header line, a rule, the rows, and (after another rule) ``footer`` rows.

    Args:
        headers: column titles.
        rows: one sequence of cells per row, as many as ``headers``.
        right: indices of right-aligned columns (numbers).
        footer: rows printed after a rule (totals).
    """
    table = [list(headers), *(list(r) for r in rows), *(list(r) for r in footer)]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        out = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(out).rstrip()

    rule = "-" * len(line(headers))
    lines = [line(headers), rule, *(line(r) for r in rows)]
    if footer:
        lines += [rule, *(line(r) for r in footer)]
    return "\n".join(lines)


class Output:
    """A command's output streams.

    Args:
        stdout: where results go (default: ``sys.stdout`` at construction time).
        stderr: where progress goes (default: ``sys.stderr``).
        rich: render tables with rich; ``None``: when ``stdout`` is a terminal.
        quiet: no progress at all.
        width: table width for rich (default: the terminal's, at least 120).
    """

    def __init__(
        self,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        *,
        rich: bool | None = None,
        quiet: bool = False,
        width: int | None = None,
    ) -> None:
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self.rich = _isatty(self.stdout) if rich is None else rich
        self.quiet = quiet
        self.width = width
        self._progress_rich = _isatty(self.stderr)

    def print(self, text: str = "") -> None:
        """One result line (or block) on stdout."""
        print(text, file=self.stdout, flush=True)

    def table(
        self,
        title: str,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        right: Sequence[int] = (),
        footer: Sequence[Sequence[str]] = (),
        notes: Sequence[str] = (),
    ) -> None:
        """A titled table with optional footer rows and note lines below it (see :func:`plain_table`)."""
        if not self.rich:
            self.print(title)
            self.print(plain_table(headers, rows, right=right, footer=footer))
            for note in notes:
                self.print(note)
            return
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        for i, header in enumerate(headers):
            table.add_column(header, justify="right" if i in right else "left")
        for row in rows:
            table.add_row(*row)
        if footer:
            table.add_section()
            for row in footer:
                table.add_row(*row, style="bold")
        # At least as wide as format_plan's tables (120): narrower, rich folds numbers into several lines.
        width = self.width or max(shutil.get_terminal_size().columns, 120)
        console = Console(file=self.stdout, width=width, force_terminal=True, highlight=False)
        console.print(table)
        for note in notes:
            console.print(note, markup=False)

    def note(self, text: str) -> None:
        """A remark about the run (an assumption made, a fallback taken) on stderr, unless quiet."""
        if not self.quiet:
            print(f"osdp: {text}", file=self.stderr, flush=True)

    @contextmanager
    def step(self, message: str) -> Iterator[None]:
        """Show ``message`` while the block runs: a spinner on a terminal, else a plain line with its duration."""
        if self.quiet:
            yield
            return
        start = time.perf_counter()
        if self._progress_rich:
            console = Console(file=self.stderr, highlight=False)
            with console.status(message):
                yield
            console.print(f"[dim]{message}: {time.perf_counter() - start:.1f} s[/dim]")
            return
        print(f"osdp: {message} ...", file=self.stderr, flush=True)
        yield
        print(f"osdp: {message}: done in {time.perf_counter() - start:.1f} s", file=self.stderr, flush=True)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or wrapped stream
        return False
