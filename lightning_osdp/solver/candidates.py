"""Planning units: which modules the solver decides for, and the options of each.

[Note: how planning units are chosen]
One decision per module would put every LayerNorm and bias in its own collective: latency-bound, and what made
a naive per-leaf executor slower than DDP. The solver therefore decides per *segment*:

1. **Segments** are the parameter-owning children of ``ModuleList``/``Sequential`` containers that no other
   segment contains (the Transformer blocks), plus large modules outside them (an untied LM head, say): any
   module outside the blocks, not containing one, whose parameters are at least ``min_fraction`` of the
   largest block (default 1/4). A segment is one FSDP2 unit (coarse options) or is cut into finer units
   (fine options).
2. **Inner units** of a segment are its ``nn.Linear`` layers holding at least ``inner_fraction`` (default 1/8)
   of the segment's parameters (qkv, the MLP's two projections): in a fine option each is its own unit and
   may be split into ``k`` slices; the rest of the segment (norms, small projections, biases) stays in the
   segment's own unit.
3. **Tied parameters** (embedding and LM head) are one list group, one mode, never split: a global unit when
   they hold at least ``min_fraction`` of the largest block, else they stay in the root.
4. **The root** ``""`` covers everything else (positional embeddings, the final norm), one mode.

Options of a segment: *coarse* ``(mode)`` for each allowed mode (and ``(mode, k)`` when the segment is itself a
splittable Linear and ``mode`` is sharded); *fine* ``(segment mode, inner mode, slice size)``, the inner mode
sharded and at least as sharded as the segment's (``no_shard`` < ``shard_grad_op`` < ``full_shard``; the reverse
only adds collectives, and ``no_shard`` inside ``no_shard`` is the coarse option: DDP has no units): every inner unit
takes the inner mode and is split into the fewest allowed slices that bring it down to the slice size, one slice
size per allowed split factor of the largest inner unit. ``hybrid_shard`` ranks with ``shard_grad_op``
(:data:`SHARDING_RANK`): it shards less than ``full_shard`` (within a group, not over the world) and, unlike
``shard_grad_op``, gathers again for backward, so neither of the two is more sharded than the other. Each of these may
also *recompute* the segment, when the solver is allowed to: fully (activation checkpointing of its entry module: it
keeps only its inputs for backward and runs its forward again there) or selectively (per-operator checkpointing: it
also keeps its matrix-product and attention outputs and runs only the other operators again; offered where the
profile measured the segment that way, ``ModuleProfile.selective_kept_bytes``). Options that are no better in time
and in every memory term than another option of the same segment are dropped before the ILP (they can never be needed).

``units=`` overrides steps 1 to 3: top-level names are segments, names nested in one are its inner units, tied
holders all named form their list group (a tied holder named without the others stays in the root).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_osdp.cost_model.structure import ModelInfo
from lightning_osdp.grouping import ROOT, merged_ties
from lightning_osdp.plan import Decision

__all__ = [
    "RECOMPUTE_CHOICES",
    "SHARDING_RANK",
    "Candidates",
    "Recompute",
    "SegmentCandidate",
    "SegmentOption",
    "planning_units",
    "segment_options",
]

#: Whether the solver may recompute segments: never (``False``), always where a segment saves activations, fully
#: (``True`` or ``"full"``) or selectively (``"selective"``), or where it pays, choosing among the three
#: (``"auto"``).
Recompute = bool | Literal["auto", "selective", "full"]

#: Every value :data:`Recompute` takes.
RECOMPUTE_CHOICES: tuple[object, ...] = (True, False, "auto", "selective", "full")

#: How sharded each mode is, for the fine options' rule that the inner units are at least as sharded as the rest of
#: their segment (see [Note: how planning units are chosen]).
SHARDING_RANK: dict[str, int] = {"no_shard": 0, "shard_grad_op": 1, "hybrid_shard": 1, "full_shard": 2}


@dataclass(frozen=True)
class SegmentCandidate:
    """A segment the solver decides: its entry module and its inner-unit candidates (forward order)."""

    entry: str
    inner: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidates:
    """The solver's planning units (see [Note: how planning units are chosen])."""

    segments: tuple[SegmentCandidate, ...]
    tie_groups: tuple[tuple[str, ...], ...]

    @property
    def count(self) -> int:
        """Planning units: segments, their inner units, tied groups and the root."""
        return sum(1 + len(s.inner) for s in self.segments) + len(self.tie_groups) + 1


