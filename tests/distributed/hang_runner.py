"""A 2-rank run through Lightning's subprocess launcher in which something goes wrong, for tests/test_hangs.py.

Usage: ``hang_runner.py CASE OUT_DIR TIMEOUT_SECONDS``, started as rank 0 (the launcher starts rank 1 by running this
script again). Each process first writes ``OUT_DIR/pid.<pid>`` (before any heavy import, so that the test knows every
process of the run), then marks what it did as ``OUT_DIR/<event>.rank<R>``. Cases:

* ``stop``: rank 1 stops itself (SIGSTOP) at its third training step;
* ``sleep``: rank 1 hangs in user code at its third training step;
* ``kill1``: rank 1 is killed (SIGKILL) at its third training step;
* ``kill0-early``: rank 0 is killed as soon as it has started rank 1, before rank 1 reaches the launcher;
* ``kill0-rendezvous``: rank 0 is killed once rank 1 waits in ``init_process_group`` for it;
* ``linger``: nothing fails; rank 1 works 3 s after ``fit`` while rank 0 returns at once;
* ``sigterm``, ``sigterm-save``, ``sigterm-spawn``: a long run (each step 20 ms longer) that the test preempts with
  SIGTERM once every rank has marked ``training`` (at its third step); each rank records the step it stopped after
  and what ended it in ``stopped.rank<R>`` (JSON), and after each step the last step it completed in
  ``last.rank<R>``. ``sigterm-save`` saves a checkpoint to ``OUT/preempted.ckpt`` from ``on_exception``, as
  docs/checkpointing.md shows; ``sigterm-spawn`` starts the ranks with ``start_method="spawn"`` (the main process's
  pid file says ``-1``, each rank rewrites its own at ``on_train_start``).
"""

from __future__ import annotations

import os
import sys

CASE, OUT, TIMEOUT = sys.argv[1], sys.argv[2], float(sys.argv[3])
RANK = int(os.environ.get("LOCAL_RANK", "0"))
SPAWN = CASE.endswith("spawn")
with open(os.path.join(OUT, f"pid.{os.getpid()}"), "w") as f:
    f.write("-1" if SPAWN else str(RANK))

import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_osdp import OSDPStrategy, Plan  # noqa: E402

from models import TinyGPT, loaders  # noqa: E402


def mark(event: str, rank: int | None = None) -> None:
    Path(OUT, f"{event}.rank{RANK if rank is None else rank}").write_text(str(os.getpid()))


class Model(TinyGPT):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx == 2 and self.global_rank == 1 and CASE in ("stop", "sleep", "kill1"):
            mark(CASE)
            if CASE == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif CASE == "kill1":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(1)
        if CASE.startswith("sigterm"):
            if self.trainer.global_step == 2:
                mark("training", self.global_rank)
            time.sleep(0.02)
        return super().training_step(batch, batch_idx)


class Strategy(OSDPStrategy):
    def setup_environment(self) -> None:
        if RANK == 0 and CASE.startswith("kill0"):
            if CASE == "kill0-rendezvous":
                deadline = time.monotonic() + 120
                while not Path(OUT, "rendezvous.rank1").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(1.0)  # rank 1 is now inside init_process_group, connecting to rank 0's store
            mark("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        mark("rendezvous")
        super().setup_environment()


class Preempted(Callback):
    """Records where each rank stopped; in ``sigterm-save``, saves a checkpoint when preempted (the documented
    recipe: every rank raises SIGTERMException after the same step, so the collective save is reached by all)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if SPAWN:
            Path(OUT, f"pid.{os.getpid()}").write_text(str(trainer.global_rank))

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        # The last step each rank completed (spawned workers run no `on_exception`).
        Path(OUT, f"last.rank{trainer.global_rank}").write_text(str(trainer.global_step))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if CASE == "sigterm-save" and isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(Path(OUT, "preempted.ckpt"))
        record = {"step": trainer.global_step, "exception": type(exception).__name__, "time": time.time()}
        Path(OUT, f"stopped.rank{trainer.global_rank}").write_text(json.dumps(record))


def main() -> None:
    long_run = CASE.startswith("sigterm")
    strategy = Strategy(
        plan=Plan({"": "no_shard", "h.0": "full_shard"} if long_run else {"": "no_shard"}),
        timeout=timedelta(seconds=TIMEOUT),
        start_method="spawn" if SPAWN else "popen",
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=100_000 if long_run else 5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Preempted()],
    )
    train, _ = loaders()
    trainer.fit(Model(), train)
    mark("fitted")
    if CASE == "linger" and RANK == 1:
        time.sleep(3)
        mark("lingered")


if __name__ == "__main__":
    main()
