"""The one exception profiling raises for bad input (as opposed to a bug in the profiler)."""

from __future__ import annotations

__all__ = ["ProfilingError"]


class ProfilingError(RuntimeError):
    """The model, its example batch or its optimizer cannot be profiled; the message says which and why."""
