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
option (:func:`simulate_segment`) and summarised by its largest checkpoint in each *class*: which of the
buffers owned by *another* segment are alive at that instant (the all-gather output still pending from the
previous unit in forward; in backward, the reduce-scatter input pending from the later unit, and the
all-gather output this segment prefetches for the earlier one). A class an option never enters gets a value
that makes its constraint implied by the segment's first instant (a real state), so it never binds.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from lightning_osdp.cost_model.parts import ZERO, MemoryParts
from lightning_osdp.cost_model.structure import FreeRun, LocalUnit, Node, Segment

__all__ = [
    "Backend",
    "FreeCosts",
    "GlobalChoice",
    "SegmentChoice",
    "SegmentCosts",
    "build_timeline",
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


def _order_by_post_forward(node: Node, out: list[int]) -> None:
    for child in node.children:
        _order_by_post_forward(child, out)
    if node.unit is not None:
        out.append(node.unit)


def simulate_segment(
    segment: Segment, optimizer_temporaries: float, *, release_after_forward: bool = False
) -> SegmentCosts:
    """Simulate one segment's forward, backward and deferred reductions, event by event (FSDP2's order).
    ``release_after_forward``: a sharded unit's all-gather buffer is freed when its forward ends (CPU, see
    ``lightning_osdp/comm.py``), not kept for the next unit's gather."""
    units = segment.units
    b = [u.bytes for u in units]

    # ------------------------------------------------------------------ forward
    cur = ZERO
    pending_alive = True  # the previous unit's all-gather output (another segment's)
    own_pending = ZERO
    pending_owner: int | None = None
    peak_pending: MemoryParts | None = ZERO  # the segment's first instant is a real state of this class
    peak_after: MemoryParts | None = None
    frees = False

    def fwd_checkpoint(value: MemoryParts) -> None:
        nonlocal peak_pending, peak_after
        if pending_alive:
            peak_pending = _max(peak_pending, value)
        else:
            peak_after = _max(peak_after, value)

    def pre_forward(i: int) -> None:
        nonlocal cur, pending_alive, own_pending, frees, pending_owner
        u = b[i]
        if not u.sharded:
            return  # DDP's parameters: no FSDP2 hook runs, the pending all-gather output stays
        cur += _comm(u.flat)
        fwd_checkpoint(cur)
        # Every gather frees the output kept for the previous one (FSDP2's AllGatherState); the root's
        # post-forward frees the last one, after the loss.
        if pending_alive:
            pending_alive = False
            frees = True
        else:
            cur -= own_pending
        cur += _gathered(u.gathered)
        fwd_checkpoint(cur)
        own_pending, pending_owner = _comm(u.flat), i

    def release(i: int) -> None:
        # The unit's own buffer, if a nested unit's gather has not freed it already.
        nonlocal cur, own_pending, pending_owner
        if pending_owner == i:
            cur -= own_pending
            own_pending, pending_owner = ZERO, None

    def forward(node: Node) -> None:
        nonlocal cur
        if node.unit is not None:
            pre_forward(node.unit)
        cur += _acts(node.act)
        for child in node.children:
            forward(child)
        fwd_checkpoint(cur + _acts(node.out))
        if node.unit is not None and b[node.unit].mode == "full_shard":
            cur -= _gathered(b[node.unit].gathered)
        if node.unit is not None and b[node.unit].sharded and release_after_forward:
            release(node.unit)

    forward(segment.root)
    fwd_net = cur - own_pending
    post_order: list[int] = []
    _order_by_post_forward(segment.root, post_order)
    # FSDP2 prefetches in backward the FSDP2 unit that finished its forward before the current one: DDP's units
    # (no_shard) are not among them.
    post_order = [i for i in post_order if b[i].sharded]

    # ------------------------------------------------------------------ backward
    # Relative to the level at the segment's start, which holds this segment's activations, the parameters its
    # no_shard/shard_grad_op units kept gathered, and its last unit's all-gather output (prefetched by the next).
    cur = ZERO
    reduce_alive = True
    prefetch_alive = False
    own_reduce = ZERO
    bwd: dict[tuple[bool, bool], MemoryParts | None] = {c: None for c in BWD_CLASSES}
    bwd[(True, False)] = ZERO
    reduced = False
    prefetched: set[int] = set()
    last = post_order[-1] if post_order else None
    self_prefetched = ZERO
    if last is not None and b[last].mode == "full_shard":
        prefetched.add(last)
        self_prefetched = _comm(b[last].flat)

    def bwd_checkpoint(value: MemoryParts) -> None:
        key = (reduce_alive, prefetch_alive)
        bwd[key] = _max(bwd[key], value)

    def pre_backward(i: int) -> None:
        nonlocal cur, prefetch_alive
        u = b[i]
        if not u.sharded:
            return
        if u.mode == "full_shard":
            if i in prefetched:
                prefetched.discard(i)
                cur += _gathered(u.gathered)
                bwd_checkpoint(cur)
            else:
                cur += _comm(u.flat) + _gathered(u.gathered)
                bwd_checkpoint(cur)
            cur -= _comm(u.flat)
        # Implicit backward prefetch: the unit that finished its forward just before this one.
        k = post_order.index(i)
        if k == 0:
            prefetch_alive = True
            bwd_checkpoint(cur)
        else:
            target = post_order[k - 1]
            if b[target].mode == "full_shard" and target not in prefetched:
                prefetched.add(target)
                cur += _comm(b[target].flat)
                bwd_checkpoint(cur)

    def post_backward(i: int) -> None:
        nonlocal cur, reduce_alive, own_reduce, reduced
        u = b[i]
        if not u.sharded:
            return  # DDP copied each gradient into its bucket as it was produced (see `backward`)
        cur -= _gathered(u.gathered)
        if reduce_alive:
            reduce_alive = False
            reduced = True
        else:
            cur -= own_reduce
        if u.trainable:
            cur += _comm(u.reduce_input)
            bwd_checkpoint(cur)
            cur += _grads(u.grad - u.grad_full)
            bwd_checkpoint(cur)
            own_reduce = _comm(u.reduce_input)
        else:
            own_reduce = ZERO

    def backward(node: Node, ddp: bool) -> None:
        nonlocal cur
        if node.unit is not None:
            ddp = not b[node.unit].sharded
            pre_backward(node.unit)
        for child in reversed(node.children):
            backward(child, ddp)
        cur += _grads(node.grad)
        transient = node.out + (node.inp if not node.children else 0)
        bwd_checkpoint(cur + _acts(transient))
        if ddp:
            cur -= _grads(node.grad)  # DDP's hook copies each gradient into its bucket and drops it
        cur -= _acts(node.act)
        if node.unit is not None and not units[node.unit].deferred:
            post_backward(node.unit)

    backward(segment.root, False)
    bwd_net = cur - own_reduce
    reduce_out = own_reduce if reduced else ZERO

    # ------------------------------------------------------------------ deferred reductions (final callback)
    cur = ZERO
    final_peak: MemoryParts | None = None
    final_reduce = ZERO
    deferred = [i for i in sorted(range(len(units)), key=lambda j: units[j].names) if units[i].deferred]
    for n, i in enumerate([i for i in deferred if b[i].sharded]):
        u = b[i]
        cur -= _gathered(u.gathered)
        if n:
            cur -= final_reduce
        if u.trainable:
            cur += _comm(u.reduce_input)
            final_peak = _max(final_peak, cur)
            cur += _grads(u.grad - u.grad_full)
            final_peak = _max(final_peak, cur)
            final_reduce = _comm(u.reduce_input)
        else:
            final_reduce = ZERO
    final_net = cur - final_reduce

    largest = max((u.largest_local for u in b), default=0)
    return SegmentCosts(
        fwd_pending=peak_pending,
        fwd_after=peak_after,
        frees_pending=frees,
        fwd_net=fwd_net,
        pending=own_pending,
        prefetched=self_prefetched,
        bwd=bwd,
        frees_reduce_input=reduced,
        bwd_net=bwd_net,
        reduce_input=reduce_out,
        final_peak=final_peak,
        final_net=final_net,
        final_reduce_input=final_reduce,
        has_final=bool(deferred),
        persistent=sum((_params(u.params) + MemoryParts(optimizer_states=u.optim) + _grads(u.bucket) for u in b), ZERO),
        grads=sum((_grads(u.grad) for u in b), ZERO),
        optimizer_temp=MemoryParts(optimizer_states=round(optimizer_temporaries * largest)),
        seconds=sum(u.time.added for u in units),
        units=tuple(units),
    )


@dataclass(frozen=True)
class FreeCosts:
    """A run of modules outside every segment: largest checkpoints relative to the level, and net changes."""

    fwd_peak: MemoryParts
    fwd_net: MemoryParts
    bwd_peak: MemoryParts
    bwd_net: MemoryParts
    fwd_at: str = ""
    bwd_at: str = ""


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
        if (cur + _acts(node.out + node.inp)).total > bwd_peak.total:
            bwd_peak, bwd_at = cur + _acts(node.out + node.inp), node.name
        cur -= _acts(node.act)
    return FreeCosts(fwd_peak, fwd_net, bwd_peak, cur, _label(fwd_at), _label(bwd_at))


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

    def pick(g: GlobalChoice, attr: str, only_full_shard: bool = False) -> V:
        values = {}
        for opt, u in g.options.items():
            v = getattr(u.bytes, attr)
            if only_full_shard and u.mode != "full_shard":
                v = 0
            values[opt] = v
        return be.choice(g.key, {o: _parts_for(attr, v) for o, v in values.items()})

    def seg(s: SegmentChoice, attr: str) -> V:
        return be.choice(s.key, {o: getattr(c, attr) for o, c in s.options.items()})

    # ------------------------------------------------------------------ persistent state at the step's start
    # Buffers (never sharded) are counted with the parameters.
    persistent = be.const(_params(spec.buffer_bytes))
    grads = be.const(ZERO)
    globals_ = [g for g in spec.globals if any(u.bytes.param_count for u in g.options.values())]
    for g in globals_:
        persistent = be.add(persistent, be.add(be.add(pick(g, "params"), pick(g, "optim")), pick(g, "bucket")))
        grads = be.add(grads, pick(g, "grad"))
    segments = [s for s in spec.items if isinstance(s, SegmentChoice)]
    for s in segments:
        persistent = be.add(persistent, seg(s, "persistent"))
        grads = be.add(grads, seg(s, "grads"))
    persistent = be.materialize(persistent, "persistent")
    grads = be.materialize(grads, "grads")
    level = be.materialize(be.add(persistent, grads), "level_start")
    be.checkpoint("step start", level)

    # ------------------------------------------------------------------ forward
    pending = be.const(ZERO)
    for g in globals_:
        label = f"forward gather {_label(str(g.key))}"
        be.checkpoint(label, be.add(be.add(level, pending), pick(g, "flat")))
        level = be.add(level, pick(g, "gathered"))
        pending = pick(g, "flat")
        be.checkpoint(label, be.add(level, pending))
    level = be.materialize(level, "level_globals")
    bound_pending = spec.globals_bound_pending
    for i, item in enumerate(spec.items):
        if isinstance(item, FreeCosts):
            be.checkpoint(f"forward {item.fwd_at}", be.add(be.add(level, pending), be.const(item.fwd_peak)))
            level = be.add(level, be.const(item.fwd_net))
            continue
        label = f"forward {item.key}"
        be.checkpoint_options(label, level, [pending], item.key, {o: c.fwd_pending for o, c in item.options.items()})
        frees = {o: c.frees_pending for o, c in item.options.items()}
        if any(frees.values()):
            be.checkpoint_options(label, level, [], item.key, {o: c.fwd_after for o, c in item.options.items()})
        bound = _comm(bound_pending) if spec.any_sharded else ZERO
        if not all(frees.values()):
            # An option that gathers nothing (DDP) leaves an earlier all-gather output pending: bounded by the largest
            # a global unit or an earlier segment can leave (see [Note: pending buffers across DDP segments]).
            pending = be.choice(item.key, {o: c.pending if frees[o] else bound for o, c in item.options.items()})
        else:
            pending = seg(item, "pending")
        if not spec.release_after_forward:
            bound_pending = max(bound_pending, item.bound_pending)
        level = be.materialize(be.add(level, seg(item, "fwd_net")), f"fwd_level_{i}")

    # ------------------------------------------------------------------ loss, end of forward
    for g in globals_:
        if not g.is_root:  # a tied group reshards after its last holder's forward, before the loss
            level = be.sub(level, pick(g, "gathered", only_full_shard=True))
    loss = be.const(_acts(spec.extra_activation_bytes + spec.last_output_bytes))
    be.checkpoint("loss", be.add(be.add(level, pending), loss))
    for g in globals_:
        if g.is_root:
            level = be.sub(level, pick(g, "gathered", only_full_shard=True))
    level = be.sub(level, grads)  # zero_grad(set_to_none=True) after training_step, before backward

    # ------------------------------------------------------------------ backward
    for g in globals_:
        be.checkpoint(
            f"backward gather {_label(str(g.key))}",
            be.add(be.add(level, pick(g, "gathered", only_full_shard=True)), pick(g, "flat", only_full_shard=True)),
        )
        level = be.add(level, pick(g, "gathered", only_full_shard=True))
        # Gradients of the global units' parameters (embedding, LM head) exist from the start of backward until
        # the final callback reduces them.
        level = be.add(level, pick(g, "grad_full"))
    prefetch = seg(segments[-1], "prefetched") if segments else be.const(ZERO)
    be.checkpoint("loss backward", be.add(be.add(level, prefetch), loss))
    level = be.materialize(level, "level_backward")
    reduce_pending = be.const(ZERO)
    bound_reduce = 0
    seen = len(segments)
    for i in range(len(spec.items) - 1, -1, -1):
        item = spec.items[i]
        if isinstance(item, FreeCosts):
            be.checkpoint(
                f"backward item {i}",
                be.add(be.add(be.add(level, reduce_pending), prefetch), be.const(item.bwd_peak)),
            )
            level = be.add(level, be.const(item.bwd_net))
            continue
        seen -= 1
        earlier = seg(segments[seen - 1], "prefetched") if seen > 0 else be.const(ZERO)
        level = be.materialize(be.add(level, prefetch), f"bwd_start_{i}")
        for cls in BWD_CLASSES:
            cross = ([reduce_pending] if cls[0] else []) + ([earlier] if cls[1] else [])
            be.checkpoint_options(
                f"backward {item.key}", level, cross, item.key, {o: c.bwd[cls] for o, c in item.options.items()}
            )
        level = be.materialize(be.add(level, seg(item, "bwd_net")), f"bwd_level_{i}")
        reduce = {o: c.frees_reduce_input for o, c in item.options.items()}
        if all(reduce.values()):
            reduce_pending = seg(item, "reduce_input")
        else:
            # An option that reduces nothing in backward (DDP's units, or the coarse unit of the segment holding the
            # model's first trainable module, reduced in the final callback) leaves a later segment's input pending:
            # bounded by the largest any later segment can leave, as in forward.
            bound = _comm(bound_reduce) if spec.any_sharded else ZERO
            reduce_pending = be.choice(
                item.key, {o: c.reduce_input if reduce[o] else bound for o, c in item.options.items()}
            )
        bound_reduce = max(bound_reduce, item.bound_reduce_input)
        prefetch = earlier

    # ------------------------------------------------------------------ final callback: deferred reductions
    for g in globals_:
        level = be.sub(level, pick(g, "gathered"))
        trainable = {u.bytes.trainable for u in g.options.values()}
        if trainable == {True}:
            label = f"final reduce {_label(str(g.key))}"
            be.checkpoint(label, be.add(level, pick(g, "reduce_input")))
            level = be.add(level, be.sub(pick(g, "grad"), pick(g, "grad_full")))
            be.checkpoint(label, be.add(level, pick(g, "reduce_input")))
            reduce_pending = pick(g, "reduce_input")
        else:
            reduce_pending = be.const(ZERO)
    for s in segments:
        if not any(c.has_final for c in s.options.values()):
            continue
        be.checkpoint_options(
            f"final reduce {s.key}", level, [], s.key, {o: c.final_peak for o, c in s.options.items()}
        )
        level = be.materialize(be.add(level, seg(s, "final_net")), f"final_{s.key}")
    # FSDP2's final callback waits for every reduction and drops the kept reduce-scatter inputs.

    # ------------------------------------------------------------------ optimizer step
    temps = [seg(s, "optimizer_temp") for s in segments]
    for g in globals_:
        temps.append(
            be.choice(
                g.key,
                {
                    o: MemoryParts(optimizer_states=round(spec.optimizer_temporaries * u.bytes.largest_local))
                    for o, u in g.options.items()
                },
            )
        )
    be.checkpoint("optimizer step", be.add(level, be.maximum(temps, "optimizer_temporaries")))

    # ------------------------------------------------------------------ time
    be.constant_seconds(spec.compute_seconds)
    for g in globals_:
        be.seconds(g.key, {o: u.time.added for o, u in g.options.items()})
    for s in segments:
        be.seconds(s.key, {o: c.seconds for o, c in s.options.items()})


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
