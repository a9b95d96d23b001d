"""One entry point per strategy hook, choosing between sharded directories and full files.

The strategy's checkpoint methods call these and nothing else, so that the strategy stays glue: Lightning's
``lightning_module_state_dict`` -> :func:`model_state`, ``optimizer_state`` -> :func:`optimizer_state`,
``save_checkpoint`` -> :func:`save_checkpoint`, ``load_checkpoint`` -> :func:`load_checkpoint`,
``load_model_state_dict`` -> :func:`load_model_state`, ``load_optimizer_state_dict`` -> :func:`load_optimizer_states`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import torch
from torch import nn

from lightning_osdp.checkpoint import layout
from lightning_osdp.checkpoint.context import CheckpointContext
from lightning_osdp.checkpoint.errors import CheckpointError, CheckpointMismatchError
from lightning_osdp.checkpoint.files import CheckpointReplacedError
from lightning_osdp.checkpoint.full import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    save_full_checkpoint,
)
from lightning_osdp.checkpoint.integrity import verify_records
from lightning_osdp.checkpoint.sharded import (
    ShardedState,
    load_sharded_model_state,
    load_sharded_optimizer_state,
    open_sharded_checkpoint,
    save_sharded_checkpoint,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_osdp.checkpoint.unpickle import load_torch_file, weights_only_refusal

__all__ = [
    "StateDictType",
    "describe_resume",
    "load_checkpoint",
    "load_model_state",
    "load_optimizer_states",
    "model_state",
    "optimizer_state",
    "save_checkpoint",
]

StateDictType = Literal["sharded", "full"]


def model_state(module: nn.Module, state_dict_type: StateDictType) -> dict[str, Any]:
    """What Lightning's checkpoint holds of the model. Sharded: this rank's shards (DTensors; split slices under
    their slice names until saved). Full: the gathered state on rank 0 (a collective)."""
    return sharded_model_state(module) if state_dict_type == "sharded" else full_model_state(module)


def optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict_type: StateDictType
) -> dict[str, Any]:
    """What Lightning's checkpoint holds of one optimizer, sharded or gathered as :func:`model_state`."""
    if state_dict_type == "sharded":
        return sharded_optimizer_state(module, optimizer)
    return full_optimizer_state(module, optimizer)


def save_checkpoint(
    checkpoint: Mapping[str, Any],
    path: str | Path,
    *,
    module: nn.Module,
    context: CheckpointContext,
    state_dict_type: StateDictType = "sharded",
    write_file: Callable[[dict[str, Any], Path], None] | None = None,
    storage_options: Any | None = None,
) -> Path:
    """Save Lightning's checkpoint dict as a sharded directory or a full file (a collective, atomic).

    Raises:
        TypeError: ``storage_options`` for a sharded checkpoint, which torch.distributed.checkpoint writes, not the
            ``CheckpointIO`` plugin that takes them.
    """
    if storage_options is not None and state_dict_type == "sharded":
        raise TypeError(
            "OSDPStrategy(state_dict_type='sharded') writes with torch.distributed.checkpoint, not the "
            "CheckpointIO plugin: `storage_options` is not supported"
        )
    if state_dict_type == "sharded":
        return save_sharded_checkpoint(checkpoint, path, module=module, context=context)
    if state_dict_type == "full":
        return save_full_checkpoint(checkpoint, path, context=context, write=write_file)
    raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}")


