"""Every private torch and Lightning API that lightning_osdp depends on, and the torch versions it was validated on.

[Note: one fence around what upstream may move]
A private name (a leading underscore, a ``_module``) can change in any release without notice. Each one we use lives
here, with what it is, why no public API does the job, and the releases its source was read in; the rest of the
package imports it from here. ``tests/test_compat.py`` checks each by name (it exists, with the parameters we pass)
and runs it where that is cheap, so an upgrade that moves one fails there, naming it, instead of in a training run
far from the cause. Besides the names below, OSDP overrides or calls a few private hooks of the classes it extends,
which cannot move here: Lightning's ``Strategy._configure_launcher``, ``Strategy._launcher``,
``Strategy._reset_optimizers_and_schedulers`` and ``_MultiProcessingLauncher._collect_rank_zero_results``,
``_wrapping_function`` and ``_recover_results_in_main_process`` (``processes.py``, ``launcher.py``), torch's
``ShardedGradScaler._unscale_grads_`` (``precision.py``); and it relies on ``Strategy._forward_redirection`` routing
``training_step`` through the FSDP2 root's forward. The tests check those too.

Sources read: torch 2.9.0, 2.10.0, 2.11.0, 2.12.0 and 2.13.0 ("2.9-2.13" below); Lightning 2.6.0 and 2.6.6 ("2.6").
The test suite runs on the versions pinned in ``constraints.txt``.

Importing this module imports neither Lightning nor torch's heavier packages (distributed checkpointing, FSDP, the
symbolic-shape machinery): the profiler imports it, and the planning stages that import the profiler's types must run
without Lightning.
Functions import what they wrap when called; Lightning's classes are resolved on first access (the module's
``__getattr__``, below).
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import torch

# Both modules are imported by `import torch` itself: importing them here costs nothing.
# `TorchDispatchMode` (the base class of an operator-level interceptor) and `_disable_current_modes` (suspend the
# active modes, to run real tensor code inside a fake or tracing mode) have no public home; torch's own tools
# (`FlopCounterMode`, `MemTracker`, `FakeTensorMode`) use them from here. Same names and behaviour in 2.9-2.13.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

# torch's pytree (flatten nested containers of tensors); no public `torch.utils.pytree` module up to 2.13.
from torch.utils._pytree import tree_leaves, tree_map

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment
    from lightning.fabric.strategies import _StrategyRegistry as StrategyRegistry
    from lightning.fabric.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as FabricSubprocessScriptLauncher,
    )
    from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
    from lightning.fabric.utilities.types import ReduceOp
    from lightning.fabric.utilities.types import _Stateful as Stateful
    from lightning.pytorch.strategies.ddp import _DDPForwardRedirection as DDPForwardRedirection
    from lightning.pytorch.strategies.launchers.multiprocessing import (
        _MultiProcessingLauncher as MultiProcessingLauncher,
    )
    from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as SubprocessScriptLauncher,
    )
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

__all__ = [
    "TORCH_VALIDATED",
    "BackwardSyncControl",
    "DDPForwardRedirection",
    "FabricSubprocessScriptLauncher",
    "MultiProcessingLauncher",
    "Stateful",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "TorchDispatchMode",
    "WorkerOutput",
    "dcp_chunk_list",
    "dcp_load_into_empty",
    "dcp_reader_file_system",
    "dcp_writer_file_system",
    "ddp_ignore_parameters",
    "default_store",
    "detach_sharing_version",
    "disable_current_modes",
    "dispatch_has_kernel",
    "fake_tensor_mode",
    "fit_ckpt_path",
    "fit_train_dataloader",
    "init_dist_connection",
    "is_fake",
    "mark_sigterm",
    "module_apply",
    "optimizers_to_device",
    "preserve_version_counter",
    "replace_sigterm_notifier",
    "set_num_threads_if_needed",
    "storage_resize_hook",
    "sync_ddp_if_available",
    "tree_leaves",
    "tree_map",
    "unvalidated_torch",
]

# ------------------------------------------------------------------------------------------------ torch versions
# (lowest supported, first not validated), as (major, minor). The floor is hard: FSDP2's `set_custom_all_gather` and
# `set_custom_reduce_scatter` (comm.py) first exist in torch 2.9.0 (absent from 2.8.0). The ceiling is where
# validation stops: every name the package imports from torch, and each private one with the parameters we pass, was
# found in the 2.9.0, 2.10.0, 2.11.0, 2.12.0 and 2.13.0 sources, and the suite runs on 2.13. pyproject.toml declares
# the floor only: a ceiling there would make pip downgrade torch for users already on a newer release; a newer torch
# gets the warning below instead.
TORCH_VALIDATED = ((2, 9), (2, 14))


def unvalidated_torch(version: str) -> str | None:
    """Why torch ``version`` is outside :data:`TORCH_VALIDATED`, or ``None`` when it is inside."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return f"lightning_osdp cannot read the torch version {version!r}; it was validated on torch 2.9 to 2.13"
    found = (int(match.group(1)), int(match.group(2)))
    (low_major, low_minor), (high_major, high_minor) = TORCH_VALIDATED
    if found < TORCH_VALIDATED[0]:
        return (
            f"lightning_osdp needs torch >= {low_major}.{low_minor} (FSDP2's custom all-gather and reduce-scatter); "
            f"found torch {version}: sharded units will fail. Upgrade torch."
        )
    if found >= TORCH_VALIDATED[1]:
        return (
            f"lightning_osdp was validated on torch {low_major}.{low_minor} to {high_major}.{high_minor - 1}; found "
            f"torch {version}. The private torch APIs it uses are listed in lightning_osdp/_compat.py; "
            "`pytest tests/test_compat.py` checks each of them against this torch."
        )
    return None


