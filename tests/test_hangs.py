"""A rank that hangs, stops or dies ends the whole run in bounded time, and no process of the run is left behind.

Each test starts a real 2-rank run through Lightning's subprocess launcher (``start_method="popen"``: rank 0 is the
process the test starts, rank 1 its child) with ``tests/distributed/hang_runner.py``, waits a bounded time, and checks
by process id that no process of the run survives (a zombie, dead but not yet reaped, counts as ended). Everything is
killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import ROOT, child_env, free_port

RUNNER = ROOT / "tests" / "distributed" / "hang_runner.py"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
Start = Callable[[str, float], "Run"]


@dataclass
class Run:
    """One run of the hang runner: rank 0's process and the directory its processes write to."""

    rank0: subprocess.Popen[bytes]
    out: Path
    started: float

    def pids(self) -> dict[int, int]:
        """Process id -> rank of every process the run has started so far."""
        return {int(p.name.split(".")[1]): int(p.read_text() or -1) for p in self.out.glob("pid.*")}

    def marked(self, event: str, rank: int) -> bool:
        return (self.out / f"{event}.rank{rank}").exists()

    def output(self) -> str:
        return (self.out / "stderr.txt").read_text(errors="replace")

    def wait_until(self, condition: Callable[[], bool], limit: float) -> bool:
        """Poll ``condition()`` until it holds or ``limit`` seconds have passed since the run started."""
        while not condition():
            if time.monotonic() - self.started > limit:
                return False
            time.sleep(0.1)
        return True


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has ended: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    runs: list[Run] = []

    def start_run(case: str, timeout: float) -> Run:
        out = tmp_path / case
        out.mkdir()
        with open(out / "stdout.txt", "wb") as stdout, open(out / "stderr.txt", "wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(RUNNER), case, str(out), str(timeout)],
                env=child_env(),
                cwd=ROOT,
                stdout=stdout,
                stderr=stderr,
            )
        run = Run(proc, out, time.monotonic())
        runs.append(run)
        return run

    yield start_run
    for run in runs:
        for pid in [run.rank0.pid, *run.pids()]:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        run.rank0.wait()


def assert_no_survivor(run: Run, limit: float) -> None:
    """Every process of ``run`` ends within ``limit`` seconds of its start."""
    ended = run.wait_until(lambda: not any(alive(pid) for pid in [run.rank0.pid, *run.pids()]), limit)
    survivors = {pid: rank for pid, rank in run.pids().items() if alive(pid)}
    assert ended, f"after {limit:g} s these processes of the run still live (pid: rank): {survivors}\n{run.output()}"
    assert len(run.pids()) == 2, run.pids()  # both ranks were started and both are accounted for


@pytest.mark.parametrize("case", ["stop", "sleep"])
@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_that_stops_or_hangs_fails_the_run_at_the_timeout_and_is_not_left_behind(
    start: Start, case: str
) -> None:
    """Rank 1 stops (SIGSTOP) or hangs in user code mid-training: rank 0's next collective times out, rank 0 exits
    with an error, and rank 1 does not outlive it (before: an orphan, stopped or sleeping, for good)."""
    run = start(case, 15)
    assert run.wait_until(lambda: run.rank0.poll() is not None, 120), run.output()
    assert run.marked(case, 1), run.output()  # it hung where meant to, not earlier
    assert run.rank0.returncode == 1
    assert "Timed out waiting 15000ms" in run.output()
    ((pid, _),) = [(pid, rank) for pid, rank in run.pids().items() if rank == 1]
    assert f"lightning_osdp: rank 1 (pid {pid}) still runs and rank 0 failed: killing it" in run.output()
    assert_no_survivor(run, time.monotonic() - run.started + 10)


@pytest.mark.parametrize("case", ["kill0-early", "kill0-rendezvous"])
@pytest.mark.distributed
@pytest.mark.slow
def test_rank_0_killed_before_the_ranks_connect_leaves_no_process(start: Start, case: str) -> None:
    """Rank 0 dies (SIGKILL: no clean-up of its own) before the ranks have connected: right after starting rank 1, or
    while rank 1 waits for it in the rendezvous. Rank 1 ends at once, not at the end of the 120 s timeout."""
    run = start(case, 120)
    assert run.wait_until(lambda: run.rank0.poll() is not None, 100), run.output()
    assert run.rank0.returncode == -signal.SIGKILL
    assert run.marked("killed", 0)
    if case == "kill0-rendezvous":
        assert run.marked("rendezvous", 1)
    died = time.monotonic() - run.started
    assert_no_survivor(run, died + 30)  # well under the timeout: before, rank 1 waited all 120 s in the rendezvous
    assert not run.marked("fitted", 1)
    if case == "kill0-early" and not run.marked("rendezvous", 1):
        assert "rank 0 (pid" in run.output() and "has exited: this rank ends too" in run.output()


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_killed_mid_run_ends_rank_0_with_an_error_that_names_it(start: Start) -> None:
    run = start("kill1", 120)
    assert run.wait_until(lambda: run.rank0.poll() is not None, 100), run.output()
    assert run.marked("kill1", 1)
    assert run.rank0.returncode == 1  # before: SIGKILLed by Lightning's observer
    ((pid, _),) = [(pid, rank) for pid, rank in run.pids().items() if rank == 1]
    # Rank 0 fails in its next collective ("Connection reset by peer"), or its watch sees rank 1 die first.
    assert f"lightning_osdp: rank 1 (pid {pid}) was killed by SIGKILL" in run.output()
    assert_no_survivor(run, time.monotonic() - run.started + 10)


