"""The sharding plan: which data-parallel mode, which operator-splitting factor, and whether to recompute its
activations, each module takes.

A :class:`Plan` is plain data. It is produced by the solver (or written by hand), applied by
:func:`lightning_osdp.apply_plan`, printed at setup and saved beside checkpoints. Module names are those of
``LightningModule.named_modules()``; the empty string ``""`` names the LightningModule itself.

[Note: what a decision covers]
A decision on module ``m`` covers every parameter under ``m`` that is not covered by the decision of a
descendant, exactly as one ``fully_shard(m)`` call in FSDP2 groups the parameters not already grouped by an
earlier call on a submodule. Each decided module is therefore one *communication unit*: its parameters are
all-gathered in one collective and its gradients reduced in one collective. Parameters under no decision at
all belong to the root unit ``""``, which is ``no_shard`` unless the plan says otherwise.

A decision's ``recompute`` covers the decided module's whole forward (its subtree) and is one of
:data:`RECOMPUTATIONS`: ``"none"`` (it saves what autograd saves), ``"full"`` (activation checkpointing: it saves
only its inputs, and backward runs its forward once more) or ``"selective"`` (per-operator checkpointing: it also
keeps the outputs of its matrix products and attention, and backward runs only the other operators again); see
``lightning_osdp/apply/recompute.py``.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from lightning_osdp.errors import PlanError
from lightning_osdp.grouping import ROOT, covering_decision
from lightning_osdp.solve_report import SolveReport

__all__ = [
    "MAX_PLAN_FILE_BYTES",
    "MODES",
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "RECOMPUTATIONS",
    "RECOMPUTE_NAMES",
    "Decision",
    "DecisionLike",
    "Mode",
    "Plan",
    "PlanError",
    "Recomputation",
    "default_units",
]

Mode = Literal["no_shard", "shard_grad_op", "full_shard", "hybrid_shard"]

#: The data-parallel modes, named after ``torch.distributed.fsdp.ShardingStrategy``.
#: ``no_shard``: parameters replicated, gradients all-reduced (DDP).
#: ``shard_grad_op``: parameters sharded, gathered before forward and kept until backward is done (ZeRO-2-like).
#: ``full_shard``: parameters sharded, gathered for forward, freed, gathered again for backward (ZeRO-3).
#: ``hybrid_shard``: ``full_shard`` within a shard group (by default one node's ranks), replicated across the groups:
#: gathers stay within the group, gradients are reduce-scattered in it and then all-reduced across the groups (HSDP,
#: FSDP2 on a 2-D mesh; see ``lightning_osdp/topology.py``). On one node of one group it is ``full_shard``.
MODES: tuple[str, ...] = ("no_shard", "shard_grad_op", "full_shard", "hybrid_shard")

Recomputation = Literal["none", "selective", "full"]

#: What a decision's ``recompute`` may be: nothing recomputed, per-operator (selective) or whole-forward recomputation.
RECOMPUTATIONS: tuple[str, ...] = ("none", "selective", "full")
#: The one name every report gives a recomputation (as published runs do): activation checkpointing, ``AC``, for
#: ``"full"``; selective activation checkpointing, ``SAC``, for ``"selective"``.
RECOMPUTE_NAMES: dict[str, str] = {"full": "AC", "selective": "SAC"}

#: ``format`` field of a plan file.
PLAN_FORMAT = "lightning_osdp.plan"
#: ``version`` field of a plan file this release writes (it reads this one and every earlier one).
#: Version 2 added a decision's ``recompute`` (``true``/``false``); a version-1 file is read with ``"none"`` everywhere.
#: Version 3 makes it one of :data:`RECOMPUTATIONS` (``"selective"`` is new); a version-2 file's ``true`` reads as
#: ``"full"`` and ``false`` as ``"none"`` (version 3 accepts the booleans too, with the same meaning).
PLAN_VERSION = 3
_READS_VERSIONS = (1, 2, 3)

# The solver's `info` is 3 levels deep; Python's JSON encoder (with `indent`) recurses per level.
_MAX_INFO_NESTING = 64

#: The largest plan file :meth:`Plan.load` reads. A plan of 100,000 modules, saved with long names, splits and
#: recomputation, is 12.2 MiB; a larger file is no plan (a device, a log, a dataset given by mistake), and reading it
#: whole would cost its size in memory before the JSON could be refused.
MAX_PLAN_FILE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Decision:
    """One module's choice.

    Args:
        mode: one of :data:`MODES`.
        split: operator-splitting factor; ``k > 1`` cuts the module (an ``nn.Linear``) into ``k`` slices along
            its output features that run one after another, each its own communication unit.
        recompute: one of :data:`RECOMPUTATIONS`. ``"full"``: the module's forward runs under activation
            checkpointing, keeping only its inputs for backward, and backward runs the forward again
            (``Decision("full_shard", recompute="full")``; in a plan file ``{"mode": "full_shard", "recompute":
            "full"}``). ``"selective"``: per-operator checkpointing, which also keeps the outputs of matrix products
            and attention and runs only the other operators again. ``"none"``: neither. ``True`` and ``False`` are
            read as ``"full"`` and ``"none"`` (the attribute always holds the string).
    """

    mode: str
    split: int = 1
    recompute: Recomputation = "none"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PlanError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if isinstance(self.split, bool) or not isinstance(self.split, int) or self.split < 1:
            raise PlanError(f"split must be an integer >= 1, got {self.split!r}")
        # Frozen: the normalised value is set the way dataclasses set fields.
        object.__setattr__(self, "recompute", as_recomputation(self.recompute))

    @property
    def recomputes(self) -> bool:
        """Whether the module's forward runs again in backward, wholly or selectively."""
        return self.recompute != "none"

    def to_dict(self) -> dict[str, Any]:
        """The decision as the JSON object written in a plan file (``recompute`` only when not ``"none"``)."""
        out: dict[str, Any] = {"mode": self.mode, "split": self.split}
        if self.recomputes:
            out["recompute"] = self.recompute
        return out