@dataclass(frozen=True)
class SegmentOption:
    """One way to execute a segment: the decisions it puts in the plan."""

    decisions: tuple[tuple[str, Decision], ...]
    label: str


def _subtree_bytes(info: ModelInfo, name: str) -> int:
    return sum(info.modules[n].param_bytes for n in info.subtree(name))


def _holders(info: ModelInfo) -> set[str]:
    return {h for group in info.tied for h in group}


def planning_units(
    info: ModelInfo,
    *,
    units: Iterable[str] | None = None,
    min_fraction: float = 0.25,
    inner_fraction: float = 0.125,
) -> Candidates:
    """Choose the planning units of a model (see [Note: how planning units are chosen])."""
    holders = _holders(info)
    if units is not None:
        names = [n for n in info.order if n in set(units) and n != ROOT]
        unknown = sorted(set(units) - set(info.modules))
        if unknown:
            raise ValueError(f"units {unknown} are not modules of the profile")
        # Tied holders named together are one list group; a holder named alone stays with the root.
        listed = set(names)
        groups = tuple(
            tuple(sorted(g, key=lambda n: info.pos[n]))
            for g in merged_ties(info.tied)
            if len(g) > 1 and all(h in listed for h in g)
        )
        names = [n for n in names if n not in holders]
        tops = [n for n in names if not any(n != t and info.is_descendant(n, t) for t in names)]
        segments = []
        for t in tops:
            inner = tuple(n for n in names if n != t and info.is_descendant(n, t))
            segments.append(SegmentCandidate(t, inner))
        return Candidates(tuple(segments), groups)

    blocks: list[str] = []
    for name in info.order:
        mp = info.modules[name]
        if mp.type not in ("ModuleList", "Sequential") and not name.endswith(("ModuleList", "Sequential")):
            continue
        for child in info.children[name]:
            if any(info.is_descendant(child, b) for b in blocks):
                continue
            if _subtree_bytes(info, child) > 0:
                blocks.append(child)
    if not blocks:
        # No repeated blocks: descend through single-child wrappers, then take the children as segments.
        node = ROOT
        while True:
            owning = [c for c in info.children[node] if _subtree_bytes(info, c) > 0]
            if len(owning) != 1 or info.params[node]:
                break
            node = owning[0]
        blocks = [c for c in info.children[node] if _subtree_bytes(info, c) > 0] if node != ROOT or owning else []
    # A block holding a tied parameter (with a holder elsewhere) cannot be its own unit; leave it to the root.
    blocks = [b for b in blocks if not any(info.is_descendant(h, b) for h in holders)]
    blocks = [b for b in blocks if not any(b != o and info.is_descendant(b, o) for o in blocks)]
    largest = max((_subtree_bytes(info, b) for b in blocks), default=0)
    threshold = max(min_fraction * largest, 1)
    covered = set(n for b in blocks for n in info.subtree(b))
    extra: list[str] = []
    for name in info.order:
        if name == ROOT or name in covered or name in holders:
            continue
        if any(info.is_descendant(b, name) for b in blocks) or any(info.is_descendant(h, name) for h in holders):
            continue  # contains a block or a tied holder
        if any(info.is_descendant(name, e) for e in extra):
            continue
        if _subtree_bytes(info, name) >= threshold:
            extra.append(name)
    tops = sorted(blocks + extra, key=lambda n: info.pos[n])
    segments = []
    for t in tops:
        total = _subtree_bytes(info, t)
        inner = tuple(
            n
            for n in info.subtree(t)
            if n != t
            and info.splittable(n) > 1
            and n not in holders
            and info.modules[n].param_bytes >= inner_fraction * total
        )
        segments.append(SegmentCandidate(t, inner))
    return Candidates(tuple(segments), _tie_groups(info, tops, threshold))


