"""A 2-rank run through Lightning's subprocess launcher in which something goes wrong, for tests/test_hangs.py.

Usage: ``hang_runner.py CASE OUT_DIR TIMEOUT_SECONDS``, started as rank 0 (the launcher starts rank 1 by running this
script again). Each process first writes ``OUT_DIR/pid.<pid>`` (before any heavy import, so that the test knows every
process of the run), then marks what it did as ``OUT_DIR/<event>.rank<R>``. Cases:

* ``stop``: rank 1 stops itself (SIGSTOP) at its third training step;
* ``sleep``: rank 1 hangs in user code at its third training step;
* ``kill1``: rank 1 is killed (SIGKILL) at its third training step;
* ``kill0-early``: rank 0 is killed as soon as it has started rank 1, before rank 1 reaches the launcher;
* ``kill0-rendezvous``: rank 0 is killed once rank 1 waits in ``init_process_group`` for it;
* ``linger``: nothing fails; rank 1 works 3 s after ``fit`` while rank 0 returns at once.
"""

from __future__ import annotations

import os
import sys

CASE, OUT, TIMEOUT = sys.argv[1], sys.argv[2], float(sys.argv[3])
RANK = int(os.environ.get("LOCAL_RANK", "0"))
with open(os.path.join(OUT, f"pid.{os.getpid()}"), "w") as f:
    f.write(str(RANK))

import signal  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_osdp import OSDPStrategy, Plan  # noqa: E402

from models import TinyGPT, loaders  # noqa: E402


def mark(event: str) -> None:
    Path(OUT, f"{event}.rank{RANK}").write_text(str(os.getpid()))


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


strategy = Strategy(plan=Plan({"": "no_shard"}), timeout=timedelta(seconds=TIMEOUT))
trainer = L.Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=2,
    max_steps=5,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
train, _ = loaders()
trainer.fit(Model(), train)
mark("fitted")
if CASE == "linger" and RANK == 1:
    time.sleep(3)
    mark("lingered")
