"""A solve leaves no file and no CBC process behind, however it ends (``lightning_osdp/solver/cbc.py``).

The kill tests start a real Python process that solves a 2,000-unit plan, wait until its CBC subprocess runs, send
a real signal, and look at what is left in the process's temporary directory and in ``/proc``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_osdp.cost_model import predict
from lightning_osdp.plan import Plan
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.solver import PlanningProblem, solve
from lightning_osdp.solver.cbc import PREFIX, _machine, cbc_workspace, sweep_abandoned

from conftest import child_env
from synthetic import gpt_profile

HAS_PROC = os.path.isdir("/proc/self")

CHILD = r"""
import sys
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.solver import solve
solve(ModelProfile.load(sys.argv[1]), int(sys.argv[2]), 2, time_limit=60)
"""


def processes_naming(directory: Path) -> dict[int, list[str]]:
    """Live (not zombie) processes whose command line names a path under ``directory``."""
    prefix = str(directory) + os.sep
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(a.startswith(prefix) for a in argv):
            found[int(entry)] = argv
    return found


def leftovers(directory: Path) -> list[str]:
    """Solve directories and pulp files in ``directory`` (torch may leave caches of its own there)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(PREFIX) or "-pulp." in p.name)


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def half_way_budget(profile: ModelProfile) -> int:
    """Half way between the peaks of the plans that shard every block and none."""
    blocks = [s.entry for s in PlanningProblem(profile, 2).candidates.segments]
    peaks = [predict(profile, Plan({"": m, **dict.fromkeys(blocks, m)})).peak_bytes for m in ("full_shard", "no_shard")]
    return sum(peaks) // 2


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PROC, reason="finds CBC processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_solve_killed_while_cbc_runs_leaves_no_file_and_no_cbc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals
) -> None:
    profile = gpt_profile(depth=499, width=256, tokens=256)  # 2,000 planning units: each CBC run takes a while
    profile_path = tmp_path / "profile.json"
    profile.save(profile_path)
    work = tmp_path / "tmp"
    work.mkdir()
    env = child_env(TMPDIR=str(work))
    cmd = [sys.executable, "-c", CHILD, str(profile_path), str(half_way_budget(profile))]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        running: dict[int, list[str]] = {}

        def cbc_runs() -> bool:
            running.update(processes_naming(work))
            return bool(running) or child.poll() is not None

        assert wait_until(cbc_runs, timeout=180)
        assert running, f"the solve ended before CBC was seen: {child.communicate(timeout=10)}"
        argv = next(iter(running.values()))
        # Every file CBC is given (pulp's model and solution) is in the solve's own directory.
        paths = [a for a in argv if a.startswith(str(work) + os.sep)]
        assert paths and all(Path(a).parent.name.startswith(PREFIX) for a in paths), argv
        child.send_signal(sig)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -sig, child.communicate(timeout=10)
    if sig == signal.SIGKILL:
        # Nothing runs in a process killed so: the next solve sweeps what it left (and stops its CBC).
        monkeypatch.setattr(tempfile, "tempdir", str(work))
        solve(gpt_profile(depth=2, width=32), "64GiB")
    assert wait_until(lambda: not processes_naming(work), timeout=10), processes_naming(work)
    assert leftovers(work) == []


def test_a_finished_solve_leaves_nothing_and_restores_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = signal.getsignal(signal.SIGTERM)
    profile = gpt_profile(depth=4, width=64)
    plan = solve(profile, half_way_budget(profile))
    assert plan.info["predicted_peak_bytes"] <= plan.info["budget_bytes"]
    assert leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_handler_the_application_installed_is_left_alone_during_a_solve(tmp_path: Path) -> None:
    seen: list[object] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with cbc_workspace() as workdir:
            assert signal.getsignal(signal.SIGTERM) is handler
            os.kill(os.getpid(), signal.SIGTERM)  # the application's handler runs; the solve goes on
            assert wait_until(lambda: bool(seen), timeout=5)
            assert os.path.isdir(workdir)
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]
    assert not os.path.exists(workdir)


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_exception_inside_a_solve_removes_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(error), cbc_workspace() as workdir:
        Path(workdir, "model-pulp.mps").write_text("x")
        raise error()
    assert leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_sweep_removes_only_directories_whose_owner_process_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(timeout=60)
    dead, alive = finished.pid, os.getpid()
    here = f"{PREFIX}{_machine()}_"
    other = f"{PREFIX}{'0' * 8 if _machine() != '0' * 8 else '1' * 8}_"
    names = {
        "dead owner": f"{here}{dead}_abc",
        "live owner": f"{here}{alive}_abc",
        "other machine": f"{other}{dead}_abc",
        "not ours": f"osdp_other_{dead}_abc",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "x-pulp.sol").write_text("")
    removed = sweep_abandoned()
    assert removed == [str(tmp_path / names["dead owner"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead owner")
