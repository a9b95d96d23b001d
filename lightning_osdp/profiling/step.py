"""One training step of the user's model, as profiling runs it: forward to a scalar loss, nothing else.

A LightningModule runs its own ``training_step(batch, 0)``; the loss is its return value (a tensor, or the
``"loss"`` entry of a dict). The runner keeps that return value until :meth:`StepRunner.release` (the end of the
step), as Lightning's closure keeps it until after the optimizer step: a dict's other tensors (the logits, say) stay
alive through backward, and the profile measures them (see ``loss_region.py``).

A plain ``nn.Module``, or a LightningModule given its ``example_input_array`` (``step="forward"``), runs
``forward`` on the batch, unpacked as Lightning unpacks ``example_input_array`` (a tuple or list positionally, a
dict by keyword, anything else as the one argument), and the loss is ``loss_fn(output, batch)`` when one is given,
else the sum of the output's floating-point tensors.

[Note: manual optimization while profiling]
A LightningModule with ``automatic_optimization = False`` does its own backward and optimizer steps inside
``training_step``, through ``self.optimizers()``, ``self.manual_backward``, ``self.lr_schedulers()``,
``self.toggle_optimizer`` and ``self.clip_gradients``. At setup those reach the Trainer, whose optimizers do not
exist yet (they are built on the sharded parameters, after planning), and a profiled copy must step its own
optimizers anyway. So while the copy is profiled, :meth:`StepRunner.manual_optimization` gives it its own: the
optimizers rebuilt on the copy (stepped by the profiler, which counts their state and time), the schedulers the
model's ``configure_optimizers`` returned with them, ``manual_backward`` run by the profiler (traced like a loss's
backward), and toggling and clipping with Lightning's semantics on those optimizers. The user's ``training_step``
then runs as written, however many forwards, backwards and steps it makes. Such a step is profiled as one forward
and one backward over all of them: every module's activations are summed over its calls, and gradients of every
optimizer are counted as alive together, an upper bound on a step that frees one optimizer's before the next
forward (a GAN's); the loss region is measured around the first backward.

[Note: logging while profiling]
``LightningModule.log`` is replaced by a no-op on the module being profiled: with a trainer attached and no loop
running, Lightning raises ("the loop's result collection is not registered"), and ``sync_dist=True`` would issue a
collective on one rank's schedule. The time a real step spends logging is therefore not in the profile's timings:
the calls are counted instead (``StepRunner.calls``, the profile's ``step_calls``) and the cost model prices them.
For the same reason ``self.all_gather`` gathers locally (this rank's tensors stacked ``world_size`` times: the shape
and bytes of Lightning's result, no collective: the ranks profile on their own schedules, and fake tensors cannot be
sent), and ``self.print`` and the step's own ``print`` calls are silenced: the profiled step runs several times on a
copy, and its output (on fake tensors, the stand-in values of ``values.py``) is not the run's.

[Note: metrics on fake tensors]
In estimated mode the step runs on fake tensors, where code that branches on tensor values cannot run, and
torchmetrics' argument validation does (``MulticlassAccuracy`` checks the number of distinct labels). So
:meth:`StepRunner.quiet_metrics` makes every torchmetrics ``Metric`` in the model return a zero scalar and update
nothing: metrics hold no parameters, gradients or saved activations, and their time is small next to a model
too large to measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from lightning_osdp._compat import tree_leaves, tree_map
from lightning_osdp.profiling.errors import ProfilingError
from lightning_osdp.profiling.model_profile import StepCalls

__all__ = ["ProfiledOptimizer", "StepRunner", "describe_batch", "is_lightning_module"]

LossFn = Callable[[Any, Any], Tensor]


def is_lightning_module_class(cls: type) -> bool:
    """Whether ``cls`` is Lightning's ``LightningModule`` itself (``lightning`` or ``pytorch_lightning``'s)."""
    return cls.__name__ == "LightningModule" and "lightning" in cls.__module__


def is_lightning_module(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule (checked without importing Lightning for plain models)."""
    return any(is_lightning_module_class(cls) for cls in type(module).__mro__)


def describe_batch(batch: Any) -> dict[str, Any]:
    """Shapes, dtypes, devices and total storage bytes of the tensors in ``batch`` (any nesting)."""
    tensors = [t for t in tree_leaves(batch) if isinstance(t, Tensor)]
    storages: dict[int, int] = {}
    for t in tensors:
        try:
            storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            storages[id(t)] = t.numel() * t.element_size()
    return {
        "tensors": [
            {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device)}
            for t in tensors
        ],
        "bytes": sum(storages.values()),
    }


def _shapes(batch: Any) -> str:
    tensors = describe_batch(batch)["tensors"]
    if not tensors:
        return f"a {type(batch).__name__} without tensors"
    return ", ".join(f"{t['dtype']}{t['shape']}" for t in tensors)