def _warn_if_unvalidated_torch() -> None:
    problem = unvalidated_torch(torch.__version__)
    if problem is not None:
        warnings.warn(problem, UserWarning, stacklevel=3)


_warn_if_unvalidated_torch()


# ------------------------------------------------------------------------------------------------ torch
def ddp_ignore_parameters(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Make the ``DistributedDataParallel`` built next around ``module`` leave the parameters ``names`` alone.

    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (a static method; 2.9-2.13): the replicated
    part of a mixed plan runs on DDP, whose constructor takes no ignore list, and the sharded (DTensor) parameters
    must not be bucketed and all-reduced a second time. It is how torch's own composable APIs and FSDP1 exclude
    parameters from DDP.
    """
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))


def preserve_version_counter(tensors: tuple[torch.Tensor, ...]) -> Any:
    """A context in which in-place writes to ``tensors`` leave their autograd version counters as they were.

    ``torch.autograd._unsafe_preserve_version_counter`` (2.9-2.13): DDP's own buffer broadcast runs under it, so that
    a buffer autograd saved is not reported as modified. OSDP writes buffers back the same way: after broadcasting
    them from rank 0 (``apply/buffers.py``) and around a recomputation (``apply/recompute.py``), where the values
    written are the ones autograd saw.
    """
    return torch.autograd._unsafe_preserve_version_counter(tensors)


def detach_sharing_version(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach()`` from inside a ``TorchDispatchMode``, sharing ``tensor``'s version counter.

    ``torch._C._SetExcludeDispatchKeyGuard`` on ``DispatchKey.ADInplaceOrView`` (2.9-2.13), as
    ``torch.utils.checkpoint``'s ``_detach_helper`` does: a mode runs with that key excluded, where a plain ``detach``
    gets a version counter of its own, so an in-place change of the original would go unseen.
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


def module_apply(module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """``fn`` applied to every parameter and buffer of ``module``, parameters kept as the same objects.

    ``torch.nn.Module._apply`` (2.9-2.13): what ``to``, ``to_empty`` and ``cuda`` are made of. It is run with
    ``torch.__future__``'s swap of module parameters on conversion, so that every parameter keeps its identity
    (``torch.utils.swap_tensors``): otherwise a meta parameter moved to a device becomes a new ``Parameter`` per
    holding module, which unties tied weights and leaves FSDP2, DDP and optimizers holding the old objects. No public
    method moves only the meta tensors of a module (``to_empty`` would also empty the real buffers OSDP keeps, see
    ``apply/materialize.py``).
    """
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return module._apply(fn)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def fake_tensor_mode() -> FakeTensorMode:
    """A fake-tensor mode for the estimated profile: operators run on metadata only (shapes, dtypes), real tensors
    may enter (the model's parameters are copied in), and shapes stay static.

    ``torch._subclasses.fake_tensor.FakeTensorMode`` and ``torch.fx.experimental.symbolic_shapes.ShapeEnv``
    (2.9-2.13): fake tensors have no public home, though ``torch.compile`` and ``torch.export`` are built on them.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=True)


def dispatch_has_kernel(operator: str, key: str) -> bool:
    """Whether the operator named ``operator`` (``"aten::silu_backward"``) has a kernel registered for the dispatch
    key ``key`` (``"CPU"``, ``"CUDA"``, ``"CompositeExplicitAutograd"``...).

    ``torch._C._dispatch_has_kernel_for_dispatch_key`` (2.9-2.13): the dispatcher's registry has no public query;
    ``OpOverload.decompose``, which FlopCounterMode calls, reads it the same way. The tracer asks it which operators
    run as a kernel of their own (``profiling/tracer.py`` [Note: which operators decompose]).
    """
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(operator, key))


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (shapes without memory).

    ``torch._subclasses.fake_tensor.is_fake`` (2.9-2.13): the live-storage tracker of a strategy's setup must not count
    the fake tensors the estimated profile makes.
    """
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return bool(_is_fake(tensor))


@contextmanager
def storage_resize_hook(on_resize: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """Call ``on_resize(storage)`` after every ``torch.UntypedStorage.resize_`` while the context is open.

    FSDP2 frees and re-allocates the storage of gathered parameters with ``UntypedStorage.resize_``
    (``free_storage``/``alloc_storage`` in ``_fsdp_param.py``, 2.9-2.13), a storage method that no
    ``TorchDispatchMode`` sees, so the live-storage tracker patches the method on the class, as
    ``torch.distributed._tools.MemTracker`` does. The patch is process-wide: contexts nest (each restores what it
    found), and threads other than the tracked one are seen too.
    """
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        on_resize(storage)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


def dcp_chunk_list(tensor: torch.Tensor) -> list[ChunkStorageMetadata]:
    """The chunks (offsets and sizes in the global tensor) that this rank holds of ``tensor``: one for a plain tensor,
    the local shards of a DTensor.

    ``torch.distributed.checkpoint.planner_helpers._create_chunk_list`` (2.9-2.13): DCP's default load planner computes
    its reads from it; OSDP's slice planner computes the same reads with the chunks shifted into the unsplit tensor
    (see ``checkpoint/planners.py``), so it must agree with DCP on what a rank holds.
    """
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    chunks: list[ChunkStorageMetadata] = _create_chunk_list(tensor)
    return chunks


def dcp_load_into_empty(state: dict[str, Any], storage_reader: StorageReader, keys: Iterable[str] | None) -> None:
    """Read every tensor of a DCP checkpoint (restricted to the top-level ``keys`` when given) into the empty dict
    ``state``, whole and unsharded, without a process group.

    ``torch.distributed.checkpoint.state_dict_loader._load_state_dict`` with
    ``torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner`` (2.9-2.13): the public ``dcp.load``
    fills only the keys the given state dict already has; this pair is what torch's own
    ``format_utils.dcp_to_torch_save`` uses to read a checkpoint it knows nothing about.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    planner = _EmptyStateDictLoadPlanner(keys=set(keys) if keys is not None else None)
    _load_state_dict(state, storage_reader=storage_reader, planner=planner, no_dist=True)


