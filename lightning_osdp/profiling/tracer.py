"""Attributing one training step to the modules that ran it: time, FLOPs, operators and saved activations.

[Note: what belongs to a module]
*Forward*: everything run while the module is the innermost module whose ``forward`` is executing (a module
stack kept by forward pre/post hooks). A module's own forward time is its inclusive time less its children's
inclusive times, less the time spent in the children's profiling hooks (measured in the hooks themselves), so
hooks cost the parent nothing. Calls add up: a module run twice in a step counts both calls.

*Backward*: each autograd node belongs to the module whose forward created it. Ownership is found without
touching the graph's structure: a module's forward post-hook walks back from its outputs' ``grad_fn`` through
``next_functions`` and claims every node not yet claimed (its children, having returned first, claimed theirs);
its pre-hook claims the unclaimed nodes behind its inputs for the enclosing module (or for no module), so work
done before a module runs is never charged to it; after the step's forward the loss claims what is left (the
loss computation: no module). Each node gets a pre-hook and a hook (``Node.register_prehook`` /
``register_hook``); the time between them is the node's, and a module's backward time is the sum over its nodes.
Hook bodies fall outside those intervals. Unlike full backward hooks on modules, nothing is inserted into the
graph, so in-place operations on module outputs (``ReLU(inplace=True)``) keep working, and a module whose inputs
need no gradient (an embedding of integer ids) is still timed. The ``AccumulateGrad`` node of a parameter used
by several modules belongs to the first one.

*Inputs*: the bytes of the tensors a module's forward is called with (distinct storages, parameters, buffers and
the batch excluded, summed over calls): what activation checkpointing keeps for backward in place of the module's
activations; and the part of them first saved for backward inside the module's own subtree (so counted in its
activations: the input a recomputation saves again is the one the checkpoint kept, not new memory).

*Activations*: tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``) during the
forward, charged to the innermost running module, counted by storage (a storage saved twice, or by two modules,
counts once, at the first saver; a view saved keeps its whole storage alive, so the whole storage counts).
Parameters, buffers and the batch are not activations: their storages are excluded. A saved storage is known by a
weak reference: the tracer does not keep it alive, so the step frees memory as it would untraced (what the loss
region's measurement needs, see ``loss_region.py``).

*Backward transients* (with the loss region's meter): [Note: backward transients]
A module's backward makes more than the gradient of its input: the gradients between its operators (a tanh GELU's
eight elementwise steps each make one of the output's size), the temporaries of a fused kernel's backward. The
cost model's walk has no operators, only modules, so the profile measures them: the backward's nodes run in
stretches of one owner; a stretch's largest live bytes over those when it began (when the gradient of the module's
output, which the walk counts, is already live), less the module's own parameters' gradients (which the walk adds
where the module's backward ends), is what the module's backward holds beyond the walk's level at its largest, and
``backward_transient_bytes`` is the largest over its stretches. Nodes owned by no module (the loss's) are the loss
region's.

*The loss region*: given a :class:`~lightning_osdp.profiling.loss_region.LossRegionRecorder`, the tracer tells it
when a top-level module holding parameters returns in forward, when backward starts, and when the first autograd
node owned by a module starts.

*Operators* (only when asked: the tracing costs Python time per operator): each ATen operator is seen by a
``TorchDispatchMode``; its FLOPs come from ``torch.utils.flop_counter``'s formulas (``FlopCounterMode``'s registry,
so the counts are the ones ``FlopCounterMode`` reports, with the CPU's fused attention given the formula of the
GPU's, :func:`cpu_attention_flop_formulas`), and an operator without a FLOP formula is tallied as
memory-bound by the bytes of its tensor arguments and results (views move nothing; gathers read only what they
return). Each operator with a FLOP formula is also kept as a :class:`ComputeKernel` (its FLOPs, the bytes it reads
and writes, and for attention its key length, head size and causality), so that a rate may depend on the shape
(``rates.py``). Causal attention is charged at the work its fused kernels do (see [Note: causal attention]). The
estimated mode turns these tallies into times.

[Note: causal attention]
``torch.utils.flop_counter`` charges ``scaled_dot_product_attention`` as full attention whatever ``is_causal``
says (``sdpa_flop``: "We aren't accounting for causal attention here"). The fused kernels skip the blocks above
the diagonal: FlashAttention-2 and torch's flash kernels (CUDA and the CPU's, ``FlashAttentionKernel.cpp``) and the
memory-efficient kernel with its causal mask type stop each query block's loop at the diagonal, so a causal
``s_q x s_k`` attention does the work of ``sum_i min(i + 1, s_k)`` of its ``s_q * s_k`` scores: about half
(FlashAttention's own benchmarks count causal attention at half the FLOPs, ``benchmarks/benchmark_flash_attention.py``).
Every attention operator that takes ``is_causal`` (or the memory-efficient kernel's ``custom_mask_type``) is charged
that fraction of the counter's formula, forward and backward; the forward FLOPs it skips are recorded beside
(``ModuleProfile.fwd_causal_skipped_flops``), so that an MFU may count causal attention in full, as PaLM's and
torchtitan's do. An explicit causal ``attn_mask`` is charged in full:
flash attention takes no mask, so SDPA runs a masked call on the memory-efficient kernel (an additive bias over
every block) or the math path, both of which compute every score whatever the mask holds.

On CUDA the clock synchronises the device before reading the time, so each interval holds its own kernels.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_osdp._compat import TorchDispatchMode, dispatch_has_kernel, tree_leaves, tree_map

if TYPE_CHECKING:
    from lightning_osdp.profiling.loss_region import LossRegionRecorder

__all__ = [
    "ComputeKernel",
    "EmptyCacheSpec",
    "ModuleRecord",
    "ModuleTracer",
    "OpTally",
    "StepRecord",
    "TensorSpec",
    "causal_fraction",
    "cpu_attention_flop_formulas",
    "storage_keys",
]

aten = torch.ops.aten

# Queries of metadata: no work, not operators a step pays for (FlopCounterMode skips the same).
_METADATA = {
    aten.sym_is_contiguous.default,
    aten.is_contiguous.default,
    aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default,
    aten.is_non_overlapping_and_dense.default,
    aten.size.default,
    aten.sym_size.default,
    aten.stride.default,
    aten.sym_stride.default,
    aten.storage_offset.default,
    aten.sym_storage_offset.default,
    aten.numel.default,
    aten.sym_numel.default,
    aten.dim.default,
    torch.ops.prim.layout.default,
    torch.ops.prim.device.default,
}
# Operators that allocate without touching memory, or alias without being annotated as views.
_NO_TRAFFIC = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten._unsafe_view, aten.lift_fresh}
# Operators that read only the rows they return from a (possibly huge) table.
_GATHERS = {aten.embedding, aten.index_select, aten.gather, aten.index}
# The CPU's fused attention, which a trace on CPU (fake) tensors runs where a GPU runs flash or memory-efficient
# attention: FlopCounterMode has no formula for it, so it takes the GPU kernels' (same arguments first: query, key,
# value; the backward's gradient, query, key, value), or an estimate for a GPU would count attention as memory traffic.
_SAME_FLOPS_AS = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}


# Attention operators (forward and backward) by the layout of their query/key: (batch, heads, seq, dim) for the SDPA
# family, (batch, seq, heads, dim) for the kernels' own entry points.
_ATTENTION_BHSD = {
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_cudnn_attention_backward,
}
_ATTENTION_BSHD = {
    aten._flash_attention_forward,
    aten._flash_attention_backward,
    aten._efficient_attention_forward,
    aten._efficient_attention_backward,
}


@dataclass(frozen=True)
class ComputeKernel:
    """One operator with a FLOP formula, as a shape-dependent rate needs it (see ``rates.py``).

    Attributes:
        kind: ``"matmul"`` (matrix products, convolutions) or ``"attention"`` (a fused attention kernel).
        flops: its FLOPs (causal attention at its real work, see [Note: causal attention]).
        bytes: bytes of its tensor arguments and results (what it reads and writes at least once).
        seq_len: attention only: the key length.
        head_dim: attention only: the head size.
        causal: attention only: whether it skips the blocks above the diagonal.
    """

    kind: str
    flops: int
    bytes: int
    seq_len: int = 0
    head_dim: int = 0
    causal: bool = False


def causal_fraction(seq_q: int, seq_k: int) -> float:
    """The share of the ``seq_q x seq_k`` scores a causal attention computes (query ``i`` sees keys ``0..i``, the
    top-left alignment of ``is_causal``; see [Note: causal attention])."""
    if seq_q <= 0 or seq_k <= 0:
        return 1.0
    if seq_q <= seq_k:
        return (seq_q + 1) / (2 * seq_k)
    return (seq_k * (seq_k + 1) / 2 + (seq_q - seq_k) * seq_k) / (seq_q * seq_k)


def _named_arguments(func: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    named = dict(zip(names, args, strict=False))
    named.update(kwargs)
    return named


def _attention_shape(func: Any, packet: Any, args: Any, kwargs: Any) -> tuple[int, int, int, bool] | None:
    """``(seq_q, seq_k, head_dim, causal)`` of an attention operator, ``None`` for any other (or unsized) one."""
    if packet not in _ATTENTION_BHSD and packet not in _ATTENTION_BSHD:
        return None
    named = _named_arguments(func, args, kwargs)
    query, key = named.get("query"), named.get("key")
    if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() != 4 or key.dim() != 4:
        return None
    seq_axis = 2 if packet in _ATTENTION_BHSD else 1
    # The memory-efficient kernel's entry points take a mask type: 0 is none, 1 and 2 causal (top left, bottom right).
    causal = bool(named["is_causal"]) if "is_causal" in named else bool(named.get("custom_mask_type") or 0)
    seq_q, seq_k, dim = _static(query.shape[seq_axis]), _static(key.shape[seq_axis]), _static(query.shape[-1])
    if seq_q is None or seq_k is None or dim is None:
        return None
    return seq_q, seq_k, dim, causal


def cpu_attention_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas for the CPU's fused attention operators, which ``FlopCounterMode`` lacks (those of the GPU's
    flash attention); in the form ``FlopCounterMode(custom_mapping=...)`` takes."""
    registry = FlopCounterMode(display=False).flop_registry
    out = {}
    for op, like in _SAME_FLOPS_AS.items():
        formula = registry.get(like)
        if formula is not None:
            # The registry's entry takes the operator's arguments as they come (tensors, ``out_val``): marked so.
            out[op] = functools.partial(formula)
            out[op]._get_raw = True  # type: ignore[attr-defined]
    return out


