"""Recomputation (activation checkpointing) of planned modules: whole (``"full"``) or per operator (``"selective"``).

[Note: recomputation inside the FSDP2 unit]
A decision with ``recompute="full"`` (or ``True``) runs its module's forward under non-reentrant
``torch.utils.checkpoint``: the forward saves only the module's inputs, and backward runs the forward once more to
rebuild what it needs, up to the last tensor it saves (torch's early stop: ``lightning_osdp/profiling/replay.py``
[Note: the recomputation stops at the last saved tensor]). torch restores the RNG state, so dropout draws the same
mask, and the autocast state. The executor makes the module's *own* ``forward`` the checkpointed function and
applies FSDP2 (or DDP) around the module afterwards, the order torchtitan uses (checkpoint wrapper first,
``fully_shard`` after): FSDP2's hooks fire around the call, the recomputation in backward calls the bare forward
without them, and FSDP2's pre-backward hook has already gathered the unit's parameters by then. So a recomputed
``full_shard`` unit gathers twice per step, as without recomputation (``tests/test_recompute.py`` counts the
all-gathers). Units nested inside a recomputed module are different: their own forward hooks do fire in the
recomputation, and FSDP2's pre-forward gathers them there (their pre-backward then finds them gathered).

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

One such state is common enough to be handled by name: a Hugging Face model's key-value cache. In training its
forward still builds a ``DynamicCache`` (``config.use_cache`` defaults to true) and hands it to every layer, which
appends its keys and values; a recomputed layer appends them again, attends over twice the keys, and backward fails
on the shapes (``tests/test_user_corpus.py``'s GPT-2 did). Hugging Face's own ``gradient_checkpointing_enable`` turns
the cache off in training for this reason; :func:`recompute_modules` does the same (``config.use_cache = False``) for
each Hugging Face model (a module with ``gradient_checkpointing_enable`` and a ``config.use_cache``) that holds a
recomputed module. A training step's loss does not use the cache, so the numbers are those of a run with it; a
``generate`` after training passes ``use_cache=True`` to get it back.

[Note: selective recomputation]
``recompute="selective"`` runs the same checkpoint with torch's per-operator policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): in forward, the outputs of the operators in
:data:`SAVED_OPERATORS` are kept (``MUST_SAVE``), everything else is dropped and recomputed in backward
(``PREFER_RECOMPUTE``); in the recomputation, a kept operator returns its stored output instead of running. The
buffer contexts of [Note: a forward that mutates state] are entered around torch's, so BatchNorm's statistics still
move once per step. A kept output the forward then changes in place (``nn.ReLU(inplace=True)`` right after an
``nn.Linear``) cannot be served to the recomputation (torch refuses it in backward): the forward's end checks the
cache and raises, naming the module, and the profiler offers no selective recomputation for such a block. Everything
else (the FSDP2 hooks around the call, nested units gathered by their own hooks in
the recomputation, the RNG state restored for dropout) is the full recomputation's, since the whole forward's Python
code runs again and only the kept operators' kernels are skipped.

[Note: the operator caches]
Eager selective recomputation runs through OSDP's own pair of dispatch modes (:class:`KeepOutputs` in forward,
:class:`ReplayKept` in the recomputation), not the pair ``create_selective_checkpoint_contexts`` returns, which
dynamo's compiled path still uses. torch's modes number *every* operator of the forward and refuse a recomputation
that runs some operator more often than the forward did ("invocation index ... not found in storage"). A unit nested
in the block (an inner Linear, a split one's slices) has FSDP2's hooks fire inside the checkpointed region, and in
the recomputation they take other paths than in the forward (an all-gather already prefetched, its
``record_function`` ranges): more profiler and copy operators, never a matrix product. Only the kept operators need
matching, so OSDP's modes number those alone, per operator, and every other operator simply runs again. What a
recomputation returns is the same tensors either way (the parity tests check the executor against a reference
checkpointed by hand with torch's modes and the same operator list). As torch's, the forward's mode records each
kept output's version counter, and the forward's end refuses a block that changed one in place.

What is kept, and why: the matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, float8's ``_scaled_mm``), the
fused attention kernels (flash, memory-efficient, cuDNN, the CPU's flash and the overrideable one) and
convolutions. These hold nearly all of a block's FLOPs and their outputs are few: in a Llama block, 7 matrix products
and one attention output against about 20 elementwise and normalisation results (RMSNorm's, SiLU, the gate product,
rotary embeddings, residual adds, dropout masks), which cost memory bandwidth only to recompute. So the replay costs a
few percent of the forward while the saving is most of the block's activations. It is torchtitan's list
(``torchtitan/distributed/activation_checkpoint.py``: ``mm``, the SDPA kernels, ``reduce_scatter_tensor`` and
``max``) with three changes: ``addmm``/``bmm``/``baddbmm`` too (an ``nn.Linear`` with a bias dispatches ``addmm``,
``nn.MultiheadAttention`` and a hand-written attention ``bmm``/``baddbmm``: torchtitan's Llama has neither),
convolutions (the matrix products of a convolutional network: recomputing them would be a full recomputation), and
no ``reduce_scatter_tensor`` (tensor parallelism's, never inside an OSDP unit's forward: FSDP2's collectives run in
its hooks, outside the checkpoint) or ``max`` (float8 scaling, not used here).

A second, more aggressive policy was weighed: torchtitan's published runs also recompute every second ``mm`` of a
block (the 2nd, 4th, ...). On a Llama 3 8B block (width 4,096, MLP 14,336, 8 KV heads) that keeps ``wq``, ``wv``,
``w1``, ``w2`` and drops ``wk``, ``wo``, ``w3``: the matrix-product outputs kept per token fall from 43,008 to 23,552
values (the attention output and the elementwise results are the same), at 36% of the block's matrix-product FLOPs
run again (``wk``, ``wo``, ``w3``: 79 M of 218 M multiply-adds per token). Between the two policies on the memory
axis sits full recomputation of some blocks, which the planner already mixes with selective ones per block; the
half-way policy is not an option of the plan (one more per unit), see docs/how-it-works.md.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_osdp._compat import (
    TorchDispatchMode,
    detach_sharing_version,
    preserve_version_counter,
    tree_leaves,
    tree_map,
)
from lightning_osdp.errors import PlanError

__all__ = [
    "SAVED_OPERATORS",
    "KeepOutputs",
    "RecomputedForward",
    "ReplayKept",
    "is_recomputed",
    "recomputation_of",
    "recompute_modules",
    "selective_contexts",
    "selective_policy",
]

_aten = torch.ops.aten

#: The operators whose outputs selective recomputation keeps (see [Note: selective recomputation]); an overload a
#: torch build lacks is left out.
SAVED_OPERATORS: frozenset[Any] = frozenset(
    getattr(_aten, packet).default
    for packet in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, packet)
)


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The per-operator policy of ``recompute="selective"``: keep the outputs of :data:`SAVED_OPERATORS`, recompute
    every other operator (a ``policy_fn`` of ``torch.utils.checkpoint.create_selective_checkpoint_contexts``)."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPERATORS else CheckpointPolicy.PREFER_RECOMPUTE


#: The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` that applies :func:`selective_policy`: what a user
#: writes by hand to checkpoint a module as ``recompute="selective"`` does.
selective_contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)


class RecomputedForward:
    """A module's forward run under non-reentrant ``torch.utils.checkpoint`` (see [Note: recomputation inside the
    FSDP2 unit]), wholly or selectively (``selective``, see [Note: selective recomputation]), its recomputation free
    of side effects on the module's buffers (see [Note: a forward that mutates state]). ``.inner`` is the forward it
    recomputes, ``.module`` the module it belongs to."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any], selective: bool = False, name: str = "") -> None:
        self.module = module
        self.inner = inner
        self.selective = selective
        self.name = name
        #: Selective only: what a forward was seen to change in place of what it keeps (see [Note: selective
        #: recomputation]); with ``strict`` (the default) the forward raises instead.
        self.mutated_kept: list[str] = []
        self.strict = True
        #: Per training mode (``module.training``), the names of the buffers the module's forward was seen to mutate in
        #: place; a mode is missing until the first call in it.
        self.mutated: dict[bool, frozenset[str]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)  # no graph, nothing to recompute (evaluation)
        if torch.compiler.is_compiling():
            # Traced by dynamo (the module compiled with `module.compile()`): AOTAutograd functionalizes the forward,
            # applies its buffer mutations once and recomputes only pure operators, so the replay has no side effects
            # to undo (see [Note: a forward that mutates state]); dynamo takes no contexts but selective ones, as
            # `create_selective_checkpoint_contexts` returns them.
            if self.selective:
                return checkpoint(self.inner, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
        call = _Call(self)
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=call.contexts, **kwargs)