def dcp_writer_file_system(writer: FileSystemWriter, replace_with: FileSystem | None = None) -> Any:
    """The file system ``writer`` writes every file through (``create_stream``, ``rename``), after replacing it with
    ``replace_with`` when given.

    ``FileSystemWriter.fs`` (2.9-2.13): not underscored, but not a documented extension point either. OSDP puts a
    file system there that checksums each file as DCP writes it (``checkpoint/integrity.py``); if a release stops
    writing through it, nothing is recorded and the save reads the files back to checksum them: slower, as safe.
    """
    if replace_with is not None:
        writer.fs = replace_with
    return writer.fs


def dcp_reader_file_system(reader: FileSystemReader, replace_with: FileSystem | None = None) -> Any:
    """The file system ``reader`` opens every file through (``create_stream``), after replacing it with
    ``replace_with`` when given.

    ``FileSystemReader.fs`` (2.9-2.13), as :func:`dcp_writer_file_system` for the writer. OSDP puts a file system
    there that opens each file relative to the checkpoint directory it holds open, never through a link
    (``checkpoint/files.py``); ``tests/test_checkpoint_hostile.py`` checks that every file DCP reads is opened
    through it.
    """
    if replace_with is not None:
        reader.fs = replace_with
    return reader.fs


# ------------------------------------------------------------------------------------------------ Lightning
# Lightning's classes below are imported when first asked for (`from lightning_osdp._compat import X` asks), so that
# importing this module does not import Lightning. The `TYPE_CHECKING` imports above give type checkers the same names.
_LIGHTNING_CLASSES: dict[str, tuple[str, str]] = {
    # The type of `lightning.pytorch.strategies.StrategyRegistry`, which `Strategy.register_strategies` receives: the
    # hook by which `import lightning_osdp` registers the name "osdp".
    "StrategyRegistry": ("lightning.fabric.strategies", "_StrategyRegistry"),
    # Lightning's default launcher for several processes on a node (`popen`): what its DDP strategy uses; a strategy
    # that is not one of Lightning's own must build it in `_configure_launcher`.
    "SubprocessScriptLauncher": (
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "_SubprocessScriptLauncher",
    ),
    # The spawn/fork launcher and the record its workers send back: OSDP's launcher subclasses it to send the full,
    # unsharded state dict instead of rank 0's DTensor shards (see launcher.py).
    "MultiProcessingLauncher": ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher"),
    "WorkerOutput": ("lightning.pytorch.strategies.launchers.multiprocessing", "_WorkerOutput"),
    # The forward redirection of Lightning's DDP strategy: in manual optimization it turns DDP's gradient sync off
    # for the redirected forward (the backward already ran inside it) and back on after it.
    "DDPForwardRedirection": ("lightning.pytorch.strategies.ddp", "_DDPForwardRedirection"),
    # Fabric's launcher for several processes on a node (its "ddp" uses it), which OSDP's Fabric strategy builds too.
    "FabricSubprocessScriptLauncher": (
        "lightning.fabric.strategies.launchers.subprocess_script",
        "_SubprocessScriptLauncher",
    ),
    # What `fabric.no_backward_sync` asks of a strategy (its `_backward_sync_control`): a context manager per module.
    "BackwardSyncControl": ("lightning.fabric.strategies.strategy", "_BackwardSyncControl"),
    # What `fabric.save` and `fabric.load` treat as a state dict holder (`state_dict`/`load_state_dict`).
    "Stateful": ("lightning.fabric.utilities.types", "_Stateful"),
}


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_CLASSES:
        module, attribute = _LIGHTNING_CLASSES[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def init_dist_connection(
    cluster_environment: ClusterEnvironment,
    backend: str,
    *,
    timeout: Any,
    device_id: torch.device | None,
) -> None:
    """Set ``MASTER_ADDR``/``MASTER_PORT`` from the cluster environment and initialise the default process group
    (no-op when one exists).

    ``lightning.fabric.utilities.distributed._init_dist_connection`` (2.6): every Lightning strategy sets up its group
    with it, and it registers the exit-time destruction of NCCL groups; ``timeout`` and ``device_id`` go to
    ``torch.distributed.init_process_group``. The groups it creates here are destroyed at exit whatever the backend,
    with Lightning's ``_destroy_dist_connection`` (2.6), the handler it registers for NCCL.

    [Note: gloo groups at exit]
    Lightning leaves a gloo group to the interpreter's finalization, where a process can abort after a run that
    succeeded (SIGABRT, "terminate called without an active exception"): two spawned ranks doing async gloo
    collectives and returning aborted in 6 of 30 launches here, and in 0 of 30 with ``destroy_process_group`` at exit,
    which shuts the groups down and joins their threads while the interpreter still runs (torch's own unmerged
    proposal, pytorch/pytorch#179291). It joins them only when nothing else holds the group: a sharded model's
    DTensors keep their device mesh, and with it the group, alive, and then its gloo threads outlive the call
    (measured after a fit; ``tests/clean_exit.py`` found the same in the test scripts, which therefore end with
    ``os._exit``). The handler is registered all the same: it removes the abort wherever the groups are released. A
    ``spawn`` rank of OSDP's launcher, whose model holds its groups, ends without the finalization instead
    (:func:`end_spawned_process`), as forked ranks always do.
    """
    import atexit

    from lightning.fabric.utilities.distributed import _destroy_dist_connection, _init_dist_connection

    created = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    _init_dist_connection(cluster_environment, backend, timeout=timeout, device_id=device_id)
    if created and backend != "nccl":  # Lightning registers it for NCCL
        atexit.unregister(_destroy_dist_connection)  # once, however many groups a process creates in turn
        atexit.register(_destroy_dist_connection)


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's default of ``OMP_NUM_THREADS`` for several processes on a node (one thread per process unless the
    user set it), as its subprocess launcher applies before starting the ranks.

    ``lightning.fabric.utilities.distributed._set_num_threads_if_needed`` (2.6): OSDP's watchdog launcher
    (``watchdog.py``) re-implements ``launch`` around Lightning's and must apply it the same way.
    """
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(num_processes=num_processes)


def sync_ddp_if_available(tensor: torch.Tensor, group: Any | None, reduce_op: ReduceOp | str | None) -> torch.Tensor:
    """All-reduce ``tensor`` with Lightning's semantics of ``reduce_op`` (``"mean"``/``"avg"`` divide the sum by the
    world size; ``"sum"``, ``"max"``... or a ``ReduceOp``), or return it unchanged without a process group.

    ``lightning.fabric.utilities.distributed._sync_ddp_if_available`` (2.6): what Lightning's DDP strategy's
    ``reduce`` calls, so that ``self.log(..., sync_dist=True)`` reduces alike under both strategies.
    """
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    result: torch.Tensor = _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return result


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the optimizers' state tensors to ``device`` (the ``step`` counters stay where they are).

    ``lightning.fabric.utilities.optimizer._optimizers_to_device`` (2.6): what Lightning's strategies call after
    restoring optimizer state, with its exceptions (``step``) kept.
    """
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def fit_train_dataloader(trainer: pl.Trainer) -> Any:
    """The train dataloader of the ``fit`` now running (from ``fit(train_dataloaders=...)``, the datamodule, or the
    LightningModule's ``train_dataloader`` hook), or ``None``.

    ``trainer.fit_loop._data_source.dataloader()`` (2.6): OSDP profiles the first batch in ``strategy.setup``, but
    the public ``trainer.train_dataloader`` is set by the fit loop's ``setup_data``, after ``strategy.setup``.
    """
    return trainer.fit_loop._data_source.dataloader()


