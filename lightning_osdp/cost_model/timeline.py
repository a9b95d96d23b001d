"""The memory timeline of one training step, built once for the predictor and the solver.

[Note: one timeline, two backends]
The timeline is written against a small :class:`Backend`: ``const``/``choice`` make values, ``checkpoint`` says
"the memory at this instant is ``value``", ``materialize`` names a running level. :func:`build_timeline` walks
the step (forward, loss, backward, final reductions, optimizer step) once. The predictor runs it with numbers
(one option per choice, so every value is a :class:`~lightning_osdp.cost_model.parts.MemoryParts`) and takes
the largest checkpoint; the solver runs it with linear expressions over its option binaries and turns every
checkpoint into a constraint ``value <= budget``. Both therefore apply exactly the same rules, and the solver's
predicted peak *is* the predictor's peak of the plan it returns.

[Note: pending buffers across DDP segments]
FSDP2 keeps a unit's forward all-gather output until the next FSDP2 unit gathers (or the root's post-forward,
after the loss), and a reduce-scatter input until the next reduction. ``no_shard`` units are DDP's, not FSDP2's:
they free neither, so after a segment whose option is ``no_shard`` the buffer pending is one an *earlier* segment
left, which depends on the options of every segment back to the last sharded one: a product of choices. Exactly
linearised (McCormick), that made CBC an order of magnitude slower (300 planning units past its time limit). The
model therefore takes, after such a segment, the largest buffer any earlier segment could leave (its parameters as
one sharded unit: a constant; the root and tied groups likewise): conservative by the difference, exact for
Transformer blocks sharded whole. A plan that shards nothing has no FSDP2 buffer at all (``any_sharded``).

Within a segment every event depends on that segment's option only, so each segment is simulated once per
option (:class:`SegmentSimulator`, one method per FSDP2 event) and summarised by its largest checkpoint in each
*class*: which of the buffers owned by *another* segment are alive at that instant (the all-gather output still
pending from the previous unit in forward; in backward, the reduce-scatter input pending from the later unit, and
the all-gather output this segment prefetches for the earlier one). A class an option never enters gets a value
that makes its constraint implied by the segment's first instant (a real state), so it never binds.

[Note: recomputation]
A module whose decision recomputes runs its forward under non-reentrant ``torch.utils.checkpoint``
(``lightning_osdp/apply/recompute.py``). In forward it keeps only its inputs (``Node.kept``: the profile's measured
input bytes) instead of what its subtree saves. In backward, after its unit's pre-backward (the gather FSDP2 would
run anyway), the first saved tensor it needs runs the forward again: its subtree saves everything again at once
(``Node.saved()``, less the inputs the checkpoint kept and the recomputation saves again, ``kept_saved``), full_shard
units nested in it are gathered by their own pre-forward hooks there, and the backward then frees the activations
module by module as without recomputation; the kept inputs go when its backward ends. The step pays the subtree's
forward seconds once more, up to the last tensor it saves (torch stops the recomputation there:
``ModuleProfile.recompute_replay_seconds``, ``lightning_osdp/profiling/replay.py``).

A module recomputed *selectively* (``recompute="selective"``) keeps, beyond its inputs, the outputs of its kept
operators (``Node.selective``, measured per block: ``ModuleProfile.selective_kept_bytes``) from the end of its
forward to its backward; the recomputation in backward rebuilds the rest (``saved() - kept_saved - selective``), so
from there its backward is the full recomputation's, and the step pays its replay's seconds
(``selective_replay_seconds``) instead of the subtree's forward seconds.

A nested ``full_shard`` unit may have been prefetched before the recomputation gathers it: FSDP2's backward prefetch
targets the unit whose forward ended just before the current one's, and a nested unit's forward ends before its
enclosing unit's (or, when it is the last unit of its segment, before the later segment's first). Its pre-forward in
the recomputation then finds the all-gather issued (``FSDPParamGroup.unshard`` returns at once) and only copies out:
one all-gather output, not a second. And a unit the recomputation gathered stays unsharded until its post-backward
(a post-forward in backward does not reshard), so a later prefetch of it is FSDP2's no-op ``unshard`` and allocates
nothing. Counting that output twice would leave it in the level for the rest of the step: every ``shard_grad_op``
block that recomputes with its MLP ``full_shard`` would add one MLP's all-gather output to the backward peak
(``tests/test_segment_memory.py`` measures such blocks).

[Note: the loss in the timeline]
The profile measures the loss region (``lightning_osdp/profiling/loss_region.py``) as live bytes relative to three
instants, and each falls at one place of the walk (``LossMemory``'s fields: ``o`` the model's output, ``f`` the
forward peak, ``s`` what backward starts with, ``b`` the backward peak, ``e`` what the first module's backward
finds, ``x`` activations saved outside modules before the region):

* *the model's last call returned*: the end of the forward walk, whose last instant is the level plus the last
  module's output, before the root reshards. The ``loss`` instant is there: ``level + pending + x + o + f``;
* *backward starts*: after the root's post-forward (it reshards) and Lightning's ``zero_grad`` (the previous step's
  gradients go), and after the root's pre-backward, which gathers the root again and prefetches the unit whose
  forward ended last (a tied embedding/LM-head group, else the last segment's). The ``loss backward`` instant is
  there: ``level + prefetch + x + o + s + b``. A tied group's own pre-backward runs on its last holder's output
  gradient, so after the loss's backward;
* *the first module's backward runs*: the walk's first backward instant, which counts that module's output
  gradient (``node.out``) itself. What the region leaves beyond it, ``x + s + e`` (the logits a returned dict keeps,
  activations saved outside modules), stays in the level for the rest of the step: held by the step's output until
  after the optimizer step, or freed late in backward, which the walk takes as the end of the step (an upper
  bound).

A profile from before the region was measured (``loss`` is ``None``) keeps the rule it was made with:
``extra_activation_bytes`` plus the last module's output at both instants, and nothing after.

The figures reach the walk on the root unit (``LocalUnit.outside``), which every backend builds with
``global_unit``: the root's forward is the whole ``training_step`` (``apply/executor.py``), loss included. So does
``ModelProfile.measured_peak_correction``, held from the step's start to its end (counted as activations: what a
run allocated beyond the model's figures), so that every instant, and so the peak wherever it falls, carries it.

[Note: gradient accumulation]
A step of ``accumulate_grad_batches = k > 1`` runs k forward-backward passes before one optimizer step, with no
gradient reduction before the last (``OSDPStrategy.block_backward_sync``: DDP's ``no_sync``, FSDP2 without gradient
sync): each unit keeps its *unsharded* gradients from the first micro-batch's backward to the last one's, whatever
its mode. The walk models one micro-batch, so micro-batches 2 to k are that walk with every unit's whole gradient
held from its start (``OutsideModules.held_gradients``, the profile's gradient bytes), on top of what it counts. The
gradients the last micro-batch produces are then counted once more where the walk produces them, although autograd
adds them into the held ones: an upper bound by one backward's transient gradients, not a miss (a litgpt model
accumulating 2 micro-batches measured its peak one whole gradient above the walk without this).
The step's time is k micro-batches': every module's forward, backward and recomputation k times
(``ModelInfo.modules``), and each unit's all-gathers and hooks k times, but its gradient reduction and the optimizer
step once (``structure.unit_time``); the loop's own time per micro-batch (``config.loop_seconds``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from lightning_osdp.cost_model.parts import ZERO, MemoryParts
from lightning_osdp.cost_model.structure import FreeRun, LocalUnit, Node, OutsideModules, Segment

__all__ = [
    "PHASES",
    "Backend",
    "FreeCosts",
    "GlobalChoice",
    "SegmentChoice",
    "SegmentCosts",
    "SegmentSimulator",
    "build_timeline",
    "phase_of",
    "simulate_free",
    "simulate_segment",
]

V = TypeVar("V")
Option = Hashable

#: Backward checkpoint classes: (reduce-scatter input of a later segment alive, prefetched all-gather output of an
#: earlier segment alive).
BWD_CLASSES: tuple[tuple[bool, bool], ...] = ((True, False), (True, True), (False, False), (False, True))


def _params(n: int) -> MemoryParts:
    return MemoryParts(parameters=n)


def _grads(n: int) -> MemoryParts:
    return MemoryParts(gradients=n)


def _acts(n: int) -> MemoryParts:
    return MemoryParts(activations=n)


def _gathered(n: int) -> MemoryParts:
    return MemoryParts(gathered_parameters=n)


def _comm(n: int) -> MemoryParts:
    return MemoryParts(communication_buffers=n)


def _max(a: MemoryParts | None, b: MemoryParts) -> MemoryParts:
    return b if a is None or b.total > a.total else a


@dataclass(frozen=True)
class SegmentCosts:
    """One segment under one option, relative to the running level (see [Note: one timeline, two backends]).

    Attributes:
        fwd_pending: largest forward checkpoint while the previous unit's all-gather output is still pending.
        fwd_after: largest forward checkpoint after the segment's first gather freed it.
        frees_pending: whether any unit of the segment gathers (and so frees the pending output).
        fwd_net: level change over the forward (activations, parameters kept gathered), pending buffer apart.
        pending: the all-gather output left pending when the segment's forward ends.
        prefetched: the all-gather output of this segment's last-post-forward unit, when it is ``full_shard``:
            the next segment (in forward order) prefetches it in backward.
        bwd: largest backward checkpoint per class (see ``BWD_CLASSES``); ``None`` when the class never occurs.
        frees_reduce_input: whether a reduction runs in the segment's backward (freeing the pending input).
        bwd_net: level change over the backward (pending reduce-scatter input apart).
        reduce_input: the reduce-scatter input left pending at the end of the segment's backward.
        final_peak, final_net, final_reduce_input, has_final: the same for the reductions deferred to the
            root's final callback (units whose input needs no gradient).
        persistent: parameters and optimizer state, held for the whole step.
        grads: sharded gradients (held at the step's start from the previous step, and after backward).
        optimizer_temp: the optimizer step's temporaries for the largest local parameter.
        seconds: what the segment's units add to the step time.
        units: the units, for reports.
    """

    fwd_pending: MemoryParts | None
    fwd_after: MemoryParts | None
    frees_pending: bool
    fwd_net: MemoryParts
    pending: MemoryParts
    prefetched: MemoryParts
    bwd: dict[tuple[bool, bool], MemoryParts | None]
    frees_reduce_input: bool
    bwd_net: MemoryParts
    reduce_input: MemoryParts
    final_peak: MemoryParts | None
    final_net: MemoryParts
    final_reduce_input: MemoryParts
    has_final: bool
    persistent: MemoryParts
    grads: MemoryParts
    optimizer_temp: MemoryParts
    seconds: float
    units: tuple[LocalUnit, ...]
    buckets: MemoryParts = ZERO


def _order_by_post_forward(node: Node, out: list[int]) -> None:
    for child in node.children:
        _order_by_post_forward(child, out)
    if node.unit is not None:
        out.append(node.unit)


class SegmentSimulator:
    """One segment under one option through one training step, event by event, in FSDP2's order.

    Read it beside torch's ``FSDPParamGroup`` (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``): one
    method per event of a unit's life, called where FSDP2's hooks fire as :meth:`forward` and :meth:`backward`
    walk the segment's modules.

    - :meth:`pre_forward`: ``unshard`` (all-gather into its output buffer), ``wait_for_unshard`` (copy out into
      the unsharded parameters, free the output kept for the previous unit);
    - :meth:`post_forward`: ``reshard`` (``full_shard`` only; on CPU the all-gather output is freed too);
    - :meth:`pre_backward`: ``unshard`` unless prefetched, then ``_backward_prefetch`` of the unit that finished
      its forward before this one (nothing for one still unsharded: ``shard_grad_op``, or gathered by a
      recomputation), with the output's gradient alive;
    - :meth:`post_backward`: ``reshard``, then the reduce-scatter (its input kept until the next reduction);
    - :meth:`final_callback`: the post-backwards FSDP2 runs in the root's final callback
      (``FSDPState._root_post_backward_final_callback``) for units whose input needs no gradient (see
      ``LocalUnit.deferred``), whose autograd hook therefore never fired.

    ``no_shard`` units are DDP's: no FSDP2 event of theirs runs (each method returns at once), and DDP's gradient
    hook is modelled where the gradient is produced (:meth:`backward`). Each pass (forward, backward, final
    callback) counts ``level`` from zero, relative to the running level the timeline adds it to (see
    :class:`SegmentCosts`), and records every instant in its *class*: which buffers owned by another segment are
    alive then (see [Note: pending buffers across DDP segments]). One simulator runs once (:meth:`run`).

    Args:
        segment: the segment's module tree and its units under the option.
        release_after_forward: a sharded unit's all-gather buffer is freed when its forward ends (CPU, see
            ``lightning_osdp/comm.py``), not kept for the next unit's gather.
    """

    def __init__(self, segment: Segment, *, release_after_forward: bool = False) -> None:
        self.segment = segment
        self.units = segment.units
        self.bytes = [u.bytes for u in segment.units]
        self.release_after_forward = release_after_forward
        self.level = ZERO
        # Forward: the all-gather output the previous unit (another segment's) left pending is alive until this
        # segment's first gather; then this segment's own, owned by the unit that gathered last.
        self.previous_output_alive = True
        self.all_gather_output = ZERO
        self.all_gather_owner: int | None = None
        self.frees_previous_output = False
        #: largest forward instant while the previous output is alive (the segment's first instant is a real
        #: state of this class) and after it is freed
        self.fwd_peaks: dict[bool, MemoryParts | None] = {True: ZERO, False: None}
        # Backward: the reduce-scatter input a later segment left pending is alive until this segment's first
        # reduction; the all-gather output prefetched for the earlier segment is alive from the first unit's
        # pre-backward.
        self.later_reduce_input_alive = True
        self.earlier_prefetch_alive = False
        self.reduce_scatter_input = ZERO
        self.reduced = False
        self.bwd_peaks: dict[tuple[bool, bool], MemoryParts | None] = {c: None for c in BWD_CLASSES}
        self.bwd_peaks[(True, False)] = ZERO
        #: FSDP2's ``post_forward_order`` within the segment (sharded units only: DDP's are not FSDP2's)
        self.post_forward_order: list[int] = []
        #: units whose all-gather output has been issued by a prefetch and not yet consumed
        self.prefetched: set[int] = set()
        #: units gathered by their pre-forward in an enclosing module's recomputation
        self.gathered_in_recompute: set[int] = set()

    # ------------------------------------------------------------------ instants
    def _forward_instant(self, value: MemoryParts) -> None:
        key = self.previous_output_alive
        self.fwd_peaks[key] = _max(self.fwd_peaks[key], value)

    def _backward_instant(self, value: MemoryParts) -> None:
        key = (self.later_reduce_input_alive, self.earlier_prefetch_alive)
        self.bwd_peaks[key] = _max(self.bwd_peaks[key], value)

    def _gather_in_backward(self, i: int, output_gradient: MemoryParts) -> None:
        """Unit ``i`` gathered again in backward (beside ``output_gradient``): a prefetched unit's all-gather output
        is counted already and only its copy-out is left; otherwise the all-gather buffer and the unsharded
        parameters are both alive until the copy-out ends."""
        u = self.bytes[i]
        if i in self.prefetched:
            self.prefetched.discard(i)
            self.level += _gathered(u.gathered)
        else:
            self.level += _comm(u.flat) + _gathered(u.gathered)
        self._backward_instant(self.level + output_gradient)
        self.level -= _comm(u.flat)

    # ------------------------------------------------------------------ FSDP2 events
    def pre_forward(self, i: int) -> None:
        """``unshard`` and ``wait_for_unshard`` of unit ``i``."""
        u = self.bytes[i]
        if not u.sharded:
            return  # DDP's parameters: no FSDP2 hook runs, the pending all-gather output stays
        self.level += _comm(u.flat)
        self._forward_instant(self.level)
        # Every gather frees the output kept for the previous one (FSDP2's AllGatherState); the root's
        # post-forward frees the last one, after the loss.
        if self.previous_output_alive:
            self.previous_output_alive = False
            self.frees_previous_output = True
        else:
            self.level -= self.all_gather_output
        self.level += _gathered(u.gathered)
        self._forward_instant(self.level)
        self.all_gather_output, self.all_gather_owner = _comm(u.flat), i

    def post_forward(self, i: int) -> None:
        """``reshard`` of unit ``i`` (``full_shard`` and ``hybrid_shard`` only), and on CPU the release of its
        all-gather output."""
        u = self.bytes[i]
        if u.reshards_after_forward:
            self.level -= _gathered(u.gathered)
        if u.sharded and self.release_after_forward and self.all_gather_owner == i:
            # The unit's own buffer, if a nested unit's gather has not freed it already.
            self.level -= self.all_gather_output
            self.all_gather_output, self.all_gather_owner = ZERO, None

    def pre_backward(self, i: int, output_gradient: MemoryParts = ZERO) -> None:
        """``unshard`` of unit ``i`` (when prefetched, its all-gather was issued already: only the copy-out is
        left), then ``_backward_prefetch``. The hook fires on the gradient of the unit's output
        (``output_gradient``), which is alive through both."""
        u = self.bytes[i]
        if not u.sharded:
            return
        if u.reshards_after_forward and i in self.gathered_in_recompute:
            pass  # gathered by its pre-forward in an enclosing module's recomputation
        elif u.reshards_after_forward:
            self._gather_in_backward(i, output_gradient)
        # Implicit backward prefetch: the unit that finished its forward just before this one.
        k = self.post_forward_order.index(i)
        if k == 0:
            self.earlier_prefetch_alive = True  # the earlier segment's last unit (the timeline's cross term)
            self._backward_instant(self.level + output_gradient)
            return
        target = self.post_forward_order[k - 1]
        # A shard_grad_op target, or one its enclosing module's recomputation gathered, is unsharded: FSDP2's
        # ``unshard`` of it returns at once.
        unsharded = not self.bytes[target].reshards_after_forward or target in self.gathered_in_recompute
        if not unsharded and target not in self.prefetched:
            self.prefetched.add(target)
            self.level += _comm(self.bytes[target].flat)
            self._backward_instant(self.level + output_gradient)

    def post_backward(self, i: int) -> None:
        """``reshard`` of unit ``i``, then its reduce-scatter (freeing the previous reduction's input)."""
        u = self.bytes[i]
        if not u.sharded:
            return  # DDP copied each gradient into its bucket as it was produced (see `backward`)
        self.level -= _gathered(u.gathered)
        if self.later_reduce_input_alive:
            self.later_reduce_input_alive = False
            self.reduced = True
        else:
            self.level -= self.reduce_scatter_input
        if u.trainable:
            self.level += _comm(u.reduce_input)
            self._backward_instant(self.level)
            self.level += _grads(u.grad - u.grad_full)
            self._backward_instant(self.level)
            self.reduce_scatter_input = _comm(u.reduce_input)
        else:
            self.reduce_scatter_input = ZERO

    def final_callback(self) -> tuple[MemoryParts | None, MemoryParts, MemoryParts]:
        """The post-backwards deferred to the root's final callback (reshard, reduce-scatter), one after another
        by module name: their largest instant, the level change and the reduce-scatter input left, counted from
        zero."""
        self.level = ZERO
        peak: MemoryParts | None = None
        reduce_input = ZERO
        for n, i in enumerate([i for i in self._deferred() if self.bytes[i].sharded]):
            u = self.bytes[i]
            self.level -= _gathered(u.gathered)
            if n:
                self.level -= reduce_input
            if u.trainable:
                self.level += _comm(u.reduce_input)
                peak = _max(peak, self.level)
                self.level += _grads(u.grad - u.grad_full)
                peak = _max(peak, self.level)
                reduce_input = _comm(u.reduce_input)
            else:
                reduce_input = ZERO
        return peak, self.level - reduce_input, reduce_input

    # ------------------------------------------------------------------ the passes
    def forward(self, node: Node, saving: bool = True) -> None:
        """``node``'s forward: its unit's pre-forward, its activations, its children, its output, post-forward.

        ``saving``: whether what the module saves for backward is kept; inside a recomputed module it is not, only
        the recomputed module's inputs are (see [Note: recomputation])."""
        if node.unit is not None:
            self.pre_forward(node.unit)
        start = self.level
        checkpointed = node.recompute and saving
        if checkpointed:
            self.level += _acts(node.kept)
            saving = False
        if saving:
            self.level += _acts(node.act)
        for child in node.children:
            self.forward(child, saving)
        # Unsaved, what the module would save still lives while its own code runs.
        self._forward_instant(self.level + _acts(node.out + (0 if saving else node.act)))
        if saving and node.fwd_peak is not None:
            # Its own code's temporaries beside what it saves, measured (ModuleProfile.forward_peak_bytes).
            self._forward_instant(start + _acts(node.fwd_peak))
        transient = node.recompute_forward if node.selective is None else node.selective_forward
        if checkpointed and transient is not None:
            # What the checkpointed forward holds at once, measured (its own code's tensors between its children's
            # calls are beyond the children's figures; under selective recomputation, the kept outputs with them).
            self._forward_instant(self.level + _acts(transient))
        if checkpointed and node.selective is not None:
            # Selective: the kept operators' outputs stay until the block's backward (see [Note: recomputation]).
            self.level += _acts(node.selective)
        if node.unit is not None:
            self.post_forward(node.unit)

    def recompute(self, node: Node) -> None:
        """The forward ``torch.utils.checkpoint`` runs again in backward when ``node``'s first saved tensor is needed
        (see [Note: recomputation]): its subtree saves again what it saved (what it kept of its inputs is alive
        already), and the units nested in it are gathered by their own pre-forward hooks, which fire in the
        recomputation (their pre-backward then finds them gathered). A nested unit already prefetched (by its
        enclosing unit's pre-backward, or by the later segment's) has its all-gather output counted: its pre-forward
        only copies out."""
        output_gradient = _acts(node.out)  # what the recomputation was triggered for
        for i in self._nested_full_shard_units(node):
            self._gather_in_backward(i, output_gradient)
            self.gathered_in_recompute.add(i)
        self.level += _acts(node.saved() - node.kept_saved - (node.selective or 0))
        self._backward_instant(self.level + output_gradient)

    def _nested_full_shard_units(self, node: Node) -> list[int]:
        found: list[int] = []
        stack = list(node.children)
        while stack:
            child = stack.pop()
            if child.unit is not None and self.bytes[child.unit].reshards_after_forward:
                found.append(child.unit)
            if not child.recompute:  # a nested recomputed module is run again (and gathers) in its own backward
                stack.extend(child.children)
        return found

    def start_backward(self) -> MemoryParts:
        """Restart the level for the backward; returns what this segment's last unit leaves for the next segment to
        prefetch (its all-gather output, when ``full_shard``)."""
        order: list[int] = []
        _order_by_post_forward(self.segment.root, order)
        # FSDP2 prefetches in backward the FSDP2 unit that finished its forward before the current one: DDP's units
        # (no_shard) are not among them.
        self.post_forward_order = [i for i in order if self.bytes[i].sharded]
        # Relative to the level at the segment's start, which holds this segment's activations, the parameters its
        # no_shard/shard_grad_op units kept gathered, and its last unit's all-gather output (prefetched by the next).
        self.level = ZERO
        last = self.post_forward_order[-1] if self.post_forward_order else None
        if last is not None and self.bytes[last].reshards_after_forward:
            self.prefetched.add(last)
            return _comm(self.bytes[last].flat)
        return ZERO

    def backward(self, node: Node, ddp: bool) -> None:
        """``node``'s backward: its unit's pre-backward, its children in reverse, its gradients, post-backward.
        ``ddp``: the parameters are DDP's, whose hook copies each gradient into its bucket and drops it."""
        if node.unit is not None:
            ddp = not self.bytes[node.unit].sharded
            self.pre_backward(node.unit, _acts(node.out))
        if node.recompute:
            self.recompute(node)
        for child in reversed(node.children):
            self.backward(child, ddp)
        self.level += _grads(node.grad)
        transient = node.out + max(node.inp if not node.children else 0, node.bwd_extra)
        self._backward_instant(self.level + _acts(transient) + _grads(node.grad_sum))
        if ddp:
            self.level -= _grads(node.grad)
        self.level -= _acts(node.act)
        if node.recompute:
            self.level -= _acts(node.kept - node.kept_saved)  # the checkpoint's inputs, freed with its graph
        if node.unit is not None and not self.units[node.unit].deferred:
            self.post_backward(node.unit)

    def _deferred(self) -> list[int]:
        units = self.units
        return [i for i in sorted(range(len(units)), key=lambda j: units[j].names) if units[i].deferred]

    def run(self, optimizer_temporaries: float) -> SegmentCosts:
        """The whole step: forward, backward, final callback; the segment's figures under its option."""
        self.forward(self.segment.root)
        fwd_net = self.level - self.all_gather_output
        pending = self.all_gather_output
        prefetched = self.start_backward()
        self.backward(self.segment.root, False)
        bwd_net = self.level - self.reduce_scatter_input
        reduce_input = self.reduce_scatter_input if self.reduced else ZERO
        final_peak, final_net, final_reduce_input = self.final_callback()
        b = self.bytes
        largest = max((u.largest_local for u in b), default=0)
        return SegmentCosts(
            fwd_pending=self.fwd_peaks[True],
            fwd_after=self.fwd_peaks[False],
            frees_pending=self.frees_previous_output,
            fwd_net=fwd_net,
            pending=pending,
            prefetched=prefetched,
            bwd=self.bwd_peaks,
            frees_reduce_input=self.reduced,
            bwd_net=bwd_net,
            reduce_input=reduce_input,
            final_peak=final_peak,
            final_net=final_net,
            final_reduce_input=final_reduce_input,
            has_final=bool(self._deferred()),
            persistent=sum(
                (_params(u.params) + MemoryParts(optimizer_states=u.optim) + _grads(u.bucket) for u in b), ZERO
            ),
            grads=sum((_grads(u.grad) for u in b), ZERO),
            buckets=sum((_grads(u.bucket) for u in b), ZERO),
            optimizer_temp=MemoryParts(optimizer_states=round(optimizer_temporaries * largest)),
            seconds=sum(u.time.added for u in self.units) + _recompute_seconds(self.segment.root),
            units=tuple(self.units),
        )


def _recompute_seconds(node: Node) -> float:
    """Forward seconds run again in backward: each recomputed module's replay (``Node.replay_seconds``), once per
    recomputation."""
    own = node.replay_seconds() if node.recompute else 0.0
    return own + sum(_recompute_seconds(c) for c in node.children)


def simulate_segment(
    segment: Segment, optimizer_temporaries: float, *, release_after_forward: bool = False
) -> SegmentCosts:
    """Simulate one segment's forward, backward and deferred reductions, event by event (FSDP2's order: see
    :class:`SegmentSimulator`). ``release_after_forward``: a sharded unit's all-gather buffer is freed when its
    forward ends (CPU, see ``lightning_osdp/comm.py``), not kept for the next unit's gather."""
    return SegmentSimulator(segment, release_after_forward=release_after_forward).run(optimizer_temporaries)


@dataclass(frozen=True)
class FreeCosts:
    """A run of modules outside every segment: largest checkpoints relative to the level, and net changes."""

    fwd_peak: MemoryParts
    fwd_net: MemoryParts
    bwd_peak: MemoryParts
    bwd_net: MemoryParts
    fwd_at: str = ""
    bwd_at: str = ""
    #: the run's modules, in forward order
    names: tuple[str, ...] = ()


def simulate_free(run: FreeRun) -> FreeCosts:
    """Activations of modules whose parameters are in a global unit (no events of their own)."""
    cur = ZERO
    fwd_peak, fwd_at = ZERO, run.nodes[0].name if run.nodes else ""
    for node in run.nodes:
        cur += _acts(node.act)
        if (cur + _acts(node.out)).total > fwd_peak.total:
            fwd_peak, fwd_at = cur + _acts(node.out), node.name
    fwd_net = cur
    bwd_peak, bwd_at = ZERO, run.nodes[-1].name if run.nodes else ""
    cur = ZERO
    for node in reversed(run.nodes):
        transient = _acts(node.out + max(node.inp, node.bwd_extra)) + _grads(node.grad_sum)
        if (cur + transient).total > bwd_peak.total:
            bwd_peak, bwd_at = cur + transient, node.name
        cur -= _acts(node.act)
    names = tuple(node.name for node in run.nodes)
    return FreeCosts(fwd_peak, fwd_net, bwd_peak, cur, _label(fwd_at), _label(bwd_at), names)


def _label(name: str) -> str:
    return name or "<root>"


@dataclass
class SegmentChoice:
    """A segment with its options (the predictor passes exactly one), and the largest all-gather output and
    reduce-scatter input any of its options leaves pending (see [Note: pending buffers across DDP segments])."""

    key: Hashable
    options: dict[Option, SegmentCosts]
    bound_pending: int = 0
    bound_reduce_input: int = 0


@dataclass
class GlobalChoice:
    """A global unit (root or tied group) with its options (modes)."""

    key: Hashable
    options: dict[Option, LocalUnit]
    is_root: bool


class Backend(Protocol[V]):
    """What :func:`build_timeline` needs from numbers or from linear expressions."""

    def const(self, parts: MemoryParts) -> V: ...

    def choice(self, key: Hashable, values: Mapping[Option, MemoryParts]) -> V: ...

    def add(self, a: V, b: V) -> V: ...

    def sub(self, a: V, b: V) -> V: ...

    def checkpoint(self, label: str, value: V) -> None: ...

    def checkpoint_options(
        self, label: str, base: V, cross: Sequence[V], key: Hashable, values: Mapping[Option, MemoryParts | None]
    ) -> None:
        """``base + sum(cross) + values[option]`` for the chosen option; no instant when its value is None."""

    def materialize(self, value: V, name: str) -> V: ...

    def maximum(self, values: Sequence[V], name: str) -> V: ...

    def seconds(self, key: Hashable, values: Mapping[Option, float]) -> None: ...

    def constant_seconds(self, seconds: float) -> None: ...


@dataclass
class TimelineInput(Generic[V]):
    """Everything :func:`build_timeline` walks."""

    globals: list[GlobalChoice]
    items: list[SegmentChoice | FreeCosts]
    compute_seconds: float
    extra_activation_bytes: int
    last_output_bytes: int
    buffer_bytes: int
    optimizer_temporaries: float
    #: whether any unit may be sharded (``False`` for a plan that shards nothing: DDP alone, no FSDP2 buffers)
    any_sharded: bool = True
    #: the largest all-gather output a global unit (root, tied group) could leave pending
    globals_bound_pending: int = 0
    #: sharded units free their forward all-gather buffer when their forward ends (nothing pending between them)
    release_after_forward: bool = False


def build_timeline(spec: TimelineInput[V], be: Backend[V]) -> None:
    """Walk one training step's memory (see the cost model's docstring for the model in words)."""
    step = _StepWalk(spec, be)
    step.step_start()
    step.forward()
    step.loss()
    step.backward()
    step.final_callback()
    step.optimizer_step()
    step.step_time()


#: The phases of the step, in order, that :func:`phase_of` places the walk's instants in.
PHASES: tuple[str, ...] = ("forward", "loss", "backward", "optimizer")

#: The first word(s) of each instant's label (:class:`_StepWalk` writes them) and its phase. The step's start and DDP's
#: bucket rebuild are the forward's first instants; the backward starts with the root's pre-backward gather, before
#: the loss's backward (``loss backward``), and ends with FSDP2's final callback (``final reduce``).
_PHASE_OF_LABEL: tuple[tuple[str, str], ...] = (
    ("step start", "forward"),
    ("second step: DDP rebuilds", "forward"),
    ("forward ", "forward"),
    ("loss backward", "backward"),
    ("loss", "loss"),
    ("backward ", "backward"),
    ("final reduce ", "backward"),
    ("optimizer step", "optimizer"),
)


def phase_of(label: str) -> str:
    """The phase (one of :data:`PHASES`) of an instant the walk labelled ``label``."""
    for prefix, phase in _PHASE_OF_LABEL:
        if label.startswith(prefix):
            return phase
    raise ValueError(f"no phase for the timeline's instant {label!r}: add its label to timeline._PHASE_OF_LABEL")


class _StepWalk(Generic[V]):
    """:func:`build_timeline`'s state between the step's phases, one method per phase in step order.

    ``level`` is the running memory level (what stays between instants); ``pending`` the all-gather output left
    by the last unit that gathered in forward; ``reduce_pending`` the reduce-scatter input left by the last
    reduction in backward; ``prefetch`` the all-gather output prefetched in backward for the segment to come.
    """

    def __init__(self, spec: TimelineInput[V], be: Backend[V]) -> None:
        self.spec = spec
        self.be = be
        self.globals = [g for g in spec.globals if any(u.bytes.param_count for u in g.options.values())]
        self.segments = [s for s in spec.items if isinstance(s, SegmentChoice)]
        self.level = be.const(ZERO)
        self.grads = be.const(ZERO)
        self.pending = be.const(ZERO)
        self.loss_activations = be.const(ZERO)
        self.prefetch = be.const(ZERO)
        self.reduce_pending = be.const(ZERO)
        self.outside = _outside(spec)

    # ------------------------------------------------------------------ values of one choice
    def pick(self, g: GlobalChoice, attr: str, only_full_shard: bool = False) -> V:
        """A global unit's ``UnitBytes`` field under each of its options (with ``only_full_shard``, 0 for options that
        do not reshard after forward: not ``full_shard`` or ``hybrid_shard``)."""
        values = {}
        for opt, u in g.options.items():
            v = getattr(u.bytes, attr)
            if only_full_shard and not u.bytes.reshards_after_forward:
                v = 0
            values[opt] = v
        return self.be.choice(g.key, {o: _parts_for(attr, v) for o, v in values.items()})

    def seg(self, s: SegmentChoice, attr: str) -> V:
        """A segment's ``SegmentCosts`` field under each of its options."""
        return self.be.choice(s.key, {o: getattr(c, attr) for o, c in s.options.items()})

    # ------------------------------------------------------------------ the phases
    def step_start(self) -> None:
        """Persistent state at the step's start: parameters, optimizer state, DDP buckets, last step's gradients."""
        be = self.be
        # Buffers (never sharded) are counted with the parameters; a measured correction is held all step, and so are
        # the gradients an accumulating step holds between its micro-batches (see [Note: gradient accumulation]).
        persistent = be.const(
            _params(self.spec.buffer_bytes) + _acts(self.outside.correction) + _grads(self.outside.held_gradients)
        )
        grads = be.const(ZERO)
        for g in self.globals:
            persistent = be.add(
                persistent, be.add(be.add(self.pick(g, "params"), self.pick(g, "optim")), self.pick(g, "bucket"))
            )
            grads = be.add(grads, self.pick(g, "grad"))
        for s in self.segments:
            persistent = be.add(persistent, self.seg(s, "persistent"))
            grads = be.add(grads, self.seg(s, "grads"))
        persistent = be.materialize(persistent, "persistent")
        self.grads = be.materialize(grads, "grads")
        self.level = be.materialize(be.add(persistent, self.grads), "level_start")
        be.checkpoint("step start", self.level)
        # DDP rebuilds its buckets once, in the second step's forward, in the order the gradients became ready in the
        # first: the new buckets are allocated while the old ones still hold last step's gradients.
        buckets = be.const(ZERO)
        for g in self.globals:
            buckets = be.add(buckets, self.pick(g, "bucket"))
        for s in self.segments:
            buckets = be.add(buckets, self.seg(s, "buckets"))
        be.checkpoint("second step: DDP rebuilds its buckets", be.add(self.level, buckets))

    def forward(self) -> None:
        """The global units gather first (the root's pre-forward), then every item in forward order."""
        be = self.be
        for g in self.globals:
            label = f"forward gather {_label(str(g.key))}"
            be.checkpoint(label, be.add(be.add(self.level, self.pending), self.pick(g, "flat")))
            self.level = be.add(self.level, self.pick(g, "gathered"))
            self.pending = self.pick(g, "flat")
            be.checkpoint(label, be.add(self.level, self.pending))
        self.level = be.materialize(self.level, "level_globals")
        bound_pending = self.spec.globals_bound_pending
        # On CPU a tied group frees its buffer when its first holder's forward ends (the executor's release hook is
        # on every holder); the root's lives to the end of the step, so it bounds what a DDP segment finds pending.
        released: set[str] = set()
        last = self.globals[-1] if self.globals else None
        if self.spec.release_after_forward and last is not None and not last.is_root:
            released = {name for u in last.options.values() for name in u.names}
            bound_pending = max(
                (u.bytes.flat for g in self.globals if g.is_root for u in g.options.values()), default=0
            )
        for i, item in enumerate(self.spec.items):
            if isinstance(item, FreeCosts):
                be.checkpoint(
                    f"forward {item.fwd_at}", be.add(be.add(self.level, self.pending), be.const(item.fwd_peak))
                )
                self.level = be.add(self.level, be.const(item.fwd_net))
                if released & set(item.names):
                    self.pending, released = be.const(ZERO), set()
                continue
            self._forward_segment(i, item, bound_pending)
            if not self.spec.release_after_forward:
                bound_pending = max(bound_pending, item.bound_pending)

    def _forward_segment(self, i: int, item: SegmentChoice, bound_pending: int) -> None:
        be = self.be
        label = f"forward {item.key}"
        be.checkpoint_options(
            label, self.level, [self.pending], item.key, {o: c.fwd_pending for o, c in item.options.items()}
        )
        frees = {o: c.frees_pending for o, c in item.options.items()}
        if any(frees.values()):
            be.checkpoint_options(label, self.level, [], item.key, {o: c.fwd_after for o, c in item.options.items()})
        bound = _comm(bound_pending) if self.spec.any_sharded else ZERO
        if not all(frees.values()):
            # An option that gathers nothing (DDP) leaves an earlier all-gather output pending: bounded by the largest
            # a global unit or an earlier segment can leave (see [Note: pending buffers across DDP segments]).
            self.pending = be.choice(item.key, {o: c.pending if frees[o] else bound for o, c in item.options.items()})
        else:
            self.pending = self.seg(item, "pending")
        self.level = be.materialize(be.add(self.level, self.seg(item, "fwd_net")), f"fwd_level_{i}")

    def loss(self) -> None:
        """The end of the forward: tied groups reshard, the loss is computed, the root reshards, the gradients of
        the previous step are dropped (see [Note: the loss in the timeline])."""
        be = self.be
        for g in self.globals:
            if not g.is_root:  # a tied group reshards after its last holder's forward, before the loss
                self.level = be.sub(self.level, self.pick(g, "gathered", only_full_shard=True))
        loss = self.outside.loss
        if loss is None:
            peak = at_backward = self.spec.extra_activation_bytes + self.spec.last_output_bytes
        else:
            held = loss.outside_activation_bytes + loss.output_bytes
            peak = held + loss.forward_peak_bytes
            at_backward = max(held + loss.backward_start_bytes, 0)
        be.checkpoint("loss", be.add(be.add(self.level, self.pending), be.const(_acts(peak))))
        self.loss_activations = be.const(_acts(at_backward))
        for g in self.globals:
            if g.is_root:
                self.level = be.sub(self.level, self.pick(g, "gathered", only_full_shard=True))
        self.level = be.sub(self.level, self.grads)  # zero_grad(set_to_none=True) after training_step, before backward

    def backward(self) -> None:
        """The root's pre-backward (it gathers again and prefetches), the loss's backward (see [Note: the loss in the
        timeline]), the tied groups' pre-backwards (on their last holder's output gradient), then every item in
        reverse forward order."""
        be = self.be
        for g in self.globals:
            if g.is_root:
                self._backward_gather(g, be.const(ZERO))
        # The root prefetches the unit whose forward ended last: a tied group holding the LM head, else the last
        # segment's last unit.
        last_tied = self._tied_group_last()
        segment_prefetch = self._in_flight(len(self.segments) - 1) if self.segments else be.const(ZERO)
        if last_tied is not None:
            self.prefetch = self.pick(last_tied, "flat", only_full_shard=True)
        else:
            self.prefetch = segment_prefetch
        loss = self.outside.loss
        transient = be.const(_acts(loss.backward_peak_bytes if loss is not None else 0))
        be.checkpoint(
            "loss backward", be.add(be.add(self.level, self.prefetch), be.add(self.loss_activations, transient))
        )
        if loss is not None:
            # What the loss region leaves once the first module's backward has its output gradient (counted by the
            # walk): held until the step ends (see [Note: the loss in the timeline]).
            kept = loss.outside_activation_bytes + loss.backward_start_bytes + loss.backward_end_bytes
            self.level = be.add(self.level, be.const(_acts(max(kept, 0))))
        output_gradient = be.const(_acts(loss.output_bytes if loss is not None else self.spec.last_output_bytes))
        for g in self.globals:
            if g.is_root:
                continue
            if g is last_tied:
                # Its all-gather was issued by the root (the prefetch): only the copy-out is left; then it prefetches
                # the last segment's unit.
                gathered = self.pick(g, "gathered", only_full_shard=True)
                label = f"backward gather {_label(str(g.key))}"
                be.checkpoint(label, be.add(be.add(self.level, self.prefetch), be.add(gathered, output_gradient)))
                self.level = be.add(self.level, gathered)
                self.prefetch = segment_prefetch
                be.checkpoint(label, be.add(be.add(self.level, self.prefetch), output_gradient))
            else:
                self._backward_gather(g, be.add(self.prefetch, output_gradient))
        for g in self.globals:
            # Gradients of the global units' parameters (embedding, LM head) are produced in backward and kept until
            # the final callback reduces them: counted from the first module's backward on.
            self.level = be.add(self.level, self.pick(g, "grad_full"))
        self.level = be.materialize(self.level, "level_backward")
        bound_reduce = 0
        seen = len(self.segments)
        for i in range(len(self.spec.items) - 1, -1, -1):
            item = self.spec.items[i]
            if isinstance(item, FreeCosts):
                be.checkpoint(
                    f"backward item {i}",
                    be.add(be.add(be.add(self.level, self.reduce_pending), self.prefetch), be.const(item.bwd_peak)),
                )
                self.level = be.add(self.level, be.const(item.bwd_net))
                continue
            seen -= 1
            earlier = self._in_flight(seen - 1) if seen > 0 else be.const(ZERO)
            self._backward_segment(i, item, earlier, bound_reduce, self._passing(seen))
            bound_reduce = max(bound_reduce, item.bound_reduce_input)
            self.prefetch = earlier

    def _passing(self, k: int) -> int:
        """The largest all-gather output prefetched for a segment before the ``k``-th (in forward order): the whole
        segment as one sharded unit (see :meth:`_in_flight`)."""
        if not self.spec.any_sharded:
            return 0
        return max((s.bound_pending for s in self.segments[:k]), default=0)

    def _in_flight(self, k: int) -> V:
        """The all-gather output prefetched for the ``k``-th segment (in forward order) when its backward is next.

        FSDP2 prefetches the unit whose forward ended before the current one's among *its* units: DDP's are not, so
        an option of the segment without a sharded unit lets the prefetch reach past it to an earlier segment, and
        the buffer is alive through its backward. Which one depends on the earlier segments' options (a product of
        choices), so it is bounded as the forward bounds a pending buffer (see [Note: pending buffers across DDP
        segments])."""
        s = self.segments[k]
        passing = _comm(self._passing(k))
        return self.be.choice(s.key, {o: c.prefetched if c.frees_pending else passing for o, c in s.options.items()})

    def _tied_group_last(self) -> GlobalChoice | None:
        """The tied group whose forward ends after every segment's (its last holder runs in a free run after the last
        segment: an LM head tied to the embedding), if any; FSDP2 ends a group's forward when its last holder's
        does."""
        items = self.spec.items
        last_segment = max((i for i, item in enumerate(items) if isinstance(item, SegmentChoice)), default=-1)
        order = [name for item in items[last_segment + 1 :] if isinstance(item, FreeCosts) for name in item.names]
        last: tuple[int, GlobalChoice] | None = None
        for g in self.globals:
            if g.is_root:
                continue
            holders = {name for u in g.options.values() for name in u.names}
            ends = [i for i, name in enumerate(order) if name in holders]
            if ends and (last is None or max(ends) > last[0]):
                last = (max(ends), g)
        return last[1] if last is not None else None

    def _backward_gather(self, g: GlobalChoice, alongside: V) -> None:
        """A global unit's pre-backward: ``full_shard`` units gather again, with ``alongside`` alive."""
        be = self.be
        gathered = self.pick(g, "gathered", only_full_shard=True)
        be.checkpoint(
            f"backward gather {_label(str(g.key))}",
            be.add(be.add(self.level, alongside), be.add(gathered, self.pick(g, "flat", only_full_shard=True))),
        )
        self.level = be.add(self.level, gathered)

    def _backward_segment(self, i: int, item: SegmentChoice, earlier: V, bound_reduce: int, passing: int) -> None:
        be = self.be
        # The segment's own prefetched buffer is part of its level (its simulation frees it); an option without a
        # sharded unit has none, and the prefetch for an earlier segment passes through it (see `_in_flight`).
        self.level = be.materialize(be.add(self.level, self.seg(item, "prefetched")), f"bwd_start_{i}")
        through = _comm(passing)
        for cls in BWD_CLASSES:
            cross = ([self.reduce_pending] if cls[0] else []) + ([earlier] if cls[1] else [])
            values = {o: _passed(c.bwd[cls], through, c.frees_pending) for o, c in item.options.items()}
            be.checkpoint_options(f"backward {item.key}", self.level, cross, item.key, values)
        self.level = be.materialize(be.add(self.level, self.seg(item, "bwd_net")), f"bwd_level_{i}")
        reduce = {o: c.frees_reduce_input for o, c in item.options.items()}
        if all(reduce.values()):
            self.reduce_pending = self.seg(item, "reduce_input")
        else:
            # An option that reduces nothing in backward (DDP's units, or the coarse unit of the segment holding the
            # model's first trainable module, reduced in the final callback) leaves a later segment's input pending:
            # bounded by the largest any later segment can leave, as in forward.
            bound = _comm(bound_reduce) if self.spec.any_sharded else ZERO
            self.reduce_pending = be.choice(
                item.key, {o: c.reduce_input if reduce[o] else bound for o, c in item.options.items()}
            )

    def final_callback(self) -> None:
        """FSDP2's final callback: the global units reshard and reduce, then the segments' deferred reductions;
        it waits for every reduction and drops the kept reduce-scatter inputs."""
        be = self.be
        for g in self.globals:
            self.level = be.sub(self.level, self.pick(g, "gathered"))
            trainable = {u.bytes.trainable for u in g.options.values()}
            if trainable == {True}:
                label = f"final reduce {_label(str(g.key))}"
                be.checkpoint(label, be.add(self.level, self.pick(g, "reduce_input")))
                self.level = be.add(self.level, be.sub(self.pick(g, "grad"), self.pick(g, "grad_full")))
                be.checkpoint(label, be.add(self.level, self.pick(g, "reduce_input")))
        for s in self.segments:
            if not any(c.has_final for c in s.options.values()):
                continue
            be.checkpoint_options(
                f"final reduce {s.key}", self.level, [], s.key, {o: c.final_peak for o, c in s.options.items()}
            )
            self.level = be.materialize(be.add(self.level, self.seg(s, "final_net")), f"final_{s.key}")

    def optimizer_step(self) -> None:
        """The optimizer step: the largest temporaries of any unit on top of the level after the final callback."""
        be = self.be
        temps = [self.seg(s, "optimizer_temp") for s in self.segments]
        for g in self.globals:
            temps.append(
                be.choice(
                    g.key,
                    {
                        o: MemoryParts(optimizer_states=round(self.spec.optimizer_temporaries * u.bytes.largest_local))
                        for o, u in g.options.items()
                    },
                )
            )
        be.checkpoint("optimizer step", be.add(self.level, be.maximum(temps, "optimizer_temporaries")))

    def step_time(self) -> None:
        """The step time: the compute every plan pays, plus what each choice's option adds."""
        be = self.be
        be.constant_seconds(self.spec.compute_seconds)
        for g in self.globals:
            be.seconds(g.key, {o: u.time.added for o, u in g.options.items()})
        for s in self.segments:
            be.seconds(s.key, {o: c.seconds for o, c in s.options.items()})


def _passed(value: MemoryParts | None, through: MemoryParts, sharded: bool) -> MemoryParts | None:
    """A backward instant of a segment's option, with the buffer passing through an option without sharded units."""
    return value if sharded or value is None else value + through


def _outside(spec: TimelineInput[V]) -> OutsideModules:
    """What the root unit carries of the step outside modules (every option of it carries the same)."""
    for g in spec.globals:
        if g.is_root:
            outside = next(iter(g.options.values())).outside
            if outside is not None:
                return outside
    return OutsideModules()


def _parts_for(attr: str, value: int) -> MemoryParts:
    if attr in ("params",):
        return _params(value)
    if attr in ("optim",):
        return MemoryParts(optimizer_states=value)
    if attr in ("grad", "grad_full", "bucket"):
        return _grads(value)
    if attr in ("gathered",):
        return _gathered(value)
    if attr in ("flat", "reduce_input"):
        return _comm(value)
    raise KeyError(attr)
