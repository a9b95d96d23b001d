"""Which parameters communicate together: a plan's communication units, decided once.

The executor applies them (one ``fully_shard`` per sharded unit, DDP's buckets for the ``no_shard`` ones), the
cost model predicts them and the solver builds its candidates on them; all three call :func:`communication_units`
so that they cannot disagree.

[Note: words]
* A **decision** is one entry of a :class:`~lightning_osdp.plan.Plan`: a module name, a mode and a split factor.
* A **communication unit** (a *unit*) is a set of parameters gathered in one all-gather and reduced in one
  reduction: what one decision covers (see ``plan.py``'s [Note: what a decision covers]), the decisions on the
  holders of a tied parameter merged into one (a *list group*, ``fully_shard([wte, lm_head])``), or one slice of
  a split Linear. A sharded unit is one FSDP2 parameter group (torch's ``FSDPParamGroup``); a ``no_shard`` unit
  is plain parameters under DDP.
* A **planning unit** is what the solver chooses an option for (a segment, a tied group, the root); one option
  may make several communication units (``solver/candidates.py``).

[Note: tied parameters]
A parameter shared by two modules (embedding and LM head) must live in one FSDP2 group. When the holders fall
under different decisions, those decisions are one list group and must agree on the mode. A holder covered by the
decision of one of the other holders' ancestors (the root, say) cannot be grouped with it: FSDP2 would find the
parameter already managed by the nested group, so the plan is refused, naming both holders. A tied holder cannot
be split (its slices would be new parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_osdp.errors import PlanError

if TYPE_CHECKING:
    from torch import nn

    from lightning_osdp.plan import Decision

__all__ = [
    "ROOT",
    "CommunicationUnit",
    "Tie",
    "communication_units",
    "covering_decision",
    "merged_ties",
    "slice_name",
    "tied_holders",
]

#: The name of the root module (the LightningModule itself) in ``named_modules()`` and in a plan.
ROOT = ""


@dataclass(frozen=True)
class Tie:
    """A parameter held by several modules.

    Attributes:
        holders: the modules holding it directly, in ``named_modules()`` order.
        parameter: its first qualified name (``"wte.weight"``), when known (a profile records only the holders).
    """

    holders: tuple[str, ...]
    parameter: str | None = None

    def describe(self) -> str:
        """``tied parameter 'wte.weight'`` (or the holders, when the name is not known), for error messages."""
        if self.parameter:
            return f"tied parameter {self.parameter!r}"
        return f"the parameter tied between {', '.join(repr(h) for h in self.holders)}"


@dataclass(frozen=True)
class CommunicationUnit:
    """One communication unit (see [Note: words]).

    Attributes:
        names: the modules applied together: one decided module, the decided holders of a tied parameter (a list
            group, sorted), or one slice of a split Linear (``"fc.slices.0"``).
        decision: the decided module whose decision this unit takes (the first of a list group; for a slice, the
            split module).
        mode: the unit's mode.
        split: the decision's split factor (``> 1`` for the slices of a split Linear).
    """

    names: tuple[str, ...]
    decision: str
    mode: str
    split: int = 1

    @property
    def depth(self) -> int:
        """How deep the unit's shallowest module is (the root is 0)."""
        return min(0 if n == ROOT else n.count(".") + 1 for n in self.names)

    @property
    def is_list_group(self) -> bool:
        """Whether the unit merges the decisions of several holders of a tied parameter."""
        return len(self.names) > 1


def slice_name(name: str, index: int) -> str:
    """The module name of slice ``index`` of the split Linear ``name`` (``SplitLinear.slices[index]``)."""
    return f"{name}.slices.{index}"


def covering_decision(decisions: Mapping[str, object], name: str) -> str:
    """The decided module whose decision covers module ``name``: its nearest decided ancestor or itself, else the
    root."""
    probe = name
    while probe not in decisions and probe != ROOT:
        probe = probe.rpartition(".")[0]
    return probe