def default_store() -> Any:
    """The key-value store of the default process group (the rendezvous ``TCPStore`` every rank is connected to).

    ``torch.distributed.distributed_c10d._get_default_store`` (2.9-2.13): torch has no public accessor; torchelastic
    and torch's own tests use this one. OSDP's ranks agree through it on when to stop after a SIGTERM without a
    collective (``preemption.py``).
    """
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def replace_sigterm_notifier(trainer: pl.Trainer, handler: Callable[[int, Any], None]) -> None:
    """Make ``handler`` the SIGTERM handler Lightning registers for ``trainer``'s next run, in place of its notifier.

    ``trainer._signal_connector._sigterm_notifier_fn`` (2.6): ``_SignalConnector.register_signal_handlers``, which
    ``Trainer._run`` calls after ``strategy.setup``, composes ``self._sigterm_notifier_fn`` with any handler already
    installed, and restores the previous handlers at teardown. Its own notifier broadcasts from the signalled rank
    alone, which hangs every rank (``preemption.py``); an attribute on this trainer's connector takes its place.
    """
    trainer._signal_connector._sigterm_notifier_fn = handler  # type: ignore[method-assign, assignment]


def mark_sigterm(trainer: pl.Trainer) -> None:
    """Mark ``trainer`` as having received SIGTERM, as Lightning's notifier does: its loops then raise
    ``SIGTERMException`` at the end of the current batch.

    ``trainer._signal_connector.received_sigterm`` (2.6): the flag behind the public, read-only
    ``Trainer.received_sigterm``.
    """
    trainer._signal_connector.received_sigterm = True


