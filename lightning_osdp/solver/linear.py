"""Linear expressions over the solver's option binaries, and the timeline backend that produces them.

The ILP works in MiB and milliseconds (byte counts near 1e9 make the solver's tolerances meaningless); values are
converted back when the plan is reported. See ``lightning_osdp/cost_model/timeline.py`` for why the timeline is
shared with the predictor.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_osdp.cost_model.parts import MemoryParts

__all__ = ["MIB", "LinExpr", "LinearBackend", "option_coefficients"]

MIB = float(2**20)


def option_coefficients(values: Mapping[Hashable, MemoryParts | None], cross_upper: float) -> dict[Hashable, float]:
    """Per option, its bytes at an instant of ``checkpoint_options`` in MiB, the row's terms beside ``base + cross``.

    An option that never reaches the instant (``None``) gets ``-cross_upper``, the upper bound of ``cross``: its row
    reads ``base + cross - ub(cross) <= base``, implied by the segment's first instant (a real state), so it never
    binds."""
    return {o: -cross_upper if v is None else v.total / MIB for o, v in values.items()}


class LinExpr:
    """``const + sum(coef * var)`` over variable indices of a :class:`LinearBackend`."""

    __slots__ = ("const", "terms")

    def __init__(self, terms: dict[int, float] | None = None, const: float = 0.0) -> None:
        self.terms = terms or {}
        self.const = const

    def __add__(self, other: LinExpr) -> LinExpr:
        terms = dict(self.terms)
        for k, v in other.terms.items():
            terms[k] = terms.get(k, 0.0) + v
        return LinExpr(terms, self.const + other.const)

    def __sub__(self, other: LinExpr) -> LinExpr:
        terms = dict(self.terms)
        for k, v in other.terms.items():
            terms[k] = terms.get(k, 0.0) - v
        return LinExpr(terms, self.const - other.const)


@dataclass
class Variable:
    """A binary (``key``/``option`` set) or a continuous auxiliary (``definition`` set, or a maximum)."""

    name: str
    binary: bool
    key: Hashable | None = None
    option: Hashable | None = None
    lb: float = 0.0
    ub: float = 0.0
    definition: LinExpr | None = None
    maximum_of: list[LinExpr] = field(default_factory=list)


class LinearBackend:
    """Builds the ILP's pieces from the timeline: binaries per (choice, option), auxiliary levels, checkpoints
    (each becomes ``value <= budget``), and the step-time objective."""

    def __init__(self) -> None:
        self.variables: list[Variable] = []
        self.binaries: dict[tuple[Hashable, Hashable], int] = {}
        self.options: dict[Hashable, list[Hashable]] = {}
        self.checkpoints: list[tuple[str, LinExpr]] = []
        self.objective = LinExpr()
        #: the timeline input the rows were built from (set by ``PlanningProblem.build``)
        self.source: Any = None
        self._compiled: _Compiled | None = None

    # ------------------------------------------------------------------ variables
    def register(self, key: Hashable, options: Sequence[Hashable]) -> None:
        """Declare a choice and its options (exactly one will be 1)."""
        self.options[key] = list(options)
        for o in options:
            self.binaries[(key, o)] = len(self.variables)
            self.variables.append(Variable(f"x_{len(self.variables)}", True, key, o, 0.0, 1.0))

    def _aux(self, name: str, lb: float, ub: float) -> int:
        self.variables.append(Variable(f"{_clean(name)}_{len(self.variables)}", False, lb=lb, ub=ub))
        return len(self.variables) - 1

    # ------------------------------------------------------------------ bounds (for implied fillers)
    def bounds(self, expr: LinExpr) -> tuple[float, float]:
        """Lower and upper bounds of ``expr`` over all assignments (one option per choice)."""
        lo = hi = expr.const
        by_key: dict[Hashable, dict[Hashable, float]] = {}
        for i, c in expr.terms.items():
            var = self.variables[i]
            if var.binary:
                by_key.setdefault(var.key, {})[var.option] = c
            elif c >= 0:
                lo += c * var.lb
                hi += c * var.ub
            else:
                lo += c * var.ub
                hi += c * var.lb
        for key, coefs in by_key.items():
            values = [coefs.get(o, 0.0) for o in self.options[key]]
            lo += min(values)
            hi += max(values)
        return lo, hi

    # ------------------------------------------------------------------ Backend protocol
    def const(self, parts: MemoryParts) -> LinExpr:
        return LinExpr(const=parts.total / MIB)

    def choice(self, key: Hashable, values: Mapping[Hashable, MemoryParts]) -> LinExpr:
        terms = {self.binaries[(key, o)]: v.total / MIB for o, v in values.items() if v.total}
        return LinExpr(terms)

    def add(self, a: LinExpr, b: LinExpr) -> LinExpr:
        return a + b

    def sub(self, a: LinExpr, b: LinExpr) -> LinExpr:
        return a - b

    def checkpoint(self, label: str, value: LinExpr) -> None:
        self.checkpoints.append((label, value))

    def checkpoint_options(
        self,
        label: str,
        base: LinExpr,
        cross: Sequence[LinExpr],
        key: Hashable,
        values: Mapping[Hashable, MemoryParts | None],
    ) -> None:
        if all(v is None for v in values.values()):
            return
        total = base
        for c in cross:
            total = total + c
        coefficients = option_coefficients(values, sum(self.bounds(c)[1] for c in cross))
        terms = {self.binaries[(key, o)]: coef for o, coef in coefficients.items() if coef}
        self.checkpoint(label, total + LinExpr(terms))

    def materialize(self, value: LinExpr, name: str) -> LinExpr:
        if len(value.terms) <= 1 and not value.const:
            return value
        lo, hi = self.bounds(value)
        i = self._aux(name, lo, hi)
        self.variables[i].definition = value
        return LinExpr({i: 1.0})

    def maximum(self, values: Sequence[LinExpr], name: str) -> LinExpr:
        if not values:
            return LinExpr()
        bounds = [self.bounds(v) for v in values]
        i = self._aux(name, max(b[0] for b in bounds), max(b[1] for b in bounds))
        self.variables[i].maximum_of = list(values)
        return LinExpr({i: 1.0})

    def seconds(self, key: Hashable, values: Mapping[Hashable, float]) -> None:
        terms = {self.binaries[(key, o)]: v * 1e3 for o, v in values.items() if v}
        self.objective = self.objective + LinExpr(terms)

    def constant_seconds(self, seconds: float) -> None:
        self.objective = self.objective + LinExpr(const=seconds * 1e3)

    # ------------------------------------------------------------------ evaluation of a chosen assignment
    def evaluate(self, expr: LinExpr, chosen: Mapping[Hashable, Hashable]) -> float:
        """``expr`` when choice ``key`` takes option ``chosen[key]`` (auxiliaries from their definitions)."""
        return self.evaluator(chosen)(expr)

    def step_time(self, chosen: Mapping[Hashable, Hashable]) -> float:
        """The objective (step time, ms) under ``chosen``: a sum over the chosen options alone (it names no
        auxiliary), so no auxiliary is computed."""
        terms = self.objective.terms
        return self.objective.const + sum(terms.get(self.binaries[(key, o)], 0.0) for key, o in chosen.items())

    def peak(self, chosen: Mapping[Hashable, Hashable]) -> float:
        """The largest checkpoint (MiB) under ``chosen`` (the solver scores every plan its phases offer with it, so
        it is on the solve's path)."""
        return float(self.rows(chosen).max())

    def rows(self, chosen: Mapping[Hashable, Hashable]) -> np.ndarray:
        """Every checkpoint's value (MiB) under ``chosen``, in order: :meth:`evaluator` over them, in arrays."""
        compiled = self._compiled
        if compiled is None or compiled.sizes != (len(self.variables), len(self.checkpoints)):
            compiled = self._compiled = _Compiled(self)
        return compiled.rows(self, chosen)

    def evaluator(self, chosen: Mapping[Hashable, Hashable]) -> Callable[[LinExpr], float]:
        """A function evaluating expressions under ``chosen`` (every auxiliary computed once, in order: a
        definition only refers to earlier variables)."""
        values = [0.0] * len(self.variables)

        def ev(e: LinExpr) -> float:
            return e.const + sum(c * values[i] for i, c in e.terms.items())

        for i, var in enumerate(self.variables):
            if var.binary:
                values[i] = 1.0 if chosen.get(var.key) == var.option else 0.0
            elif var.definition is not None:
                values[i] = ev(var.definition)
            else:
                values[i] = max(ev(e) for e in var.maximum_of)
        return ev


def _arrays(e: LinExpr) -> tuple[np.ndarray, np.ndarray, float]:
    return np.fromiter(e.terms, dtype=np.intp), np.fromiter(e.terms.values(), dtype=np.float64), e.const


class _Compiled:
    """A backend's auxiliaries and checkpoints as arrays, for :meth:`LinearBackend.peak`."""

    def __init__(self, be: LinearBackend) -> None:
        self.sizes = (len(be.variables), len(be.checkpoints))
        #: per auxiliary, in order: its index, and its definition or the expressions it is the maximum of
        self.auxiliaries = [
            (
                i,
                [_arrays(v.definition)] if v.definition is not None else [_arrays(e) for e in v.maximum_of],
                v.definition is None,
            )
            for i, v in enumerate(be.variables)
            if not v.binary
        ]
        rows = [e for _, e in be.checkpoints]
        self.row_of_term = np.repeat(np.arange(len(rows)), [len(e.terms) for e in rows])
        self.variable_of_term = np.fromiter((i for e in rows for i in e.terms), dtype=np.intp)
        self.coefficient_of_term = np.fromiter((c for e in rows for c in e.terms.values()), dtype=np.float64)
        self.row_constants = np.array([e.const for e in rows], dtype=np.float64)

    def rows(self, be: LinearBackend, chosen: Mapping[Hashable, Hashable]) -> np.ndarray:
        values = np.zeros(self.sizes[0])
        for key, option in chosen.items():
            index = be.binaries.get((key, option))
            if index is not None:
                values[index] = 1.0
        for i, expressions, is_maximum in self.auxiliaries:
            evaluated = [const + float(coefs @ values[idx]) for idx, coefs, const in expressions]
            values[i] = max(evaluated) if is_maximum else evaluated[0]
        rows = np.bincount(
            self.row_of_term, weights=self.coefficient_of_term * values[self.variable_of_term], minlength=self.sizes[1]
        )
        return rows + self.row_constants


def _clean(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)[:40]
