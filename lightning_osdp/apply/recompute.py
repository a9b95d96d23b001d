"""Recomputation (activation checkpointing) of planned modules.

[Note: recomputation inside the FSDP2 unit]
A decision with ``recompute=True`` runs its module's forward under non-reentrant ``torch.utils.checkpoint``: the
forward saves only the module's inputs, and backward runs the forward once more to rebuild what it needs (torch
restores the RNG state, so dropout draws the same mask, and the autocast state). The executor makes the module's
*own* ``forward`` the checkpointed function and applies FSDP2 (or DDP) around the module afterwards, the order
torchtitan uses (checkpoint wrapper first, ``fully_shard`` after): FSDP2's hooks fire around the call, the
recomputation in backward calls the bare forward without them, and FSDP2's pre-backward hook has already gathered
the unit's parameters by then. So a recomputed ``full_shard`` unit gathers twice per step, as without
recomputation (``tests/test_recompute.py`` counts the all-gathers). Units nested inside a recomputed module are
different: their own forward hooks do fire in the recomputation, and FSDP2's pre-forward gathers them there
(their pre-backward then finds them gathered).

The checkpointed forward is an attribute of the module instance, not a wrapper module: names in
``named_modules()``, and so plans and state-dict keys, do not change (``CheckpointWrapper`` would add
``_checkpoint_wrapped_module`` to every name below it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["RecomputedForward", "is_recomputed", "recompute_modules"]


class RecomputedForward:
    """A module's forward run under non-reentrant ``torch.utils.checkpoint`` (see [Note: recomputation inside the
    FSDP2 unit]). ``.inner`` is the forward it recomputes."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is checkpointed by :func:`recompute_modules`."""
    return isinstance(module.__dict__.get("forward"), RecomputedForward)


def recompute_modules(root: nn.Module, names: Iterable[str]) -> None:
    """Checkpoint the forward of each module ``names`` names under ``root`` (in place; once per module)."""
    for name in names:
        module = root.get_submodule(name)
        if not is_recomputed(module):
            module.forward = RecomputedForward(module.forward)