def _static(value: Any) -> int | None:
    """``int(value)``, or ``None`` for a size that depends on tensor values (an unbacked symbol of fake tensors:
    the output of ``nonzero`` or of boolean masking), which no shape propagation can know."""
    try:
        return int(value)
    except Exception:
        return None


def _nbytes(t: Tensor) -> int:
    return _static(t.numel() * t.element_size()) or 0


def storage_keys(tensors: Iterable[Any]) -> set[int]:
    """Identities of the storages behind ``tensors`` (non-tensors are skipped)."""
    keys = set()
    for t in tensors:
        if isinstance(t, Tensor):
            with suppress(RuntimeError, NotImplementedError):
                keys.add(int(t.untyped_storage()._cdata))
    return keys


@dataclass
class OpTally:
    """Operators run in one region of a step: compute-bound ones by FLOPs, memory-bound ones by bytes moved, and the
    compute-bound ones one by one (``kernels``: how many times each shape ran), for rates that depend on the shape.
    ``kernels`` may be empty (a tally made by hand): the totals are what every rate reads first."""

    matmul_ops: int = 0
    matmul_flops: int = 0
    memory_ops: int = 0
    memory_bytes: int = 0
    kernels: dict[ComputeKernel, int] = field(default_factory=dict)

    def count(self, flops: int, traffic: int, kernel: ComputeKernel | None = None) -> None:
        """One operator: compute-bound when it has FLOPs (its kernel's shape counted), else memory-bound."""
        if flops:
            self.matmul_ops += 1
            self.matmul_flops += flops
            if kernel is not None:
                self.kernels[kernel] = self.kernels.get(kernel, 0) + 1
        else:
            self.memory_ops += 1
            self.memory_bytes += traffic

    def __iadd__(self, other: OpTally) -> OpTally:
        self.matmul_ops += other.matmul_ops
        self.matmul_flops += other.matmul_flops
        self.memory_ops += other.memory_ops
        self.memory_bytes += other.memory_bytes
        for kernel, count in other.kernels.items():
            self.kernels[kernel] = self.kernels.get(kernel, 0) + count
        return self


