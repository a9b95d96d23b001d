"""Fitting ``seconds = alpha + x / rate`` (a latency and a throughput) to measured samples.

[Note: relative least squares]
Samples span three or four orders of magnitude of ``x`` (4 KiB to 16 MiB collectives, tiny to large matmuls); a
plain least-squares fit is dominated by the largest samples and leaves the latency of small ones to rounding.
The fit minimises the *relative* residuals, ``sum(((alpha + x / rate) - t) / t) ** 2)``, so small and large
samples weigh alike. ``alpha`` is kept non-negative and ``1 / rate`` too (``rate == inf``: no size-dependent
cost); with one sample the fit is a pure throughput through the origin.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["fit_latency_throughput"]


def fit_latency_throughput(samples: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """``(alpha_seconds, rate)`` fitted to ``(x, seconds)`` samples (see [Note: relative least squares])."""
    points = [(float(x), float(t)) for x, t in samples if t > 0 and x >= 0]
    if not points:
        return 0.0, math.inf
    weights = [1.0 / (t * t) for _, t in points]
    s0 = sum(weights)
    s1 = sum(w * x for w, (x, _) in zip(weights, points, strict=True))
    s2 = sum(w * x * x for w, (x, _) in zip(weights, points, strict=True))
    t0 = sum(w * t for w, (_, t) in zip(weights, points, strict=True))
    t1 = sum(w * x * t for w, (x, t) in zip(weights, points, strict=True))
    det = s0 * s2 - s1 * s1
    if len(points) >= 2 and det > 1e-12 * s0 * s2:
        alpha = (t0 * s2 - t1 * s1) / det
        slope = (s0 * t1 - s1 * t0) / det
        if alpha >= 0 and slope >= 0:
            return alpha, (1.0 / slope if slope > 0 else math.inf)
        if slope < 0:
            return max(t0 / s0, 0.0), math.inf
    # alpha would be negative (or cannot be told apart from the slope): a pure throughput through the origin.
    slope = t1 / s2 if s2 > 0 else 0.0
    return 0.0, (1.0 / slope if slope > 0 else math.inf)
