"""What profiling measured: plain, serialisable data passed from the profiler to the cost model and solver.

Every per-module figure is *exclusive* ("self"): it counts what belongs to the module itself and not to its
descendants, so the figure of any set of modules (a planning unit: a module and the descendants no other unit
claims) is a plain sum. A parameter shared by several modules (tied embedding and LM head) is counted once, at
the first module that ``named_modules()`` yields holding it; ``ModelProfile.tied`` lists its other holders.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_osdp.profiling.rates import DeviceRates

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "CollectiveFit",
    "LossMemory",
    "ModelProfile",
    "ModuleProfile",
    "StepCalls",
]

PROFILE_FORMAT = "lightning_osdp.profile"
#: ``version`` field of a profile file this release writes; it reads this one and every earlier one (see
#: [Note: profile versions]).
PROFILE_VERSION = 7
_READS_VERSIONS = (1, 2, 3, 4, 5, 6, PROFILE_VERSION)

# [Note: profile versions]
# Version 1 kept the figures later stages read (the forward order, the copy bandwidth, the estimated mode's rates,
# a measured framework time) in the free-form ``info`` object, where the cost model and ``osdp plan
# --hardware-profile`` read them back by key. Version 2 makes them typed fields of ``ModelProfile``; ``info`` keeps
# notes for people only. A version-1 file is read by moving those keys out of ``info`` (``_from_version_1``), so
# profiles saved beside plans and inside checkpoints by earlier releases still load. An earlier release refuses a
# version-2 file by its version, instead of failing on the new fields.
# Version 3 fits the collectives per level of the network (``collectives`` within a node, ``inter_node_collectives``
# across nodes, on ``nodes`` nodes; see ``lightning_osdp/cost_model/network.py``). Every earlier profile was measured
# on one group of ranks, which the cost model treats as one node: it loads with ``nodes`` 1 and no across-node fits.
# Version 3 also adds ``loss`` (the measured memory of the loss region, see ``lightning_osdp/profiling/loss_region.py``)
# and ``measured_peak_correction``. An earlier file reads with ``loss = None``, which the cost model counts as
# version 2 did (the activations saved outside modules and the last module's output), and no correction.
# Version 4 adds the blocks' figures under selective recomputation (``ModuleProfile.selective_kept_bytes``,
# ``selective_forward_bytes``, ``selective_replay_seconds``). An earlier file reads with them ``None``: its plans
# offer no selective recomputation, and predicting one made by hand says to profile again.
# Version 5 adds ``gradient_accumulation`` (micro-batches per optimizer step) and
# ``ModuleProfile.backward_transient_bytes`` and ``caller``. An earlier file reads with 1 and ``None``, as its plans
# were made.
# Version 6 adds ``ModuleProfile.fwd_causal_skipped_flops`` (the forward FLOPs causal attention skips, for an MFU that
# counts it in full). An earlier file reads with 0: both MFU conventions then read its FLOPs as traced.
# Version 6 also adds ``step_calls`` (the step's ``self.log`` values and collectives, which the cost model prices as
# the training loop's time around the step). An earlier file reads with ``None``: the loop at the device's constant.
# Version 7 adds ``ModuleProfile.recompute_replay_seconds`` (what a block's full recomputation runs: its forward up to
# its last saved tensor) and ``forward_peak_bytes`` (a block's forward peak, temporaries included). An earlier file
# reads with ``None``: a full recomputation is charged the whole forward, and a block's forward peak is its modules'.
_VERSION_1_FIELDS = ("forward_order", "copy_bytes_per_second", "rates", "framework_seconds")


@dataclass
class ModuleProfile:
    """One module's own figures (see the module docstring: exclusive of descendants).

    Attributes:
        name: qualified name in ``named_modules()``; ``""`` is the root (the LightningModule).
        type: class name.
        parent: the parent's name (``None`` for the root).
        children: names of direct children.
        param_count: number of elements of the module's own parameters (``recurse=False``).
        param_bytes: their bytes, as stored (after the precision plugin's conversion).
        param_shapes: shapes of the own parameters (FSDP2 pads dim 0 to a multiple of the world size).
        trainable_param_bytes: bytes of own parameters with ``requires_grad``.
        grad_bytes: gradient bytes of the own trainable parameters (same dtype as the parameters).
        optim_state_bytes: optimizer-state bytes for the own trainable parameters.
        activation_bytes: bytes saved for backward by operators run in this module's own forward code
            (not in a child's), per training step on this rank's micro-batch.
        output_bytes: bytes of the module's forward output.
        fwd_seconds: own forward compute time (inclusive time minus the children's inclusive times).
        bwd_seconds: own backward compute time, likewise.
        fwd_flops: own forward FLOPs (``torch.utils.flop_counter``), for the estimated mode and sanity checks;
            causal attention at the scores its fused kernels compute (``lightning_osdp/profiling/tracer.py``
            [Note: causal attention]).
        fwd_causal_skipped_flops: the forward FLOPs of causal attention's scores above the diagonal, which its
            kernels skip and ``fwd_flops`` leaves out: ``fwd_flops`` plus these count causal attention in full, as
            PaLM's and torchtitan's MFU do. ``0`` in a profile from before version 6.
        buffer_bytes: bytes of the module's own buffers (BatchNorm statistics, registered masks); FSDP2 never
            shards buffers, so every rank holds them whatever the mode.
        optim_scalar_bytes: optimizer state that does not scale with the parameter (Adam's 0-dim ``step``, 4 bytes
            per parameter tensor): every rank keeps one per parameter tensor it holds, sharded or not. Not part
            of ``optim_state_bytes``, which is what shards.
        input_bytes: bytes of the tensors the module's forward is called with (distinct storages; parameters,
            buffers and the batch excluded): what activation checkpointing keeps of it for backward (``None``: not
            measured, a profile from before this field).
        input_saved_bytes: the part of ``input_bytes`` first saved for backward inside this module's subtree (so
            counted in its and its descendants' ``activation_bytes``); ``None`` likewise.
        recompute_forward_bytes: for a block (a parameter-owning child of a ``ModuleList``/``Sequential``), the
            largest live bytes its forward adds, output included, when it runs under activation checkpointing (it
            saves nothing; what its own code holds between its children's calls is alive meanwhile); measured by
            running the step's forward once more with every block checkpointed. ``None``: not measured.
        forward_peak_bytes: for a block, the largest live bytes its forward adds when it runs without recomputation,
            what it saves for backward and its output included: beyond the two, the temporaries its own code and its
            operators hold at once (a residual sum beside the output it is added to), which the walk over its modules
            does not see; measured by running each block's forward once more in the full-recomputation pass.
            ``None``: not measured (a profile from before version 7).
        recompute_replay_seconds: for a block, the seconds its full recomputation runs in backward: its forward up to
            the last tensor it saves for backward, where torch's recomputation stops (``lightning_osdp/profiling/
            replay.py`` [Note: the recomputation stops at the last saved tensor]); timed on the device in measured
            mode, from its operators' FLOPs and bytes at the profile's rates otherwise. ``None``: not measured (a
            profile from before version 7): the cost model then charges the whole forward.
        selective_kept_bytes: for a block, the bytes its forward keeps for backward under selective recomputation
            (``recompute="selective"``: the outputs of its matrix products and attention, see
            ``lightning_osdp/apply/recompute.py`` [Note: selective recomputation]), its subtree's, inputs excluded:
            the live bytes its checkpointed forward leaves beyond its output; measured by running the step's
            forward once more with every block checkpointed so. ``None``: not measured (then the planner does not
            offer selective recomputation for the block).
        selective_forward_bytes: the largest live bytes that forward adds, output included (as
            ``recompute_forward_bytes`` for full recomputation); ``None`` likewise.
        selective_replay_seconds: the seconds the recomputation of the block under selective recomputation runs in
            backward (its operators but the kept ones): timed on the device in measured mode (the replay run as
            torch runs it, the kept outputs served from the cache), from its operators' FLOPs and bytes at the
            profile's rates otherwise. ``None`` likewise.
        backward_transient_bytes: the largest live bytes the module's own backward adds beyond the gradient of its
            output and its own parameters' gradients (the gradients between its operators, a kernel's temporaries;
            ``lightning_osdp/profiling/tracer.py`` [Note: backward transients]). ``None``: not measured (a profile
            from before version 5); the cost model then counts the gradient of its input alone.
        caller: the innermost module running when its forward was first called (``""``: the root, or the step's own
            code), which is not its parent for a module run by another's hook; ``None``: it never ran, or a profile
            from before version 5.
    """

    name: str
    type: str
    parent: str | None
    children: list[str] = field(default_factory=list)
    param_count: int = 0
    param_bytes: int = 0
    param_shapes: list[list[int]] = field(default_factory=list)
    trainable_param_bytes: int = 0
    grad_bytes: int = 0
    optim_state_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    fwd_seconds: float = 0.0
    bwd_seconds: float = 0.0
    fwd_flops: int = 0
    fwd_causal_skipped_flops: int = 0
    buffer_bytes: int = 0
    optim_scalar_bytes: int = 0
    input_bytes: int | None = None
    input_saved_bytes: int | None = None
    recompute_forward_bytes: int | None = None
    recompute_replay_seconds: float | None = None
    forward_peak_bytes: int | None = None
    selective_kept_bytes: int | None = None
    selective_forward_bytes: int | None = None
    selective_replay_seconds: float | None = None
    backward_transient_bytes: int | None = None
    caller: str | None = None


@dataclass
class CollectiveFit:
    """Time of one collective on the real process group: ``seconds(bytes) = alpha + bytes / beta``.

    ``bytes`` is the size of the *full* (unsharded) buffer: the gathered output of all-gather, the input of
    reduce-scatter, the buffer of all-reduce. ``samples`` are the measured ``(bytes, seconds)`` pairs.
    """

    op: str
    world_size: int
    alpha_seconds: float
    beta_bytes_per_second: float
    samples: list[tuple[int, float]] = field(default_factory=list)

    def seconds(self, nbytes: float) -> float:
        """Predicted time of one call moving ``nbytes`` (0 for an empty call)."""
        if nbytes <= 0:
            return 0.0
        return self.alpha_seconds + nbytes / self.beta_bytes_per_second


@dataclass(frozen=True)
class StepCalls:
    """What one profiled ``training_step`` asked of Lightning beyond its tensors, counted while it ran on the copy
    (where those calls do nothing, ``lightning_osdp/profiling/step.py`` [Note: logging while profiling]): the cost
    model prices them as the training loop's time around the step (``lightning_osdp/cost_model/config.py``).

    Attributes:
        logged: values logged (``self.log`` calls, and each entry of ``self.log_dict``).
        synced: of those, the ones logged with ``sync_dist=True`` (an all-reduce each).
        gathered: tensors gathered by ``self.all_gather`` (an all-gather each).
        backwards: backward passes per micro-batch: 1 under automatic optimization, the ``manual_backward`` calls
            under manual optimization (a GAN's generator and discriminator: 2). DDP all-reduces its buckets in each.
    """

    logged: int = 0
    synced: int = 0
    gathered: int = 0
    backwards: int = 1


@dataclass
class LossMemory:
    """The memory of a step's *loss region*: from the instant the model's last call returns (its output, the logits,
    in hand) to the instant the first module's backward runs. Live bytes measured on the device in the profiled
    step (see ``lightning_osdp/profiling/loss_region.py`` [Note: the loss region]), each relative to the live bytes
    at an instant, so that the cost model adds them to the level it predicts there.

    Attributes:
        output_bytes: the output of the model's last call (the logits), live when the region starts.
        forward_peak_bytes: the largest live bytes from the region's start to the start of backward, above those at
            the start: the loss's and the metrics' transients (log-softmax, a float copy of the logits).
        backward_start_bytes: live bytes when backward starts less those at the region's start: what the loss keeps
            for backward (its saved tensors, tensors a returned dict holds) less what it freed (the logits, when
            nothing keeps them). Negative when it frees more than it keeps.
        backward_peak_bytes: the largest live bytes from the start of backward until the first module's backward
            runs, above those at the start of backward: the loss's gradients.
        backward_end_bytes: live bytes when the first module's backward runs less those at the start of backward:
            the gradient of the output, less the loss's saved tensors freed.
        outside_activation_bytes: tensors saved for backward outside every module before the region (part of
            ``ModelProfile.extra_activation_bytes``, which also counts the region's own).
    """

    output_bytes: int = 0
    forward_peak_bytes: int = 0
    backward_start_bytes: int = 0
    backward_peak_bytes: int = 0
    backward_end_bytes: int = 0
    outside_activation_bytes: int = 0


@dataclass
class ModelProfile:
    """A model measured on one device, with the collectives of its process group.

    Attributes:
        modules: name -> :class:`ModuleProfile`, in ``named_modules()`` order.
        collectives: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` -> :class:`CollectiveFit` within a
            node: on the ranks of one node, every node at once (on one node, the world).
        world_size: ranks of the process group the collectives were measured on.
        nodes: nodes those ranks were on (``world_size / nodes`` on each).
        inter_node_collectives: the same three fits across nodes: on groups of one rank per node, every such group
            at once (empty on one node). The cost model prices every group of a topology from the two levels
            (``lightning_osdp/cost_model/network.py``).
        device: ``"cpu"`` or ``"cuda"`` (and the device name, when known).
        mode: ``"measured"`` (a copy of the model ran on the device), ``"estimated"`` (fake tensors, FLOP-based
            times) or ``"blocks"`` (fake tensors for the bytes, each distinct block timed on the device).
        optimizer: the optimizer's class name, and ``optim_state_factor``: state bytes per trainable
            parameter byte it keeps (Adam/AdamW 2, SGD with momentum 1, plain SGD 0).
        tied: groups of module names that hold one shared parameter.
        batch: description of the representative batch: ``tensors`` (shape, dtype, device of each), ``bytes``
            (their storages) and ``source`` (where it came from).
        step_overhead_seconds: per-step time outside modules (loss, optimizer step, framework): the measured time
            of a whole unhooked step (forward, backward, ``optimizer.step()``, ``zero_grad``) less the modules' own
            forward and backward times, so that the modules' times plus this add up to the measured step.
        optimizer_step_seconds: the part of ``step_overhead_seconds`` spent in ``optimizer.step()`` over the
            unsharded parameters (it shrinks with the parameters a rank updates).
        extra_activation_bytes: saved-for-backward bytes outside any module's forward (loss computation). The cost
            model reads it only when ``loss`` is ``None``.
        profiling_seconds: wall time spent profiling (collectives included).
        info: notes for people, read by no stage: the torch version and thread count, the measured step time and
            its unattributed part, how long the collective benchmark took, how the optimizer state was counted.
        forward_order: module names in the order their forward first ran (the cost model's timeline follows it;
            empty: registration order).
        copy_bytes_per_second: memory-copy bandwidth measured on the device, or the target's for a dry run
            (``None``: not measured). The cost model's copy rate on a GPU; on the CPU it uses a constant calibrated
            for FSDP2's copies instead (see ``lightning_osdp/cost_model/config.py``).
        rates: the rates the estimated mode converted FLOPs and bytes into seconds with (``None`` in measured mode).
        framework_seconds: per-step time of the training loop around the profiled step (Lightning's closure,
            hooks, ``sync_dist`` logging), when measured; ``None``: the cost model uses its device default.
        mixed_precision: ``{"param_dtype": ..., "reduce_dtype": ...}`` (``torch`` dtype names) when the step ran as
            under FSDP2's ``MixedPrecisionPolicy`` (``OSDPStrategy(mixed_precision=...)``): traced with the parameters
            in ``param_dtype``, while the byte figures of parameters, gradients and optimizer state are of the
            parameters as stored (see ``lightning_osdp/profiling/mixed_precision.py``); ``None``: no policy.
        loss: the measured memory of the loss region (:class:`LossMemory`); ``None`` in a profile from before it
            was measured (version 2 and earlier).
        measured_peak_correction: bytes a run measured above its plan's predicted peak when that peak went over the
            memory budget (recorded by ``OSDPStrategy`` at its first check, see ``docs/how-it-works.md``); the cost
            model holds them for the whole step, so that a plan made from this profile keeps them free.
        step_calls: the step's logging and gathering calls (:class:`StepCalls`), counted by the profile (none for a
            plain module's ``forward``); ``None`` in a profile from before version 6.
        gradient_accumulation: micro-batches per optimizer step (the Trainer's ``accumulate_grad_batches``, set by
            ``OSDPStrategy``): above 1, every unit holds its unsharded gradients from the first micro-batch's
            backward to the last one's reduction (see ``lightning_osdp/cost_model/timeline.py`` [Note: gradient
            accumulation]).
    """

    modules: dict[str, ModuleProfile]
    collectives: dict[str, CollectiveFit] = field(default_factory=dict)
    world_size: int = 1
    device: str = "cpu"
    mode: str = "measured"
    optimizer: str = ""
    optim_state_factor: float = 0.0
    tied: list[list[str]] = field(default_factory=list)
    batch: dict[str, Any] = field(default_factory=dict)
    step_overhead_seconds: float = 0.0
    extra_activation_bytes: int = 0
    profiling_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    optimizer_step_seconds: float = 0.0
    forward_order: list[str] = field(default_factory=list)
    copy_bytes_per_second: float | None = None
    rates: DeviceRates | None = None
    framework_seconds: float | None = None
    mixed_precision: dict[str, str] | None = None
    nodes: int = 1
    inter_node_collectives: dict[str, CollectiveFit] = field(default_factory=dict)
    loss: LossMemory | None = None
    measured_peak_correction: int = 0
    gradient_accumulation: int = 1
    step_calls: StepCalls | None = None

    def __str__(self) -> str:
        """The profile as a plain-text table (:func:`~lightning_osdp.profiling.report.format_profile`)."""
        from lightning_osdp.profiling.report import format_profile

        return format_profile(self)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """The JSON document :meth:`save` writes."""
        data = asdict(self)
        data["modules"] = [asdict(m) for m in self.modules.values()]
        if self.rates is not None:
            data["rates"] = self.rates.to_dict()
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> ModelProfile:
        """Parse a profile document of this version or an earlier one (see [Note: profile versions])."""
        version = data.get("version")
        if data.get("format") != PROFILE_FORMAT or isinstance(version, bool) or version not in _READS_VERSIONS:
            raise ValueError(
                f"{source}: not a lightning_osdp profile of version {', '.join(map(str, _READS_VERSIONS))} "
                f"(format={data.get('format')!r}, version={data.get('version')!r})"
            )
        body = {k: v for k, v in data.items() if k not in ("format", "version")}
        if version == 1:
            body = _from_version_1(body)
        modules = {m["name"]: ModuleProfile(**m) for m in body.pop("modules")}
        collectives = _fits(body.pop("collectives", {}))
        inter_node = _fits(body.pop("inter_node_collectives", {}))
        rates = body.pop("rates", None)
        loss = body.pop("loss", None)
        calls = body.pop("step_calls", None)
        return cls(
            step_calls=StepCalls(**calls) if calls is not None else None,
            modules=modules,
            collectives=collectives,
            inter_node_collectives=inter_node,
            rates=DeviceRates(**rates) if rates is not None else None,
            loss=LossMemory(**loss) if loss is not None else None,
            **body,
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON (atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelProfile:
        """Read a profile written by :meth:`save`."""
        path = Path(path)
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    def with_correction(self, missed_bytes: int) -> ModelProfile:
        """A copy whose ``measured_peak_correction`` is ``missed_bytes`` larger (a run measured that much above the
        prediction made with this profile)."""
        if missed_bytes < 0:
            raise ValueError(f"a measured correction only grows, got {missed_bytes} bytes")
        return dataclasses.replace(self, measured_peak_correction=self.measured_peak_correction + missed_bytes)

    # ------------------------------------------------------------------ queries
    def subtree(self, name: str) -> list[str]:
        """``name`` and all its descendants."""
        prefix = name + "." if name else ""
        return [m for m in self.modules if m == name or m.startswith(prefix)]

    @property
    def total_param_bytes(self) -> int:
        return sum(m.param_bytes for m in self.modules.values())


def _fits(data: Mapping[str, Any]) -> dict[str, CollectiveFit]:
    return {op: CollectiveFit(**{**c, "samples": [tuple(s) for s in c.get("samples", [])]}) for op, c in data.items()}


def _from_version_1(body: dict[str, Any]) -> dict[str, Any]:
    """A version-1 profile's fields as version 2 has them: the typed figures moved out of ``info``."""
    info = dict(body.get("info") or {})
    moved = {key: info.pop(key) for key in _VERSION_1_FIELDS if key in info}
    # The cost model read this key when ``optimizer_step_seconds`` was 0; kept, so that such a file predicts the same.
    legacy_optimizer = info.pop("optimizer_seconds", None)
    if not body.get("optimizer_step_seconds") and legacy_optimizer:
        moved["optimizer_step_seconds"] = float(legacy_optimizer)
    return {**body, **moved, "info": info}