@dataclass
class ModuleRecord:
    """One module's own share of one step (see [Note: what belongs to a module])."""

    calls: int = 0
    fwd_seconds: float = 0.0
    bwd_seconds: float = 0.0
    fwd_flops: int = 0
    bwd_flops: int = 0
    #: The forward FLOPs of causal attention's scores above the diagonal, which ``fwd_flops`` leaves out.
    fwd_causal_skipped_flops: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    input_bytes: int = 0
    input_saved_bytes: int = 0
    #: The largest live bytes any stretch of its backward nodes added over what was live when the stretch began,
    #: less its own parameters' gradients (recorded with ``memory``; see [Note: backward transients]).
    backward_transient_bytes: int = 0
    #: The innermost module running when its forward was first called (``""``: the root, or the step's own code).
    caller: str | None = None
    fwd_ops: OpTally = field(default_factory=OpTally)
    bwd_ops: OpTally = field(default_factory=OpTally)
    #: The arguments of the first call, tensors as :class:`TensorSpec` (recorded with ``memory``): what a block is
    #: timed with on its own (``blocks.py``).
    inputs: tuple[Any, Any] | None = None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as a block's timing rebuilds it: shape (``-1`` for a size that depends on values), dtype,
    whether it requires a gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class EmptyCacheSpec:
    """A key/value cache argument (Hugging Face's ``Cache`` protocol: ``update`` and ``get_seq_length``), which a
    block's timing rebuilds as a new, empty instance of its class.

    [Note: a cache argument]
    Hugging Face's decoders pass the step's ``DynamicCache`` to every decoder layer, also in training (``use_cache``
    defaults to true), and each layer appends its keys and values to it: work of the real step, so its time belongs
    to the block. The object itself cannot be replayed (after the trace it holds every layer's fake tensors), but an
    empty one of the same class does the same work for one layer: it allocates the layer's entry and stores the
    keys and values, as the first layer's call does in the step. The class name is the block's key, so identical
    layers share one timing.
    """

    cls: type

    def build(self) -> Any:
        """A new, empty cache."""
        return self.cls()

    def __repr__(self) -> str:
        return f"EmptyCacheSpec({self.cls.__module__}.{self.cls.__qualname__})"