@pytest.mark.distributed
@pytest.mark.slow
def test_rank_0_waits_for_its_ranks_to_finish_the_script(start: Start) -> None:
    """Tying the ranks to rank 0 must not cut them short: rank 1 still works 3 s after ``fit`` when rank 0's script
    ends, and rank 0 waits for it."""
    run = start("linger", 120)
    assert run.wait_until(lambda: run.rank0.poll() is not None, 100), run.output()
    assert run.marked("fitted", 0) and run.marked("lingered", 1), run.output()
    assert_no_survivor(run, time.monotonic() - run.started + 10)


def test_the_launcher_marker_reaches_only_the_ranks_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit in this process (rank 0 of one rank) leaves no marker behind: a torchrun job started from here later must
    not take this process for its launcher (it did, and every rank of it raised)."""
    import lightning as L

    from lightning_osdp import OSDPStrategy, Plan
    from lightning_osdp.watchdog import LAUNCHER_PID_ENV

    from models import TinyGPT, loaders

    for key in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model = TinyGPT()
    trainer = L.Trainer(
        strategy=OSDPStrategy(plan=Plan({"": "full_shard"})),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loaders()[0])
    assert len(model.losses) == 1
    assert LAUNCHER_PID_ENV not in os.environ


def test_the_default_timeout_fails_a_hang_in_minutes_and_outlasts_the_solve() -> None:
    from lightning_osdp import OSDPStrategy
    from lightning_osdp.options import DEFAULT_TIMEOUT, planning_wait

    assert OSDPStrategy().timeout == DEFAULT_TIMEOUT == timedelta(minutes=5)
    # The other ranks wait for rank 0's solve: the default grows with a solver time limit above 40 s.
    assert planning_wait(10.0) == timedelta(seconds=120)
    assert OSDPStrategy(solver_time_limit=120).timeout == timedelta(seconds=780)
    assert OSDPStrategy(timeout=90).timeout == timedelta(seconds=90)  # numbers are seconds


@pytest.mark.distributed
@pytest.mark.slow
def test_the_timeout_reaches_the_process_group(tmp_path: Path) -> None:
    """A one-rank run with the default timeout: its gloo group's timeout is 5 minutes (Lightning's is 30)."""
    script = tmp_path / "one_rank.py"
    script.write_text(
        "import lightning as L, torch, torch.distributed as dist\n"
        "from lightning_osdp import OSDPStrategy, Plan\n"
        "from models import TinyGPT, loaders\n"
        "strategy = OSDPStrategy(plan=Plan({'': 'no_shard'}))\n"
        "trainer = L.Trainer(strategy=strategy, accelerator='cpu', devices=1, max_steps=1, logger=False,\n"
        "                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
        "trainer.fit(TinyGPT(), loaders()[0])\n"
        "print(dist.group.WORLD._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert float(proc.stdout.strip().splitlines()[-1]) == 300.0


def test_the_lightning_internals_the_launcher_builds_on_are_where_it_expects() -> None:
    """``lightning_osdp/watchdog.py`` re-implements ``_SubprocessScriptLauncher.launch`` around these private names:
    if a Lightning release moves one, this fails by name."""
    import inspect

    from lightning.fabric.utilities import distributed
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    assert callable(getattr(_SubprocessScriptLauncher, "_call_children_scripts", None))
    assert callable(getattr(distributed, "_set_num_threads_if_needed", None))
    launch = inspect.getsource(_SubprocessScriptLauncher.launch)
    for step in (
        "validate_settings",
        "_call_children_scripts()",
        "_launch_process_observer",
        "_set_num_threads_if_needed",
    ):
        assert step in launch, step
    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    assert launcher.procs == []  # the list the children are appended to, which the watch reads


# ============================================================================================== preemption
PREEMPTION_TIMEOUT = 120
#: Seconds from the SIGTERM to the last process's end that the tests accept: far above the few seconds a stop takes
#: (they print it), far below the 120 s collective timeout a hang lasts (before: both ranks hung for all of it).
PREEMPTION_BOUND = 60


def preempt(run: Run, ranks: list[int], out: Path) -> float:
    """Wait until every rank trains, send SIGTERM to ``ranks``, and return the seconds until every process ended."""
    assert run.wait_until(lambda: all(run.marked("training", r) for r in (0, 1)), 240), run.output()
    by_rank = {rank: pid for pid, rank in run.pids().items()}
    signalled = time.monotonic()
    for rank in ranks:
        os.kill(by_rank[rank], signal.SIGTERM)
    everyone = list(run.pids())
    ended = run.wait_until(
        lambda: not any(alive(pid) for pid in everyone),
        time.monotonic() - run.started + PREEMPTION_BOUND,
    )
    seconds = time.monotonic() - signalled
    print(f"SIGTERM to rank(s) {ranks}: every process ended {seconds:.1f} s later")
    assert ended, f"still running {PREEMPTION_BOUND} s after the SIGTERM:\n{run.output()[-4000:]}"
    return seconds


def stopped(out: Path, rank: int) -> dict[str, object]:
    return json.loads((out / f"stopped.rank{rank}").read_text())


@pytest.mark.parametrize("signalled", [[1], [0], [0, 1]])
@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_a_rank_stops_every_rank_after_the_same_step(start: Start, signalled: list[int]) -> None:
    """A scheduler's preemption or a user's ``kill``: SIGTERM to one rank (or to all) mid-training. Every rank stops
    after the same optimizer step, a step or two later, and the run ends in seconds (before: 302 s, the whole
    collective timeout, then exit 1, as under Lightning's DDP)."""
    run = start("sigterm", PREEMPTION_TIMEOUT)
    preempt(run, signalled, run.out)
    run.rank0.wait()
    assert run.rank0.returncode == 0, run.output()[-4000:]  # Lightning's SIGTERMException is a SystemExit(None)
    steps = {rank: stopped(run.out, rank)["step"] for rank in (0, 1)}
    assert {stopped(run.out, r)["exception"] for r in (0, 1)} == {"SIGTERMException"}
    assert steps[0] == steps[1], steps
    announced = [line for line in run.output().splitlines() if "received SIGTERM after step" in line]
    agreed = int(announced[0].rsplit("stops after step ", 1)[1].split()[0])
    assert steps[0] == agreed, (steps, announced)
    assert "Timed out" not in run.output()
    assert_no_survivor(run, time.monotonic() - run.started + 10)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_preempted_run_can_save_a_whole_checkpoint_that_resumes(start: Start) -> None:
    """The documented recipe (docs/checkpointing.md, "Preemption"): a callback saves in ``on_exception`` when the
    exception is ``SIGTERMException``. Every rank reaches the collective save after the same step, so the checkpoint
    is complete, of that step, and loads."""
    from lightning_osdp import checkpoint as ckpt

    run = start("sigterm-save", PREEMPTION_TIMEOUT)
    preempt(run, [1], run.out)
    run.rank0.wait()
    assert run.rank0.returncode == 0, run.output()[-4000:]
    step = stopped(run.out, 0)["step"]
    assert stopped(run.out, 1)["step"] == step
    saved = ckpt.load_checkpoint(run.out / "preempted.ckpt")
    assert saved["global_step"] == step and saved["osdp"]["world_size"] == 2
    assert sorted(p.name for p in (run.out / "preempted.ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "osdp.json", "plan.json"
    ]  # fmt: skip
    assert not list(run.out.glob("preempted.ckpt.tmp-*"))


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_a_spawned_rank_stops_every_rank(start: Start) -> None:
    """The same under ``start_method="spawn"`` (the ranks are torch.multiprocessing workers of a main process, which
    before waited for rank 0's results forever): the workers stop after the same step and the main process ends too,
    raising ``SIGTERMException`` (status 0). Lightning runs no ``on_exception`` in spawned workers."""
    run = start("sigterm-spawn", PREEMPTION_TIMEOUT)
    assert run.wait_until(lambda: sum(1 for r in run.pids().values() if r >= 0) == 2, 240), run.output()
    preempt(run, [1], run.out)
    run.rank0.wait()
    assert run.rank0.returncode == 0, run.output()[-4000:]
    last = [int((run.out / f"last.rank{rank}").read_text()) for rank in (0, 1)]
    announced = [line for line in run.output().splitlines() if "received SIGTERM after step" in line]
    assert last[0] == last[1] == int(announced[0].rsplit("stops after step ", 1)[1].split()[0]), (last, announced)
    assert "Timed out" not in run.output()


def test_the_lightning_internals_preemption_builds_on_are_where_it_expects() -> None:
    """``lightning_osdp/preemption.py`` replaces Lightning's SIGTERM notifier on the trainer's signal connector and sets
    its flag (fenced in ``_compat``): if a Lightning release moves them, this fails by name."""
    import inspect

    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    register = inspect.getsource(_SignalConnector.register_signal_handlers)
    assert "self._sigterm_notifier_fn" in register and "self.received_sigterm = False" in register
    import lightning as L

    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer._signal_connector.received_sigterm is False and trainer.received_sigterm is False
    from lightning_osdp._compat import mark_sigterm

    mark_sigterm(trainer)
    assert trainer.received_sigterm is True
    loop = inspect.getsource(type(trainer.fit_loop.epoch_loop).on_advance_end)
    assert "self.trainer.received_sigterm" in loop and "raise SIGTERMException" in loop
