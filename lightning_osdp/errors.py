"""Errors more than one stage raises: here so that every stage imports them without importing another stage."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A plan, or a plan file, that cannot be applied; the message names the offending entry."""
