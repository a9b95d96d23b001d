"""The spawn/fork launcher for :class:`~lightning_osdp.OSDPStrategy`.

Lightning's ``_MultiProcessingLauncher`` (private: see ``lightning_osdp._compat``) sends rank 0's
``lightning_module.state_dict()`` back to the main process. Under OSDP that state dict holds DTensors, which fail to
load there ("Callable map_location not supported") and, for sharded units, hold only rank 0's shard. This launcher
gathers the full, unsharded CPU state dict on every rank (a collective) and sends rank 0's copy, so the main process
ends up with the trained weights, as it does with DDP.

A run preempted by SIGTERM (every rank stops after the same step, ``lightning_osdp/preemption.py``) raises
``SIGTERMException`` in each worker before any result is sent, and Lightning's main process would wait for rank 0's
results forever. Rank 0 sends a marker instead, and the main process raises ``SIGTERMException`` too. (Lightning runs
no ``on_exception`` hook in spawned workers, so a checkpoint on preemption needs ``start_method="popen"``.)

A ``spawn`` worker whose run succeeded, its results sent, ends as a forked worker ends: its exit handlers run, the
interpreter's finalization does not (``lightning_osdp._compat.end_spawned_process``): there a gloo group, kept alive
by the sharded model's DTensors, can abort the process after a successful run ([Note: gloo groups at exit]).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_osdp._compat import MultiProcessingLauncher, WorkerOutput, end_spawned_process

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_osdp.strategy import OSDPStrategy

__all__: list[str] = []


class _Preempted:
    """What rank 0 sends the main process when the ranks stopped on SIGTERM: no results."""


class _OSDPMultiProcessingLauncher(MultiProcessingLauncher):
    @override
    def _wrapping_function(
        self,
        process_idx: int,
        trainer: Any,
        function: Any,
        args: Any,
        kwargs: Any,
        return_queue: Any,
        global_states: Any = None,
    ) -> None:
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
        except SIGTERMException:
            if process_idx == 0:
                return_queue.put(_Preempted())
            raise
        if self._start_method == "spawn":
            end_spawned_process()  # results sent: end as a forked worker ends ([Note: gloo groups at exit])

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        if isinstance(worker_output, _Preempted):
            raise SIGTERMException
        super()._recover_results_in_main_process(worker_output, trainer)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> WorkerOutput | None:
        strategy: OSDPStrategy = self._strategy  # type: ignore[assignment]  # this launcher is OSDPStrategy's
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        # Collective: every rank takes part in gathering the shards.
        state_dict = strategy.full_model_state_dict()
        if strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)