def tied_holders(module: nn.Module) -> list[Tie]:
    """The parameters of ``module`` held by more than one module, with their holders (``named_modules`` order).

    The profiler records these holders in ``ModelProfile.tied``; the executor groups by them. One function for
    both, so that a plan is grouped alike on the live model and on its profile."""
    holders: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            found = holders.setdefault(id(p), [])
            if mod_name not in found:
                found.append(mod_name)
            names.setdefault(id(p), f"{mod_name}.{p_name}" if mod_name else p_name)
    return [Tie(tuple(found), names[key]) for key, found in holders.items() if len(found) > 1]


def merged_ties(ties: Iterable[Tie | Sequence[str]]) -> list[tuple[str, ...]]:
    """The holder sets that must end in one communication unit: ties sharing a holder merged, transitively (a
    module holding two tied parameters joins both ties' holders). Holders in first-seen order."""
    groups: list[list[str]] = []
    for tie in _as_ties(ties):
        joined = [g for g in groups if set(g) & set(tie.holders)]
        merged = list(dict.fromkeys([*(h for g in joined for h in g), *tie.holders]))
        groups = [g for g in groups if g not in joined]
        groups.append(merged)
    return [tuple(g) for g in groups]


def _as_ties(ties: Iterable[Tie | Sequence[str]]) -> list[Tie]:
    return [t if isinstance(t, Tie) else Tie(tuple(t)) for t in ties]


def communication_units(
    decisions: Mapping[str, Decision], ties: Iterable[Tie | Sequence[str]] = ()
) -> list[CommunicationUnit]:
    """The communication units of ``decisions`` (a plan's), given the tied parameters' holders.

    Decisions on holders of one tied parameter are merged into one list group (transitively); a split decision
    yields one unit per slice. The root's unit (``""``) is included when the root is decided. Units come in the
    order of their first decision's name. Tied holders that are not modules of the plan's model are ignored (an old
    profile may name modules a run deduplicated).

    Raises:
        PlanError: a tie between a decision and an ancestor's decision, tied decisions of different modes, or the
            split of a tied holder (see [Note: tied parameters]).
    """

    parent = {name: name for name in decisions}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for tie in _as_ties(ties):
        for name in tie.holders:
            decision = decisions.get(name)
            if decision is not None and decision.split > 1:
                others = ", ".join(repr(m) for m in tie.holders if m != name)
                raise PlanError(
                    f"module {name!r}: cannot split a module whose parameter "
                    f"{tie.parameter or '(tied)'!r} is shared with {others}"
                )
        covering = {h: covering_decision(decisions, h) for h in tie.holders}
        units = sorted(set(covering.values()))
        if len(units) < 2:
            continue
        for a in units:
            for b in units:
                if a != b and (a == ROOT or b.startswith(a + ".")):
                    holder_a = next(h for h in tie.holders if covering[h] == a)
                    holder_b = next(h for h in tie.holders if covering[h] == b)
                    raise PlanError(
                        f"{tie.describe()} is used by {holder_b!r} (decision {b!r}) and by {holder_a!r} (decision "
                        f"{a!r}, an ancestor of {b!r}); a shared parameter must sit in one unit: give {holder_a!r} its "
                        f"own decision, or remove the decision on {b!r}"
                    )
        modes = {decisions[u].mode for u in units if u in decisions}
        if len(modes) > 1:
            detail = ", ".join(f"{u!r}={decisions[u].mode}" for u in units)
            raise PlanError(
                f"{tie.describe()} is shared by decisions with different modes ({detail}); decisions that share a "
                "parameter are one FSDP2 group and must take the same mode"
            )
        for u in units[1:]:
            parent[find(u)] = find(units[0])

    members: dict[str, list[str]] = {}
    for name in sorted(decisions):
        members.setdefault(find(name), []).append(name)
    result: list[CommunicationUnit] = []
    for names in sorted(members.values()):
        first = decisions[names[0]]
        if first.split > 1:
            (name,) = names
            result.extend(
                CommunicationUnit((slice_name(name, i),), name, first.mode, first.split) for i in range(first.split)
            )
        else:
            result.append(CommunicationUnit(tuple(names), names[0], first.mode))
    return result