class _Call:
    """One checkpointed call: the buffer values from before its forward, restored around its recomputation."""

    def __init__(self, owner: RecomputedForward) -> None:
        self.owner = owner
        self.before: dict[str, Tensor] = {}

    def contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        if not self.owner.selective:
            return self._forward(), self._recompute()
        keep = KeepOutputs()
        return self._selective_forward(keep), _entered(self._recompute(), ReplayKept(keep))

    @contextmanager
    def _selective_forward(self, keep: KeepOutputs) -> Iterator[None]:
        with self._forward(), keep:
            yield
        mutated = keep.mutated()
        if not mutated:
            return
        self.owner.mutated_kept = sorted(set(self.owner.mutated_kept) | set(mutated))
        if self.owner.strict:
            raise PlanError(
                f"module {self.owner.name!r}: selective recomputation keeps the output of {', '.join(mutated)}, and "
                "the module's forward then changes it in place (an in-place operator on a matrix product's output, "
                "such as nn.ReLU(inplace=True) after an nn.Linear, or `+=`), which the recomputation cannot replay; "
                "recompute the module fully (recompute='full'), or make that operator out of place"
            )

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


class KeepOutputs(TorchDispatchMode):
    """The forward's side of selective recomputation: runs every operator, and keeps the outputs of
    :data:`SAVED_OPERATORS` (detached, with their version counters) in call order per operator (see [Note: the
    operator caches])."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[Any, deque[tuple[Any, list[tuple[Tensor, int]]]]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPERATORS:
            kept = tree_map(lambda t: detach_sharing_version(t) if isinstance(t, Tensor) else t, out)
            versions = [(t, t._version) for t in tree_leaves(kept) if isinstance(t, Tensor)]
            self.kept.setdefault(func, deque()).append((kept, versions))
        return out

    def mutated(self) -> list[str]:
        """The kept operators whose outputs were changed in place since they ran."""
        return sorted(
            {str(func) for func, calls in self.kept.items() for _, vs in calls if any(t._version != v for t, v in vs)}
        )


class ReplayKept(TorchDispatchMode):
    """The recomputation's side: a kept operator returns what its forward call returned (the n-th call of each
    operator the n-th kept output), every other operator runs again."""

    def __init__(self, keep: KeepOutputs) -> None:
        super().__init__()
        self.keep = keep

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        calls = self.keep.kept.get(func) if func in SAVED_OPERATORS else None
        if not calls:
            return func(*args, **(kwargs or {}))
        kept, versions = calls.popleft()
        if any(t._version != v for t, v in versions):
            raise RuntimeError(
                f"an output of {func} kept for selective recomputation was changed in place after its forward"
            )
        return kept


@contextmanager
def _entered(*contexts: AbstractContextManager[Any]) -> Iterator[None]:
    """The ``contexts`` entered in order (the buffers' first, then torch's dispatch mode) and left in reverse."""
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


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
    """Whether ``module``'s forward is checkpointed (wholly or selectively) by :func:`recompute_modules`."""
    return isinstance(module.__dict__.get("forward"), RecomputedForward)


