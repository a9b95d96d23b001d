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

[Note: a forward that mutates state]
Replaying a forward replays its side effects. BatchNorm in training mode updates ``running_mean``, ``running_var``
and ``num_batches_tracked`` in its forward: recomputed as is, the statistics move twice per step (the losses do not
change, evaluation does). Two ways were considered:

* keep such modules out of recomputation (found in the profile by the buffers' version counters): correct, but it
  forbids recomputation in every BatchNorm network, the convolutional models whose activations dominate memory;
* make the recomputation free of side effects on tensor state: chosen. The forward keeps a copy of the values of
  the buffers it mutates from before it ran; the recomputation runs on those values (so that a forward whose output
  reads a buffer it then updates computes the same output again) and ends by putting back the values the forward
  left. Which buffers a forward mutates is learned per module and per training mode: the first call in a mode
  copies all the module's buffers and compares their values after the forward (BatchNorm's kernel updates its
  running statistics without bumping their version counters, so the counters alone miss them); every call also
  adds the buffers whose version counter moved. The copies are of the mutated buffers only (BatchNorm's: two
  vectors and a counter per layer), taken once per call and kept until the recomputation.

The rule is the executor's, so it holds for every plan: the planner's and hand-written ones alike. What it cannot
restore is state outside tensors (a Python counter incremented in ``forward``), or a buffer *reassigned* rather than
updated in place: those side effects run twice, as under ``torch.utils.checkpoint`` itself. The restore keeps the
buffers' version counters (as DDP's buffer broadcast does), so autograd sees no in-place change of a tensor it saved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_osdp._compat import preserve_version_counter

__all__ = ["RecomputedForward", "is_recomputed", "recompute_modules"]


class RecomputedForward:
    """A module's forward run under non-reentrant ``torch.utils.checkpoint`` (see [Note: recomputation inside the
    FSDP2 unit]), its recomputation free of side effects on the module's buffers (see [Note: a forward that mutates
    state]). ``.inner`` is the forward it recomputes, ``.module`` the module it belongs to."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any]) -> None:
        self.module = module
        self.inner = inner
        #: Per training mode (``module.training``), the names of the buffers the module's forward was seen to mutate in
        #: place; a mode is missing until the first call in it.
        self.mutated: dict[bool, frozenset[str]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)  # no graph, nothing to recompute (evaluation)
        if torch.compiler.is_compiling():
            # Traced by dynamo (the module compiled with `module.compile()`): AOTAutograd functionalizes the forward,
            # applies its buffer mutations once and recomputes only pure operators, so the replay has no side effects
            # to undo (see [Note: a forward that mutates state]); dynamo takes no contexts but selective ones.
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
        call = _Call(self)
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=call.contexts, **kwargs)


class _Call:
    """One checkpointed call: the buffer values from before its forward, restored around its recomputation."""

    def __init__(self, owner: RecomputedForward) -> None:
        self.owner = owner
        self.before: dict[str, Tensor] = {}

    def contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        return self._forward(), self._recompute()

    @contextmanager
    def _forward(self) -> Iterator[None]:
        module = self.owner.module
        buffers = dict(module.named_buffers())
        mode = module.training
        known = self.owner.mutated.get(mode)
        watched = buffers if known is None else {n: b for n, b in buffers.items() if n in known}
        self.before = {n: b.detach().clone() for n, b in watched.items()}
        versions = {n: b._version for n, b in buffers.items()}
        yield
        mutated = {n for n, b in buffers.items() if b._version != versions[n]}
        if known is None:
            mutated.update(n for n, b in buffers.items() if not _same(b, self.before[n]))
        self.owner.mutated[mode] = frozenset(mutated) | (known or frozenset())
        self.before = {n: v for n, v in self.before.items() if n in mutated or n in (known or ())}

    @contextmanager
    def _recompute(self) -> Iterator[None]:
        buffers = dict(self.owner.module.named_buffers())
        restore = {n: buffers[n] for n in self.before if n in buffers}
        after = {n: b.detach().clone() for n, b in restore.items()}
        _copy_into(restore, self.before)
        try:
            yield
        finally:
            # Also when torch stops the recomputation early, once it has rebuilt every tensor backward needs.
            _copy_into(restore, after)


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` holds ``b``'s values; fake tensors (an estimated profile) have none to compare: the same."""
    try:
        return bool(torch.equal(a, b))
    except Exception:  # a data-dependent query on fake tensors
        return True


def _copy_into(buffers: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    if not buffers:
        return
    with torch.no_grad(), preserve_version_counter(tuple(buffers.values())):
        for name, buffer in buffers.items():
            buffer.copy_(values[name])


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is checkpointed by :func:`recompute_modules`."""
    return isinstance(module.__dict__.get("forward"), RecomputedForward)


def recompute_modules(root: nn.Module, names: Iterable[str]) -> None:
    """Checkpoint the forward of each module ``names`` names under ``root`` (in place; once per module)."""
    for name in names:
        module = root.get_submodule(name)
        if not is_recomputed(module):
            module.forward = RecomputedForward(module, module.forward)