def load_checkpoint(
    path: str | Path,
    *,
    read_file: Callable[[Path], dict[str, Any]] | None = None,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Lightning's checkpoint dict of ``path``: a sharded directory (tensors left on disk as
    :class:`~lightning_osdp.checkpoint.ShardedState`) or a full file (read with ``read_file``, ``torch.load`` by
    default). Refuses an incomplete or corrupted checkpoint (every file, or every record of a full file, is checked
    against its checksum first, each rank checking a share: a collective when a process group is initialised), and
    reads no tensor of a directory.

    Args:
        weights_only: create only plain data and tensors from the checkpoint's pickles; ``None`` means ``True``, as
            for ``torch.load``. ``False`` trusts the checkpoint: Lightning's ``Trainer.fit(..., weights_only=...)``
            passes the user's choice here (see ``unpickle``'s [Note: pickles in a checkpoint]). ``read_file`` is
            given the same choice by its caller.

    Raises:
        CheckpointError: the checkpoint cannot be read; its subclasses say why (incomplete, corrupt, or holding
            objects that only a trusted load creates).
    """
    path = Path(path)
    trusted = weights_only is False
    if not path.exists():
        raise layout.missing_checkpoint_error(path)
    if path.is_dir():
        return open_sharded_checkpoint(path, weights_only=not trusted)
    with _open_file(path) as file:
        # The file is checked, and read, through this one open file: a newer save replacing `path` meanwhile (a
        # rename) does not change what it reads.
        verify_records(file, source=path, shared=True)
        if read_file is None:
            return _as_checkpoint(load_torch_file(file, weights_only=not trusted, what="", source=path), path)
        try:
            content = read_file(path)
        except CheckpointError:
            raise
        except Exception as err:
            refusal = weights_only_refusal(err, file, path, "")
            if refusal is not None:
                raise refusal from None
            raise _unreadable(path, err) from err
        # `read_file` (the strategy's CheckpointIO) opens `path` itself: it must have read the file checked above.
        if _identity(os.fstat(file.fileno())) != _identity(_stat(path)):
            raise CheckpointReplacedError(
                f"checkpoint file {str(path)!r} was replaced by a newer save while it was being read (a training "
                "saves it again); nothing of it was used: read it again"
            )
        return _as_checkpoint(content, path)


def _open_file(path: Path) -> IO[bytes]:
    try:
        return open(path, "rb")
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint file {str(path)!r}: {err.strerror or err}") from None


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _identity(info: os.stat_result | None) -> tuple[int, int] | None:
    return (info.st_dev, info.st_ino) if info is not None else None


def _as_checkpoint(content: Any, path: Path) -> dict[str, Any]:
    if not isinstance(content, dict):
        raise CheckpointError(f"checkpoint file {str(path)!r} does not hold a checkpoint dict")
    return content


def _unreadable(path: Path, err: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot read checkpoint file {str(path)!r} ({type(err).__name__}: {err}); if a save was interrupted, its "
        "temporary file is incomplete: load the previous checkpoint"
    )


def load_model_state(module: nn.Module, checkpoint: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load ``checkpoint["state_dict"]`` into the sharded ``module``: in place from the shards for a sharded
    checkpoint, from the full dict otherwise (a full file, or a plain Lightning checkpoint of another strategy)."""
    state = checkpoint.get("state_dict")
    if isinstance(state, ShardedState):
        load_sharded_model_state(module, state, strict=strict)
    elif isinstance(state, Mapping):
        load_full_model_state(module, state, strict=strict, source=_source(checkpoint))
    else:
        raise CheckpointError("the checkpoint has no model state ('state_dict')")


def load_optimizer_states(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], checkpoint: Mapping[str, Any]
) -> None:
    """Load ``checkpoint["optimizer_states"]`` into ``optimizers``, one state per optimizer, in order."""
    states = list(checkpoint.get("optimizer_states", []))
    if len(states) != len(optimizers):
        raise CheckpointMismatchError(
            f"checkpoint {_source(checkpoint)} holds {len(states)} optimizer state(s), the model configures "
            f"{len(optimizers)} optimizer(s)"
        )
    for index, (optimizer, state) in enumerate(zip(optimizers, states, strict=True)):
        if isinstance(state, ShardedState):
            load_sharded_optimizer_state(module, optimizer, state, index=index)
        else:
            load_full_optimizer_state(module, optimizer, state, source=_source(checkpoint))


def _source(checkpoint: Mapping[str, Any]) -> str:
    state = checkpoint.get("state_dict")
    if isinstance(state, ShardedState):
        return repr(str(state.path))
    return "(a full checkpoint file)"


def describe_resume(path: str | Path, checkpoint: Mapping[str, Any], context: CheckpointContext) -> str:
    """One line for the log: what the checkpoint was saved under, and how this run differs."""
    path = Path(path)
    entry = checkpoint.get("osdp")
    if not isinstance(entry, Mapping):
        return f"OSDP: loading {path}, a checkpoint of another strategy (full state, the model's keys)"
    saved_ranks = entry.get("world_size")
    plan = entry.get("plan")
    state = checkpoint.get("state_dict")
    if isinstance(plan, str) and isinstance(state, ShardedState):
        # Through the directory the checkpoint was opened as, and checked against the manifest's checksum.
        directory = state.opened()
        plan = directory.json(plan, size=entry["files"].get(plan), checksum=entry.get("checksums", {}).get(plan))
    same_plan = (
        context.plan is not None
        and isinstance(plan, Mapping)
        and context.plan.to_dict()["decisions"] == plan.get("decisions")
    )
    same = same_plan and saved_ranks == context.world_size
    return (
        f"OSDP: loading {entry.get('state_dict_type', '?')} checkpoint {path} (step {entry.get('global_step')}, "
        f"saved on {saved_ranks} ranks) {'under the same plan' if same_plan else 'under another plan'} on "
        f"{context.world_size} ranks" + ("" if same else ": DCP reshards it, the keys are the model's own")
    )