def recomputation_of(module: nn.Module) -> str:
    """How :func:`recompute_modules` checkpointed ``module``'s forward: ``"none"``, ``"selective"`` or ``"full"``."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, RecomputedForward):
        return "none"
    return "selective" if forward.selective else "full"


def recompute_modules(root: nn.Module, names: Iterable[str] | Mapping[str, str], how: str = "full") -> None:
    """Checkpoint the forward of each module ``names`` names under ``root`` (in place; once per module), ``how``
    (``"full"`` or ``"selective"``) or, when ``names`` maps names to one of those, as it says. A module already
    checkpointed is switched to the new way (the profiler measures both on one replica)."""
    items = list(names.items() if isinstance(names, Mapping) else ((name, how) for name in names))
    _disable_kv_caches(root, [name for name, _ in items])
    for name, way in items:
        if way not in ("full", "selective"):
            raise ValueError(f"module {name!r}: recomputation must be 'full' or 'selective', got {way!r}")
        module = root.get_submodule(name)
        forward = module.__dict__.get("forward")
        if isinstance(forward, RecomputedForward):
            forward.selective = way == "selective"
        else:
            module.forward = RecomputedForward(module, module.forward, selective=way == "selective", name=name)


def _disable_kv_caches(root: nn.Module, names: list[str]) -> None:
    """Turn off the key-value cache of every Hugging Face model that holds a recomputed module (see [Note: a forward
    that mutates state]: the cache is state outside tensors that a replay would extend twice)."""
    for prefix, model in root.named_modules():
        config = getattr(model, "config", None)
        if not (hasattr(model, "gradient_checkpointing_enable") and getattr(config, "use_cache", False)):
            continue
        if config is not None and any(
            prefix == "" or name == prefix or name.startswith(prefix + ".") for name in names
        ):
            config.use_cache = False
