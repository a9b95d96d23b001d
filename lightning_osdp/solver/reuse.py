"""Planning problems reused within a scope: a problem built once for a profile serves every solve on it.

[Note: what a planning problem reuses]
:class:`~lightning_osdp.solver.PlanningProblem` is a pure function of its arguments (the profile, the ranks, the
modes, splits, units, cost-model constants and recomputation): the layout, every segment option simulated, the
timeline's input. Nothing changes it once built (the solves read it; ``build`` and the phases make their own
copies). So within :func:`reusing_problems` a problem is kept under a key made of *all* its arguments, the profile by
a digest of its pickle (every figure of every module; 2 ms for an 80-layer GPT's 812 modules, where its JSON
document took 90 ms), and a second problem with an equal key takes the first one's state instead of simulating every
segment again. An equal key is an equal problem, so a reused problem is never stale: a profile changed in any figure
(another batch size: its activations and compute) is another key. (Equal profiles whose pickles differ, say by the
order of a dict, are only another key: a problem built again, never a wrong one.)

``osdp plan`` solves one profile several times: the plan at the requested batch size, again under a lower budget
when its device total exceeds the card (``PlannerOptions.plan``'s [Note: the plan within the card]), the batch
search's probe at that size, and the same again at the largest batch found. Outside the scope nothing is kept (a
strategy plans once; a cache without an end would hold every profile a long process planned).

Why a probe at another batch size cannot reuse the segment simulations themselves: only the parameters', gradients'
and optimizer state's bytes of a segment do not depend on the batch, and a simulation's figures are the largest
instants of its walk, sums of those bytes and of activations (which grow with the batch) taken at the largest total:
which instant is largest, and so each figure, changes with the batch. What the batch search carries from one size to
the next instead is the plans its probes found (``cli/batch_search.py``'s [Note: what one probe tells the next]).
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

from lightning_osdp.profiling.model_profile import ModelProfile

__all__ = ["known_problem", "problem_key", "profile_digest", "remember_problem", "reusing_problems"]

#: The problems kept in the innermost open scope, by key (``None``: no scope is open).
_kept: OrderedDict[Hashable, Any] | None = None
#: How many problems a scope keeps (the oldest go first): a profile's solves come one after another.
_KEPT = 4


@contextlib.contextmanager
def reusing_problems() -> Iterator[None]:
    """Within the block, a :class:`~lightning_osdp.solver.PlanningProblem` built with arguments equal to an earlier
    one's reuses it (see [Note: what a planning problem reuses]); nested blocks share the outer one's problems."""
    global _kept
    if _kept is not None:
        yield
        return
    _kept = OrderedDict()
    try:
        yield
    finally:
        _kept = None


def profile_digest(profile: ModelProfile) -> str | None:
    """A digest of every figure of ``profile`` (of its pickle); ``None`` when it cannot be pickled."""
    try:
        document = pickle.dumps(profile, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    return hashlib.blake2b(document, digest_size=20).hexdigest()


def problem_key(
    profile: ModelProfile,
    topology: Hashable,
    *,
    modes: Sequence[str],
    splits: Sequence[int],
    units: Iterable[str] | None,
    config: Any,
    recompute: Any,
) -> Hashable | None:
    """The key of a problem of these arguments, or ``None`` (nothing kept) outside :func:`reusing_problems` or for
    a profile that cannot be pickled."""
    digest = None if _kept is None else profile_digest(profile)
    if digest is None:
        return None
    return (
        digest,
        topology,
        tuple(modes),
        tuple(splits),
        None if units is None else tuple(units),
        repr(config),
        repr(recompute),
    )


def known_problem(key: Hashable | None) -> Any:
    """The problem kept under ``key``, or ``None``."""
    if key is None or _kept is None or key not in _kept:
        return None
    _kept.move_to_end(key)
    return _kept[key]


def remember_problem(key: Hashable | None, problem: Any) -> None:
    """Keep ``problem`` under ``key`` in the open scope (nothing outside one)."""
    if key is None or _kept is None:
        return
    _kept[key] = problem
    while len(_kept) > _KEPT:
        _kept.popitem(last=False)