def as_recomputation(value: object) -> Recomputation:
    """``value`` as one of :data:`RECOMPUTATIONS` (``True`` is ``"full"``, ``False`` is ``"none"``); anything else
    raises :class:`PlanError`."""
    if value is True:
        return "full"
    if value is False:
        return "none"
    if isinstance(value, str) and value in RECOMPUTATIONS:
        return value  # type: ignore[return-value]
    raise PlanError(f"recompute must be one of {', '.join(map(repr, RECOMPUTATIONS))} (or true/false), got {value!r}")


#: What :class:`Plan` accepts for one module: a :class:`Decision`, a mode string, a ``(mode, split)`` or
#: ``(mode, split, recompute)`` tuple (``recompute`` a string of :data:`RECOMPUTATIONS` or a bool) or a
#: ``{"mode": ..., "split": ..., "recompute": ...}`` mapping.
DecisionLike = Decision | str | tuple[str, int] | tuple[str, int, bool | str] | Mapping[str, Any]


@dataclass(init=False)
class Plan:
    """Per-module sharding decisions, plus where the plan came from.

    Args:
        decisions: module qualified name -> :class:`Decision` (a ``(mode, split)`` tuple, a mode string or a
            ``{"mode": ..., "split": ...}`` mapping is accepted and converted).
        info: free-form provenance (``"source"``, the dry run's settings...). With a ``report``, it also holds the
            report's figures under the names it has always given them (``info["predicted_peak_bytes"]``...: see
            :meth:`SolveReport.as_info <lightning_osdp.solve_report.SolveReport.as_info>`). Saved and loaded with
            the plan; never read by the executor.
        report: the solver's typed record of how it made the plan and what it predicts (``None`` for a plan
            written by hand or made uniform).
    """

    decisions: dict[str, Decision]
    info: dict[str, Any] = field(default_factory=dict)
    report: SolveReport | None = None

    def __init__(
        self,
        decisions: Mapping[str, DecisionLike],
        info: dict[str, Any] | None = None,
        report: SolveReport | None = None,
    ) -> None:
        converted: dict[str, Decision] = {}
        for name, value in dict(decisions).items():
            if not isinstance(name, str):
                raise PlanError(f"module names must be strings, got {name!r}")
            converted[name] = _as_decision(name, value)
        self.decisions = converted
        self.info = {} if info is None else info
        self.report = report
        if report is not None:
            # The report is the source of truth for its figures (see [Note: the report and plan.info]).
            self.info = {**self.info, **report.as_info()}

    # ------------------------------------------------------------------ construction
    @classmethod
    def uniform(
        cls,
        module: nn.Module,
        mode: str,
        units: Iterable[str] | None = None,
        *,
        recompute: bool | Recomputation = "none",
    ) -> Plan:
        """The same ``mode`` for the root and every unit (by default :func:`default_units`), each unit recomputing
        its activations as ``recompute`` says (one of :data:`RECOMPUTATIONS`; ``True`` is ``"full"``).

        ``Plan.uniform(model, "full_shard")`` is FSDP with one unit per block, ``"no_shard"`` is DDP;
        ``Plan.uniform(model, "full_shard", recompute="full")`` is FSDP with every block checkpointed,
        ``recompute="selective"`` with every block's elementwise operators recomputed.
        """
        names = list(default_units(module) if units is None else units)
        how = as_recomputation(recompute)
        decisions = {ROOT: Decision(mode), **{name: Decision(mode, recompute=how) for name in names}}
        source = f"uniform:{mode}" + {"none": "", "full": "+recompute", "selective": "+selective"}[how]
        return cls(decisions, info={"source": source})

    # ------------------------------------------------------------------ queries
    def mode_of(self, name: str) -> str:
        """The mode of the unit that owns module ``name``'s own parameters."""
        return self.decisions[self.unit_of(name)].mode

    def unit_of(self, name: str) -> str:
        """The decided module whose decision covers module ``name`` (its nearest decided ancestor or itself)."""
        return covering_decision(self.decisions, name)

    def __iter__(self) -> Iterator[tuple[str, Decision]]:
        return iter(sorted(self.decisions.items()))

    def validate(self, module: nn.Module) -> None:
        """Check the plan against ``module``; raise :class:`PlanError` naming the first bad entry: a module the model
        does not have, a module without parameters, a split the module cannot take, a recomputed root.

        Cheap and changes nothing: :class:`~lightning_osdp.OSDPStrategy` runs it first thing in ``setup``, before the
        model is cast, moved or profiled."""
        modules = dict(module.named_modules())
        for name, decision in self.decisions.items():
            if name not in modules:
                close = _closest(name, modules)
                hint = f" (did you mean {close!r}?)" if close else ""
                raise PlanError(
                    f"plan names module {name!r}, which the model does not have{hint}; names are those of "
                    "LightningModule.named_modules()"
                )
            if name != ROOT and next(modules[name].parameters(), None) is None:
                raise PlanError(
                    f"plan decides on module {name!r} ({type(modules[name]).__name__}), which holds no parameters: a "
                    "decision says how a module's parameters are sharded or replicated, and FSDP2 cannot shard a "
                    "module without any (a torchmetrics metric, an activation, a buffer-only module). Remove the "
                    "decision, or put it on the module that holds the parameters"
                )
            if decision.split > 1:
                reason = unsplittable_reason(name, decision.split, modules)
                if reason:
                    raise PlanError(f"module {name!r}: split={decision.split} {reason}")
            parent = modules[name.rpartition(".")[0]] if name != ROOT else None
            if isinstance(parent, nn.MultiheadAttention) and decision.mode != "no_shard":
                raise PlanError(
                    f"module {name!r}: {decision.mode} needs a module that is called, and {type(parent).__name__} "
                    "reads its output projection's weight directly, so FSDP2's hooks on it never gather it; decide on "
                    f"the {type(parent).__name__} ({name.rpartition('.')[0]!r}) instead"
                )
            if decision.recomputes and name == ROOT:
                raise PlanError(
                    "the root decision '' cannot recompute: Lightning runs training_step, not the LightningModule's "
                    "forward, so there is no forward to checkpoint; set recompute on the blocks (submodules) instead"
                )

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """The plan as the JSON document :meth:`save` writes (see ``docs/plan-format.md``)."""
        data = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "decisions": {name: d.to_dict() for name, d in sorted(self.decisions.items())},
            "info": self.info,
        }
        if self.report is not None:
            data["report"] = self.report.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> Plan:
        """Parse a plan document; errors name the source, the module and the field."""
        if not isinstance(data, Mapping):
            raise PlanError(f"{source}: a plan must be a JSON object, got {type(data).__name__}")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source}: field 'format' must be {PLAN_FORMAT!r}, got {data.get('format')!r}")
        version = data.get("version")
        if isinstance(version, bool) or version not in _READS_VERSIONS:
            raise PlanError(
                f"{source}: plan file version {version!r} is not supported "
                f"(this lightning_osdp reads versions {', '.join(map(str, _READS_VERSIONS))})"
            )
        fields_allowed = {"mode", "split"} if version == 1 else {"mode", "split", "recompute"}
        raw = data.get("decisions")
        if not isinstance(raw, Mapping):
            raise PlanError(f"{source}: field 'decisions' must be an object mapping module names to decisions")
        decisions: dict[str, Decision] = {}
        for name, entry in raw.items():
            if not isinstance(entry, Mapping):
                raise PlanError(f"{source}: module {name!r}: a decision must be an object with 'mode' and 'split'")
            unknown = set(entry) - fields_allowed
            if unknown:
                raise PlanError(f"{source}: module {name!r}: unknown field(s) {sorted(unknown)}")
            if "mode" not in entry:
                raise PlanError(f"{source}: module {name!r}: field 'mode' is missing")
            recompute = entry.get("recompute", "none")
            if version == 2 and not isinstance(recompute, bool):
                raise PlanError(
                    f"{source}: module {name!r}: field 'recompute': must be true or false in a version-2 plan file, "
                    f'got {recompute!r} ("selective" needs version 3)'
                )
            try:
                decisions[name] = Decision(entry["mode"], entry.get("split", 1), recompute)
            except PlanError as err:
                field_name = next(f for f in ("mode", "split", "recompute") if str(err).startswith(("unknown " + f, f)))
                raise PlanError(f"{source}: module {name!r}: field {field_name!r}: {err}") from None
        info = data.get("info", {})
        if not isinstance(info, dict):
            raise PlanError(f"{source}: field 'info' must be an object")
        if _nesting(info) > _MAX_INFO_NESTING:
            # A plan is saved again (beside checkpoints) by an encoder that recurses per level: refuse it now.
            raise PlanError(f"{source}: field 'info' is nested more than {_MAX_INFO_NESTING} levels deep")
        if data.get("report") is None:
            # A file from before reports existed: the solver's figures are in `info` only.
            return cls(decisions, info=info, report=SolveReport.from_info(info))
        try:
            report = SolveReport.from_dict(data["report"])
        except ValueError as err:
            raise PlanError(f"{source}: field 'report': {err}") from None
        return cls(decisions, info=info, report=report)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as versioned JSON (atomically: a crash, or another process saving to the same path at the
        same time, leaves a complete plan file at ``path``, never a partial one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temporary name of this call alone, in the same directory (so the rename stays on one file system): every
        # rank of a run saves the plan, and a name shared between processes would be renamed away by one of them
        # while another still writes it.
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "x") as f:
                f.write(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan file written by :meth:`save` (or by hand); anything that is not one raises :class:`PlanError`."""
        path = Path(path)
        try:
            text = _read_plan_file(path).decode("utf-8")
        except UnicodeDecodeError as err:
            raise PlanError(f"{path}: not a plan file (not UTF-8 text: {err.reason} at byte {err.start})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"{path}: not valid JSON ({err})") from None
        except RecursionError:
            raise PlanError(f"{path}: not a plan file (its JSON is nested too deeply to read)") from None
        return cls.from_dict(data, source=str(path))

    def counts(self) -> str:
        """The decisions by mode, then the splits and recomputations, named as every report names them (full
        recomputation ``AC``, selective ``SAC``: :data:`RECOMPUTE_NAMES`): ``"1 no_shard, 34 hybrid_shard, 2 split,
        33 AC"`` (empty for no decision)."""
        decisions = list(self.decisions.values())
        counts = [(m, sum(d.mode == m for d in decisions)) for m in MODES]
        counts.append(("split", sum(d.split > 1 for d in decisions)))
        counts += [(name, sum(d.recompute == how for d in decisions)) for how, name in RECOMPUTE_NAMES.items()]
        return ", ".join(f"{n} {label}" for label, n in counts if n)

    def summary(self) -> str:
        """One line: ``Plan(N decisions: ...)`` with :meth:`counts`."""
        return f"Plan({len(self.decisions)} decisions: {self.counts() or 'empty'})"


def _read_plan_file(path: Path) -> bytes:
    """The bytes of plan file ``path``, read only when it is a regular file of at most :data:`MAX_PLAN_FILE_BYTES`.

    Opened once, without blocking (a FIFO without a writer would wait for one forever), and checked on the open
    file before anything is read: a device (``/dev/zero`` never ends), a FIFO or a socket is refused, and so is a file
    larger than the bound. At most one byte past the bound is read, in case the file grows meanwhile."""
    shown = str(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise PlanError(f"plan file {shown!r} does not exist") from None
    except IsADirectoryError:
        raise PlanError(f"plan file {shown!r} is a directory; give the path of a plan's JSON file") from None
    except OSError as err:
        raise PlanError(f"cannot read plan file {shown!r}: {err.strerror or err}") from None
    limit = f"{MAX_PLAN_FILE_BYTES // 2**20} MiB"
    too_large = (
        f"refusing to read plan file {shown!r}: it is larger than {limit}, the most a plan file may be (a plan of "
        "100,000 modules is about 12 MiB); give the path of a plan's JSON file, as Plan.save writes it"
    )
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise PlanError(f"plan file {shown!r} is a directory; give the path of a plan's JSON file")
        if not stat.S_ISREG(info.st_mode):
            raise PlanError(
                f"refusing to read plan file {shown!r}: it is {_file_kind(info.st_mode)}, not a regular file; give "
                "the path of a plan's JSON file, as Plan.save writes it"
            )
        if info.st_size > MAX_PLAN_FILE_BYTES:
            raise PlanError(too_large)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_PLAN_FILE_BYTES + 1)
    except OSError as err:
        raise PlanError(f"cannot read plan file {shown!r}: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_PLAN_FILE_BYTES:
        raise PlanError(too_large)
    return data


def _file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    kinds = (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def default_units(module: nn.Module) -> list[str]:
    """Communication units for a hand-made plan: each parameter-owning element of a ``ModuleList`` or
    ``Sequential`` (a Transformer block, say) that is not inside another unit.

    Everything else (embeddings, final norm, head) stays with the root unit ``""``, so tied weights
    (embedding and LM head) are never split across units. Blocks, not leaves, because one collective per tiny
    parameter is latency-bound: FSDP and DDP both bucket.
    """
    units: list[str] = []
    for name, sub in module.named_modules():
        if not isinstance(sub, (nn.ModuleList, nn.Sequential)):
            continue
        for child_name, child in sub.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if any(full.startswith(u + ".") for u in units):
                continue
            if any(True for _ in child.parameters()):
                units.append(full)
    return units


def _as_decision(name: str, value: Any) -> Decision:
    try:
        if isinstance(value, Decision):
            return value
        if isinstance(value, str):
            return Decision(value)
        if isinstance(value, Mapping):
            return Decision(value.get("mode", ""), value.get("split", 1), value.get("recompute", "none"))
        if isinstance(value, tuple) and len(value) in (2, 3):
            return Decision(*value)
    except PlanError as err:
        raise PlanError(f"module {name!r}: {err}") from None
    raise PlanError(f"module {name!r}: cannot read a decision from {value!r}")


def unsplittable_reason(name: str, k: int, modules: Mapping[str, nn.Module]) -> str | None:
    """Why module ``name`` cannot take ``split=k`` (the text follows "split=k"), or ``None`` when it can.

    A split replaces the module by ``k`` plain ``nn.Linear`` slices whose outputs are concatenated (see
    :mod:`lightning_osdp.apply.split`): what ``nn.Linear.forward`` computes from the weight and bias, when the module
    is called. Anything else the module does would be lost silently, so only such a module is split.
    """
    target = modules[name]
    if not isinstance(target, nn.Linear):
        return f"needs an nn.Linear, got {type(target).__name__}"
    kind = type(target).__name__
    if type(target).forward is not nn.Linear.forward:
        return (
            f"needs nn.Linear's own forward, and {kind} defines its own, which the slices would not run (only modules "
            "whose forward is nn.Linear.forward are split)"
        )
    parent = modules[name.rpartition(".")[0]]
    if isinstance(parent, nn.MultiheadAttention):
        return (
            f"needs a module that is called: {type(parent).__name__} reads its output projection's weight directly "
            "and never calls its forward"
        )
    if any(sub is not target for _, sub in target.named_modules()):
        return f"needs a Linear without submodules ({kind} has some)"
    extra = sorted(
        {n for n, _ in target.named_parameters()} - {"weight", "bias"} | {n for n, _ in target.named_buffers()}
    )
    if extra:
        return f"needs a Linear with no state besides its weight and bias ({kind} has {', '.join(extra)})"
    hooks = [
        what
        for what, registered in (
            ("forward pre-hooks", target._forward_pre_hooks),
            ("forward hooks", target._forward_hooks),
            ("backward hooks", target._backward_hooks),
            ("backward pre-hooks", target._backward_pre_hooks),
        )
        if registered
    ]
    if hooks:
        return f"needs a module without hooks: it has {' and '.join(hooks)}, which the slices would not run"
    if target.out_features < k:
        return f"exceeds out_features={target.out_features}"
    return None


def _nesting(value: Any) -> int:
    """How many levels of lists and objects ``value`` has (iteratively: the depth may be anything)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _closest(name: str, modules: Mapping[str, nn.Module]) -> str | None:
    import difflib

    matches = difflib.get_close_matches(name, [m for m in modules if m], n=1)
    return matches[0] if matches else None