def fit_ckpt_path(trainer: pl.Trainer) -> str | None:
    """The checkpoint that ``trainer``'s running ``fit``/``validate``/``test``/``predict`` restores, or ``None``.

    [Note: the checkpoint path at strategy setup]
    OSDP chooses its plan in ``strategy.setup``, and a resumed run reuses its checkpoint's plan, so the path is needed
    there. Lightning resolves ``fit(ckpt_path=...)`` (a path, ``"last"``, ``"best"``, ``"hpc"``, or one set with
    ``trainer.ckpt_path = ...``) before ``Trainer._run`` and passes it in as ``_run``'s ``ckpt_path``; ``_run`` stores
    it (the public ``trainer.ckpt_path``) in ``_CheckpointConnector.resume_start``, which it calls after
    ``strategy.setup`` when the strategy's ``restore_checkpoint_after_setup`` is True, as OSDP's must be (a
    checkpoint loads into the sharded model). Until then ``trainer.ckpt_path`` holds the previous call's path, and no
    hook before ``strategy.setup`` receives it (2.6.0-2.6.6). So it is read from the ``_run`` frame of this trainer
    on the call stack. Should a release move it, this returns ``None`` and the run plans afresh (correct, only
    slower); ``tests/test_compat.py`` fails by name then, and also when ``trainer.ckpt_path`` starts holding the path
    at setup, which would be the supported route to switch to. ``OSDPStrategy(plan=...)`` with the plan file saved
    beside the run remains the explicit way to pin a plan.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
            path = frame.f_locals.get("ckpt_path")
            return str(path) if path else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def end_spawned_process() -> NoReturn:
    """End a ``spawn``-started worker whose work is done the way a forked one ends: everything Python's exit does
    except the interpreter's finalization, then ``os._exit(0)``.

    A forked worker (``multiprocessing``'s fork and forkserver start methods) returns from its run into
    ``Process._bootstrap``, which runs ``multiprocessing.util._exit_function`` (finalizers such as a queue's feeder
    thread join; daemonic children ended) and ``threading._shutdown`` (non-daemon threads joined), and then ends with
    ``os._exit``. A spawned one does the same but then calls ``sys.exit``, and the interpreter's exit handlers run
    and then its finalization, where a gloo group whose threads a sharded model keeps alive can abort the process
    ([Note: gloo groups at exit]). Here the three steps run in that order, the exit handlers through
    ``atexit._run_exitfuncs`` (the function the interpreter calls at exit, which runs and clears them in reverse
    order of registration), the streams are flushed, and the process ends with status 0. The three are private
    (CPython 3.10-3.13: ``multiprocessing.util._exit_function``, ``threading._shutdown``, ``atexit._run_exitfuncs``).
    """
    import atexit
    import multiprocessing.util
    import os
    import threading

    multiprocessing.util._exit_function()  # type: ignore[attr-defined]
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