class ProfiledOptimizer:
    """What ``self.optimizers()`` returns in a profiled manual ``training_step``: the optimizer rebuilt on the profiled
    copy, whose ``step`` the profiler runs (see [Note: manual optimization while profiling]). Any other attribute is
    the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[[torch.optim.Optimizer, Any], Any]) -> None:
        self.optimizer = optimizer
        self._step = step

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run ``closure`` (as ``LightningOptimizer.step`` does), then the optimizer's step."""
        return self._step(self.optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet (while unpickling)
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def _raw(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, ProfiledOptimizer) else optimizer


def _one_or_list(items: Sequence[Any]) -> Any:
    # Lightning's convention for `optimizers()` and `lr_schedulers()`.
    return items[0] if len(items) == 1 else list(items)


class StepRunner:
    """Runs the forward part of one training step of ``module`` on ``batch`` and returns the scalar loss.

    Args:
        module: the model profiled (a LightningModule or a plain ``nn.Module``).
        batch: the example batch, already on the module's device.
        loss_fn: for a plain module, ``loss_fn(output, batch) -> scalar``; ignored for a LightningModule.
        step_context: a factory of the context the forward runs in (Lightning's precision plugin
            ``forward_context`` under ``bf16-mixed``, say).
        name: the class name used in error messages (the user's class, not a copy's).
        step: ``"training_step"``, ``"forward"``, or ``"auto"`` (``training_step`` for a LightningModule).
    """

    def __init__(
        self,
        module: nn.Module,
        batch: Any,
        *,
        loss_fn: LossFn | None = None,
        step_context: Callable[[], AbstractContextManager[Any]] | None = None,
        name: str | None = None,
        step: str = "auto",
    ) -> None:
        if step not in ("auto", "training_step", "forward"):
            raise ValueError(f"step must be 'auto', 'training_step' or 'forward', not {step!r}")
        self.module = module
        self.batch = batch
        self.loss_fn = loss_fn
        self.step_context = step_context or nullcontext
        self.name = name or type(module).__name__
        self.lightning = is_lightning_module(module)
        if step == "training_step" and not self.lightning:
            raise ProfilingError(f"{self.name} is not a LightningModule: it has no training_step to profile")
        self.training_step = self.lightning and step != "forward"
        #: Whether ``training_step`` optimizes by itself (see [Note: manual optimization while profiling]).
        self.manual = self.training_step and not getattr(module, "automatic_optimization", True)
        #: ``training_step``'s return value, kept until :meth:`release`
        self.output: Any = None
        #: The last step's calls to ``self.log``, ``self.log_dict`` and ``self.all_gather`` (see [Note: logging while
        #: profiling]).
        self.calls = StepCalls()

    @contextmanager
    def quiet_logging(self) -> Iterator[None]:
        """Make ``self.log``/``self.log_dict``/``self.print`` no-ops, ``self.all_gather`` local and ``print`` silent
        while the module is profiled (see [Note: logging while profiling])."""
        if not self.lightning:
            with contextlib.redirect_stdout(io.StringIO()):
                yield
            return
        trainer = vars(self.module).get("_trainer")
        world_size = int(getattr(trainer, "world_size", 1) or 1)

        def all_gather(data: Any, group: Any = None, sync_grads: bool = False) -> Any:
            def gather(value: Any) -> Any:
                if not isinstance(value, Tensor):
                    value = torch.tensor(value)
                return value if world_size == 1 else torch.stack([value] * world_size)

            return tree_map(gather, data)

        def log(name: str, value: Any, *args: Any, sync_dist: bool = False, **kwargs: Any) -> None:
            self._count(logged=1, synced=int(sync_dist))

        def log_dict(dictionary: Mapping[str, Any], *args: Any, sync_dist: bool = False, **kwargs: Any) -> None:
            self._count(logged=len(dictionary), synced=len(dictionary) if sync_dist else 0)

        def gather(data: Any, group: Any = None, sync_grads: bool = False) -> Any:
            self._count(gathered=sum(1 for _ in tree_leaves(data)))
            return all_gather(data, group, sync_grads)

        patches = {"log": log, "log_dict": log_dict, "print": _no_op, "all_gather": gather}
        patched = [attr for attr in patches if attr not in vars(self.module)]
        for attr in patched:
            setattr(self.module, attr, patches[attr])
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                yield
        finally:
            for attr in patched:
                vars(self.module).pop(attr, None)

    @contextmanager
    def quiet_metrics(self) -> Iterator[None]:
        """Make torchmetrics ``Metric`` submodules inert (see [Note: metrics on fake tensors])."""
        patched = [
            mod
            for mod in self.module.modules()
            if any(cls.__name__ == "Metric" and cls.__module__.startswith("torchmetrics") for cls in type(mod).__mro__)
        ]
        for mod in patched:
            for attr in ("forward", "update"):
                setattr(mod, attr, _zero)
        try:
            yield
        finally:
            for mod in patched:
                for attr in ("forward", "update"):
                    vars(mod).pop(attr, None)

    @contextmanager
    def manual_optimization(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        backward: Callable[..., None],
        step: Callable[[torch.optim.Optimizer, Any], Any],
    ) -> Iterator[None]:
        """Give the module its own optimizers, schedulers, ``manual_backward``, toggling and clipping while it is
        profiled (see [Note: manual optimization while profiling]); ``backward(loss, *args, **kwargs)`` and
        ``step(optimizer, closure)`` are the profiler's."""
        module = self.module
        wrapped = [ProfiledOptimizer(o, step) for o in optimizers]
        toggled: dict[Tensor, bool] = {}

        def optimizers_(use_pl_optimizer: bool = True) -> Any:
            return _one_or_list(wrapped if use_pl_optimizer else list(optimizers))

        def lr_schedulers() -> Any:
            return _one_or_list(schedulers) if schedulers else None

        def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
            self.calls = dataclasses.replace(self.calls, backwards=self.calls.backwards + 1)
            backward(loss, *args, **kwargs)

        def toggle_optimizer(optimizer: Any) -> None:
            # LightningModule.toggle_optimizer, over the profiled optimizers.
            toggled.clear()
            for opt in optimizers:
                for group in opt.param_groups:
                    for param in group["params"]:
                        if param not in toggled:
                            toggled[param] = param.requires_grad
                            param.requires_grad = False
            for group in _raw(optimizer).param_groups:
                for param in group["params"]:
                    param.requires_grad = toggled[param]

        def untoggle_optimizer(optimizer: Any) -> None:
            for opt in optimizers:
                if opt is not _raw(optimizer):
                    for group in opt.param_groups:
                        for param in group["params"]:
                            if param in toggled:
                                param.requires_grad = toggled[param]
            toggled.clear()

        def clip_gradients(
            optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
        ) -> None:
            # LightningModule.clip_gradients: the Trainer's settings when none are given.
            trainer = vars(module).get("_trainer")
            value = gradient_clip_val if gradient_clip_val is not None else getattr(trainer, "gradient_clip_val", None)
            algorithm = gradient_clip_algorithm or getattr(trainer, "gradient_clip_algorithm", None) or "norm"
            if not value:
                return
            params = [p for group in _raw(optimizer).param_groups for p in group["params"]]
            if str(getattr(algorithm, "value", algorithm)).lower() == "value":
                torch.nn.utils.clip_grad_value_(params, value)
            else:
                torch.nn.utils.clip_grad_norm_(params, value)

        patches = {
            "optimizers": optimizers_,
            "lr_schedulers": lr_schedulers,
            "manual_backward": manual_backward,
            "toggle_optimizer": toggle_optimizer,
            "untoggle_optimizer": untoggle_optimizer,
            "clip_gradients": clip_gradients,
        }
        patched = [name for name in patches if name not in vars(module)]
        for name in patched:
            setattr(module, name, patches[name])
        try:
            with warnings.catch_warnings():
                # The schedulers belong to optimizers the profile does not step (see the Note).
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
                yield
        finally:
            for name in patched:
                vars(module).pop(name, None)

    def forward_loss(self) -> Tensor | None:
        """The step's loss (``None`` for a manually optimized ``training_step``, which ran its own backward); any
        exception from the user's code becomes a :class:`ProfilingError`."""
        try:
            with self.step_context():
                loss = self._loss()
        except ProfilingError:
            raise
        except Exception as error:
            where = "training_step" if self.training_step else "forward"
            raise ProfilingError(
                f"the example batch does not run through {self.name}.{where}: {type(error).__name__}: {error} "
                f"(batch: {_shapes(self.batch)})"
            ) from error
        return loss

    def release(self) -> None:
        """Drop the step's output (at the end of the step)."""
        self.output = None

    def _count(self, logged: int = 0, synced: int = 0, gathered: int = 0) -> None:
        calls = self.calls
        self.calls = dataclasses.replace(
            calls, logged=calls.logged + logged, synced=calls.synced + synced, gathered=calls.gathered + gathered
        )

    def _loss(self) -> Tensor | None:
        # This step's (the profiler runs the step several times); a manual step counts its own backward passes.
        self.calls = StepCalls(backwards=0 if self.manual else 1)
        if self.training_step:
            output = self.output = self.module.training_step(self.batch, 0)  # type: ignore[operator]
            if self.manual:
                return None
            if isinstance(output, Mapping):
                output = output.get("loss")
            if not isinstance(output, Tensor):
                raise ProfilingError(
                    f"{self.name}.training_step returned {type(output).__name__}, not a loss tensor (or a dict "
                    f"with 'loss'): profiling needs a step that trains (batch: {_shapes(self.batch)})"
                )
            return output if output.ndim == 0 else output.sum()
        batch = self.batch
        if isinstance(batch, Mapping):
            output = self.module(**batch)
        elif isinstance(batch, (tuple, list)):
            output = self.module(*batch)
        else:
            output = self.module(batch)
        if self.loss_fn is not None:
            return self.loss_fn(output, batch)
        floats = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.is_floating_point()]
        if not floats:
            raise ProfilingError(
                f"{self.name}.forward returned no floating-point tensor to derive a loss from; pass loss_fn "
                f"(batch: {_shapes(self.batch)})"
            )
        return torch.stack([t.float().sum() for t in floats]).sum()


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> Tensor:
    return torch.zeros(())