def _tie_groups(info: ModelInfo, tops: Sequence[str], threshold: float) -> tuple[tuple[str, ...], ...]:
    groups = []
    for group in merged_ties(info.tied):
        members = [h for h in group if h in info.modules]
        if len(members) < 2 or any(any(info.is_descendant(h, t) for t in tops) for h in members):
            continue
        if any(h == ROOT for h in members):
            continue
        if sum(info.modules[h].param_bytes for h in members) >= threshold:
            groups.append(tuple(sorted(members, key=lambda n: info.pos[n])))
    return tuple(groups)


def _split_for(size: float, target: float, splits: Sequence[int], limit: int) -> int:
    allowed = [k for k in splits if k <= limit]
    for k in sorted(allowed):
        if size / k <= target * (1 + 1e-9):
            return k
    return max(allowed, default=1)


def segment_options(
    info: ModelInfo,
    candidate: SegmentCandidate,
    modes: Sequence[str],
    splits: Sequence[int],
    recompute: Recompute = False,
) -> list[SegmentOption]:
    """Every option of a segment (see [Note: how planning units are chosen]); ``splits`` already capped.

    ``recompute``: ``False``, options without recomputation only; ``True`` or ``"full"``, every option recomputes the
    segment fully, ``"selective"`` selectively (when its modules save anything for backward); ``"auto"``, each option
    all three ways (selectively only where the profile measured the segment so: else as ``"full"`` would)."""
    options = _sharding_options(info, candidate, modes, splits)
    saves = any(info.modules[n].activation_bytes > 0 for n in info.subtree(candidate.entry))
    if recompute is False or not saves:
        return options
    measured = info.modules[candidate.entry].selective_kept_bytes is not None
    if recompute is True or recompute == "full" or (recompute == "selective" and not measured):
        return [_recomputing(option, "full") for option in options]
    if recompute == "selective":
        return [_recomputing(option, "selective") for option in options]
    selective = [_recomputing(option, "selective") for option in options] if measured else []
    return [*options, *selective, *[_recomputing(option, "full") for option in options]]


def _recomputing(option: SegmentOption, how: str) -> SegmentOption:
    """``option`` with its segment's module recomputed ``how`` (the entry's decision: its whole forward runs again,
    or its operators but the kept ones)."""
    (entry, first), *rest = option.decisions
    decision = Decision(first.mode, first.split, recompute=how)  # type: ignore[arg-type]
    label = " +recompute" if how == "full" else " +selective"
    return SegmentOption(((entry, decision), *rest), f"{option.label}{label}")


def _sharding_options(
    info: ModelInfo,
    candidate: SegmentCandidate,
    modes: Sequence[str],
    splits: Sequence[int],
) -> list[SegmentOption]:
    """A segment's options of mode and split."""
    entry = candidate.entry
    options: list[SegmentOption] = []
    entry_limit = info.splittable(entry) if entry not in _holders(info) else 1
    for mode in modes:
        for k in splits:
            if k > 1 and mode == "no_shard":
                continue  # slices are gathered one at a time only when sharded: under DDP a split only costs calls
            if k == 1 or k <= entry_limit:
                label = mode if k == 1 else f"{mode} x{k}"
                options.append(SegmentOption(((entry, Decision(mode, k)),), label))
    inner = [n for n in candidate.inner if info.modules[n].param_bytes > 0]
    if not inner:
        return options
    sizes = {n: float(info.modules[n].param_bytes) for n in inner}
    largest = max(sizes.values())
    targets = sorted({largest / k for k in splits}, reverse=True)
    for outer in modes:
        for mode in modes:
            if SHARDING_RANK[mode] < SHARDING_RANK[outer]:
                continue  # big Linears less sharded than the small rest: never saves memory, costs collectives
            if mode == "no_shard":
                continue  # all of it under DDP: the coarse no_shard option, in more units
            seen: set[tuple[int, ...]] = set()
            for target in targets:
                ks = tuple(_split_for(sizes[n], target, splits, info.splittable(n)) for n in inner)
                if ks in seen:
                    continue
                seen.add(ks)
                decisions = [(entry, Decision(outer))] + [
                    (n, Decision(mode, k)) for n, k in zip(inner, ks, strict=True)
                ]
                top_k = max(ks)
                label = f"{outer} | inner {mode}" + (f" x{top_k}" if top_k > 1 else "")
                options.append(SegmentOption(tuple(decisions), label))
    return options
