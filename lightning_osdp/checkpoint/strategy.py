"""Lightning's checkpoint protocol for a strategy whose model is sharded by a plan.

:class:`CheckpointingStrategy` is the checkpoint half of :class:`~lightning_osdp.OSDPStrategy`: each of Lightning's
state-dict and checkpoint hooks passes its call on to this package (:mod:`lightning_osdp.checkpoint.dispatch`), with
the facts of the run a save records (:meth:`CheckpointingStrategy._checkpoint_context`, which the strategy gives).
Nothing here depends on how the plan was made, so the strategy's own class keeps to setup and steps.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_osdp.checkpoint.context import CheckpointContext
from lightning_osdp.checkpoint.dispatch import (
    StateDictType,
    describe_resume,
    load_checkpoint,
    load_model_state,
    load_optimizer_states,
    model_state,
    optimizer_state,
    save_checkpoint,
)
from lightning_osdp.checkpoint.full import full_model_state
from lightning_osdp.checkpoint.layout import remove_checkpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CheckpointingStrategy"]


class CheckpointingStrategy(ParallelStrategy):
    """A :class:`ParallelStrategy` whose checkpoints do not depend on its plan: ``"sharded"`` DCP directories that
    every rank writes, or ``"full"`` files from rank 0 (``docs/checkpointing.md``)."""

    _state_dict_type: StateDictType

    @abstractmethod
    def _checkpoint_context(self) -> CheckpointContext:
        """The run's facts a save records (its world, plan, profile and budget)."""

    @property
    def state_dict_type(self) -> StateDictType:
        """``"sharded"`` (a DCP directory, every rank writes its shards) or ``"full"`` (one file from rank 0)."""
        return self._state_dict_type

    def _module(self) -> pl.LightningModule:
        if self.lightning_module is None:
            raise RuntimeError("checkpoints need the LightningModule attached to the strategy")
        return self.lightning_module

    def full_model_state_dict(self) -> dict[str, Any]:
        """The unsharded model state dict (the model's own keys) in CPU memory on rank 0, empty elsewhere.

        A collective."""
        return full_model_state(self._module())

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return model_state(self._module(), self._state_dict_type)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return optimizer_state(self._module(), optimizer, self._state_dict_type)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # Lightning calls `load_optimizer_state_dict` only when fitting and after checking that the checkpoint has
        # optimizer states (a clear error for weights-only checkpoints); sharded states are read there, in place.
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        def write_file(content: dict[str, Any], path: Path) -> None:
            self.checkpoint_io.save_checkpoint(content, path, storage_options=storage_options)

        save_checkpoint(
            checkpoint,
            filepath,
            module=self._module(),
            context=self._checkpoint_context(),
            state_dict_type=self._state_dict_type,
            write_file=write_file,
            storage_options=storage_options,
        )

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        # Rank 0's path for all: every rank must read the same checkpoint.
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = load_checkpoint(
            path,
            read_file=lambda p: self.checkpoint_io.load_checkpoint(p, weights_only=weights_only),
            weights_only=weights_only,
        )
        rank_zero_info(describe_resume(path, checkpoint, self._checkpoint_context()))
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        load_model_state(self._module(), checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        load_optimizer_states(self._module(), optimizers, checkpoint)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            remove_checkpoint(filepath)