def empty_cache(value: Any) -> Any | None:
    """A new, empty key/value cache of ``value``'s class, when ``value`` is one (``update`` and ``get_seq_length``)
    whose class builds one without arguments (``DynamicCache``; not ``StaticCache`` or ``EncoderDecoderCache``, whose
    blocks keep their estimated times); else ``None``. See [Note: a cache argument]."""
    if not (callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))):
        return None
    try:
        return type(value)()
    except (TypeError, ValueError):
        return None


def _spec(value: Any) -> Any:
    if isinstance(value, Tensor):
        sizes = [_static(d) for d in value.shape]
        return TensorSpec(tuple(-1 if d is None else d for d in sizes), value.dtype, value.requires_grad)
    if empty_cache(value) is not None:
        return EmptyCacheSpec(type(value))
    return value


@dataclass
class StepRecord:
    """A traced step: per module, outside any module (loss, framework), and in the optimizer step."""

    modules: dict[str, ModuleRecord]
    outside: ModuleRecord = field(default_factory=ModuleRecord)
    optimizer_ops: OpTally = field(default_factory=OpTally)
    forward_order: list[str] = field(default_factory=list)  # modules in the order their forward first ran
    unsized_tensors: int = 0  # saved tensors and FLOP counts whose size depends on values (counted as 0)

    def of(self, owner: str | None) -> ModuleRecord:
        return self.outside if owner is None else self.modules[owner]


@dataclass
class _Frame:
    name: str
    start: float
    hook: float
    inner: float = 0.0
    inputs: frozenset[int] = frozenset()


class _OpRecorder(TorchDispatchMode):
    def __init__(self, tracer: ModuleTracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.registry = {**FlopCounterMode(display=False).flop_registry, **cpu_attention_flop_formulas()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        if packet not in self.registry and not _has_kernel(func):
            # As FlopCounterMode: a composite operator may decompose into ones that have FLOP formulas.
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        out = func(*args, **kwargs)
        if packet in self.registry:
            flops = _static(self.registry[packet](*args, **kwargs, out_val=out))
            if flops is None:
                self.tracer._unsized += 1
            flops = flops or 0
            attention = _attention_shape(func, packet, args, kwargs)
            skipped = 0
            if attention is None:
                kernel = ComputeKernel("matmul", flops, _tensor_bytes(args, kwargs, out))
            else:
                seq_q, seq_k, head_dim, causal = attention
                if causal:  # [Note: causal attention]
                    full, flops = flops, round(flops * causal_fraction(seq_q, seq_k))
                    skipped = full - flops
                kernel = ComputeKernel("attention", flops, _tensor_bytes(args, kwargs, out), seq_k, head_dim, causal)
            self.tracer._record_op(flops, 0, kernel, causal_skipped=skipped)
        else:
            self.tracer._record_op(0, _traffic(func, packet, args, kwargs, out))
        return out


#: Dispatch keys whose kernel runs an operator as one: an operator with one is not decomposed (see `_has_kernel`).
_KERNEL_KEYS = ("CPU", "CUDA", "CompositeExplicitAutograd")


@functools.cache
def _has_kernel(func: Any) -> bool:
    """Whether ``func`` runs as a kernel of its own on a device, rather than only as its composite decomposition.

    [Note: which operators decompose]
    FlopCounterMode decomposes every operator it has no formula for, to find the matmuls of a composite one (``linear``,
    ``einsum``). Some operators with a kernel of their own also carry a composite form for backends that lack one:
    ``silu_backward``, which autograd calls in every SwiGLU block's backward, runs as one kernel on the CPU and CUDA,
    while its composite form is about eight operators, each a pass over the activation and a transient of its size.
    Traced as the composite, a Llama block's backward was charged those passes and those transients (on a 70B
    model, several GiB of a peak that no real run holds). Only an operator that exists as its composite alone is
    decomposed: that is what runs on the device too.
    """
    name = func.name()
    return any(dispatch_has_kernel(name, key) for key in _KERNEL_KEYS)


def _tensor_bytes(args: Any, kwargs: Any, out: Any) -> int:
    return sum(_nbytes(t) for t in tree_leaves((args, kwargs, out)) if isinstance(t, Tensor))


def _traffic(func: Any, packet: Any, args: Any, kwargs: Any, out: Any) -> int:
    if packet in _NO_TRAFFIC or getattr(func, "is_view", False):
        return 0
    outs = sum(_nbytes(t) for t in tree_leaves(out) if isinstance(t, Tensor))
    if packet in _GATHERS:
        return 2 * outs
    ins = sum(_nbytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor))
    return ins + outs


class ModuleTracer:
    """Hooks on every module of ``module`` that attribute one step at a time (see [Note: what belongs to a module]).

    Args:
        module: the model; every module in ``named_modules()`` gets a record.
        clock: seconds now (synchronising the device first on CUDA).
    """

    def __init__(self, module: nn.Module, clock: Callable[[], float] = time.perf_counter) -> None:
        self.module = module
        self.clock = clock
        self.names = {id(mod): name for name, mod in module.named_modules()}
        # Modules whose subtree holds parameters: the model's calls, as opposed to a torchmetrics Metric's.
        self._holds_parameters = {id(mod) for mod in module.modules() if next(mod.parameters(), None) is not None}
        self._region: LossRegionRecorder | None = None
        self._record: StepRecord | None = None
        self._phase: str | None = None
        self._stack: list[_Frame] = []
        self._started: set[str] = set()
        self._owner: dict[Any, str | None] = {}
        self._hooked: set[Any] = set()  # autograd nodes with timing hooks
        self._handles: list[Any] = []
        self._node_handles: list[Any] = []
        self._memory = False
        self._excluded: set[int] = set()
        self._saved: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._bwd_owner: str | None = None
        self._bwd_start = 0.0
        self._unsized = 0
        self._stretch: tuple[str, int] | None = None  # (owner, live bytes when its stretch of nodes began)
        self._own_grad_bytes = {
            name: sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False) if p.requires_grad)
            for name, mod in module.named_modules()
        }

    # ---------------------------------------------------------------- one step
    @contextmanager
    def iteration(
        self,
        *,
        memory: bool = False,
        ops: bool = False,
        excluded: Iterable[Any] = (),
        region: LossRegionRecorder | None = None,
    ) -> Iterator[StepRecord]:
        """Trace one step run inside the block with :meth:`forward`, :meth:`backward` and :meth:`optimizer`.

        ``memory`` records activations and outputs (``excluded``: tensors whose storages are not activations);
        ``ops`` records operators (FLOPs and tallies). Times are always recorded; they are only meaningful
        without ``ops``, whose dispatch mode costs time per operator. ``region`` is told the instants of the loss
        region (with ``memory``).
        """
        record = StepRecord({name: ModuleRecord() for name in self.names.values()})
        self._record, self._memory = record, memory
        self._region = region if memory else None
        self._excluded = storage_keys(excluded) if memory else set()
        self._stack.clear()
        self._started.clear()
        self._unsized = 0
        for mod in self.module.modules():
            self._handles.append(mod.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post_forward, with_kwargs=True))
        recorder = _OpRecorder(self) if ops else None
        try:
            if recorder is not None:
                with recorder:
                    yield record
            else:
                yield record
        finally:
            record.unsized_tensors = self._unsized
            for handle in self._handles + self._node_handles:
                handle.remove()
            self._handles.clear()
            self._node_handles.clear()
            self._owner.clear()
            self._hooked.clear()
            self._saved.clear()
            self._stack.clear()
            self._record, self._phase, self._region = None, None, None

    @contextmanager
    def forward(self) -> Iterator[None]:
        """The forward part of the step (the user's ``training_step``: forward and loss)."""
        self._phase = "forward"
        try:
            if self._memory:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                    yield
            else:
                yield
        finally:
            self._phase = None

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Run ``loss.backward(*args, **kwargs)`` with every node of the step's graph timed for its module. A manual
        ``training_step`` calls it inside :meth:`forward`, possibly several times: the phase it interrupts resumes."""
        self._claim([loss], None)
        for node, owner in self._owner.items():
            if node not in self._hooked:
                self._hooked.add(node)
                self._node_handles.append(node.register_prehook(self._node_pre(owner)))
                self._node_handles.append(node.register_hook(self._node_post(owner)))
        previous, self._phase = self._phase, "backward"
        if self._region is not None:
            self._region.backward_started()
        try:
            loss.backward(*args, **kwargs)
        finally:
            self._phase = previous
        if self._region is not None:
            self._region.backward_ended()
            self._end_stretch()

    @contextmanager
    def optimizer(self) -> Iterator[None]:
        """The optimizer step (its operators are tallied apart from any module's); inside :meth:`forward` in a manual
        ``training_step``, after which the forward phase resumes."""
        previous, self._phase = self._phase, "optimizer"
        try:
            yield
        finally:
            self._phase = previous

    # ---------------------------------------------------------------- module hooks
    def _pre_forward(self, mod: nn.Module, args: Any, kwargs: Any) -> None:
        if self._phase != "forward":
            return  # a recomputation inside backward (activation checkpointing) runs within a node's interval
        enter = self.clock()
        leaves = tree_leaves((args, kwargs))
        self._claim(leaves, self._stack[-1].name if self._stack else None)
        name = self.names[id(mod)]
        assert self._record is not None
        inputs: dict[int, int] = self._input_storages(leaves) if self._memory else {}
        self._record.modules[name].input_bytes += sum(inputs.values())
        if name not in self._started:  # first call this step
            self._started.add(name)
            self._record.forward_order.append(name)
            self._record.modules[name].caller = self._stack[-1].name if self._stack else ""
            if self._memory:
                self._record.modules[name].inputs = tree_map(_spec, (args, kwargs))
        start = self.clock()
        self._stack.append(_Frame(name, start, start - enter, inputs=frozenset(inputs)))

    def _post_forward(self, mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._phase != "forward" or not self._stack:
            return
        end = self.clock()
        frame = self._stack.pop()
        assert self._record is not None
        record = self._record.modules[frame.name]
        inclusive = end - frame.start
        record.fwd_seconds += inclusive - frame.inner
        record.calls += 1
        leaves = tree_leaves(output)
        output_bytes = sum(_nbytes(t) for t in leaves if isinstance(t, Tensor)) if self._memory else 0
        record.output_bytes += output_bytes
        self._claim(leaves, frame.name)
        if self._stack:
            self._stack[-1].inner += inclusive + frame.hook + (self.clock() - end)
        elif self._region is not None and id(mod) in self._holds_parameters:
            self._region.model_returned(output_bytes, self._record.outside.activation_bytes)

    def _input_storages(self, leaves: Iterable[Any]) -> dict[int, int]:
        storages: dict[int, int] = {}
        for t in leaves:
            if not isinstance(t, Tensor):
                continue
            with suppress(RuntimeError, NotImplementedError):
                storage = t.untyped_storage()
                key = int(storage._cdata)
                if key not in self._excluded:
                    storages[key] = _static(storage.nbytes()) or 0
        return storages

    def _claim(self, leaves: Iterable[Any], owner: str | None) -> None:
        pending = [t.grad_fn for t in leaves if isinstance(t, Tensor) and t.grad_fn is not None]
        while pending:
            node = pending.pop()
            if node in self._owner:
                continue
            self._owner[node] = owner
            pending.extend(nxt for nxt, _ in node.next_functions if nxt is not None and nxt not in self._owner)

    # ---------------------------------------------------------------- autograd hooks
    def _node_pre(self, owner: str | None) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            if owner is not None and self._region is not None:
                self._region.module_backward_started()
                if self._stretch is None or self._stretch[0] != owner:
                    self._end_stretch()
                    self._stretch = (owner, self._region.meter.mark()[1])
            self._bwd_owner = owner
            self._bwd_start = self.clock()

        return hook

    def _end_stretch(self) -> None:
        """Record the stretch of backward nodes of one module that ends here (see [Note: backward transients])."""
        if self._stretch is None or self._region is None or self._record is None:
            return
        owner, base = self._stretch
        self._stretch = None
        added = self._region.meter.mark()[0] - base - self._own_grad_bytes.get(owner, 0)
        record = self._record.modules[owner]
        record.backward_transient_bytes = max(record.backward_transient_bytes, added)

    def _node_post(self, owner: str | None) -> Callable[[Any, Any], None]:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            end = self.clock()
            assert self._record is not None
            self._record.of(owner).bwd_seconds += end - self._bwd_start
            self._bwd_owner = None

        return hook

    def _pack(self, t: Tensor) -> Tensor:
        if self._phase == "forward" and self._record is not None:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return t
            key = int(storage._cdata)
            known = self._saved.get(key)
            # A dead reference: the storage was freed and its address reused by a new one, which counts.
            if key not in self._excluded and (known is None or known() is None):
                self._saved[key] = weakref.ref(storage)
                owner = self._stack[-1].name if self._stack else None
                nbytes = _static(storage.nbytes())
                if nbytes is None:
                    self._unsized += 1
                self._record.of(owner).activation_bytes += nbytes or 0
                for frame in self._stack:
                    if key in frame.inputs:
                        self._record.modules[frame.name].input_saved_bytes += nbytes or 0
        return t

    # ---------------------------------------------------------------- operators
    def _record_op(
        self, flops: int, traffic: int, kernel: ComputeKernel | None = None, *, causal_skipped: int = 0
    ) -> None:
        record = self._record
        if record is None:
            return
        if self._phase == "optimizer":
            tally = record.optimizer_ops
        elif self._phase == "backward":
            owner_record = record.of(self._bwd_owner)
            owner_record.bwd_flops += flops
            tally = owner_record.bwd_ops
        else:
            owner_record = record.of(self._stack[-1].name if self._stack else None)
            owner_record.fwd_flops += flops
            owner_record.fwd_causal_skipped_flops += causal_skipped
            tally = owner_record.fwd_ops
        tally.count(flops, traffic, kernel)


def _unpack(t: Tensor) -> Tensor:
    return t
