"""The GPU check's own machinery, on the CPU: ``scripts/gpu_check.py`` (the versions, the pytest plugin that writes
the figures of several pytest processes into one JSON, the verdict) and ``scripts/gpu_check.sh`` end to end, which
without a GPU runs every step and skips every CUDA test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import HAS_CUDA

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.py"


def plugin_env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT), str(ROOT / "tests")]),
        OSDP_GPU_CHECK_JSON=str(out),
        OMP_NUM_THREADS="1",
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    return env


def pytest_with_plugin(out: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-p", "gpu_check", "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(command, cwd=cwd, env=plugin_env(out), capture_output=True, text=True, timeout=600)


def test_the_plugin_gathers_the_tests_of_several_processes_into_one_json(tmp_path: Path) -> None:
    """Each test's outcome, message and ``record_property`` figures by file; a second pytest adds its file."""
    (tmp_path / "test_one.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture
            def broken():
                raise RuntimeError("no device")

            def test_passes(record_property):
                record_property("rates", {"fp32": 1.5e12})
                record_property("plan", "Plan(3 decisions)")

            def test_fails(record_property):
                record_property("ratio", 1.25)
                assert 1.25 <= 1.1, "predicted 25% over"

            def test_skips():
                pytest.skip("needs a CUDA device")

            def test_errs(broken):
                pass
            """
        )
    )
    (tmp_path / "test_two.py").write_text("def test_passes(record_property):\n    record_property('n', 2)\n")
    out = tmp_path / "out" / "gpu_check.json"
    first = pytest_with_plugin(out, "test_one.py", cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    assert pytest_with_plugin(out, "test_two.py", cwd=tmp_path).returncode == 0
    files = json.loads(out.read_text())["files"]
    assert set(files) == {"test_one.py", "test_two.py"}
    one = files["test_one.py"]
    assert one["exit_status"] == 1 and files["test_two.py"]["exit_status"] == 0
    tests = one["tests"]
    assert {name: t["outcome"] for name, t in tests.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skips": "skipped",
        "test_errs": "error",
    }
    assert tests["test_passes"]["figures"] == {"rates": {"fp32": 1.5e12}, "plan": "Plan(3 decisions)"}
    assert "message" not in tests["test_passes"]
    assert tests["test_fails"]["figures"] == {"ratio": 1.25}  # recorded before the assertion that failed
    assert tests["test_fails"]["message"].startswith("AssertionError: predicted 25% over")
    assert tests["test_skips"]["message"] == "Skipped: needs a CUDA device"
    assert "RuntimeError: no device" in tests["test_errs"]["message"]
    assert files["test_two.py"]["tests"]["test_passes"]["figures"] == {"n": 2}


def run_summary(path: Path, data: dict[str, Any], *ran: str) -> tuple[int, dict[str, Any], str]:
    path.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, str(SCRIPT), "summary", str(path), *ran], capture_output=True, text=True)
    return proc.returncode, json.loads(path.read_text()), proc.stdout


@pytest.mark.parametrize(
    ("cuda", "b", "ran", "code", "statuses"),
    [
        (True, "passed", ["a.py=0:5", "b.py=0:3"], 0, ["pass", "pass"]),
        (True, "skipped", ["a.py=0:5", "b.py=0:3"], 1, ["pass", "skipped"]),
        (True, "failed", ["a.py=1:5", "b.py=124:300"], 1, ["fail", "timeout"]),
        (True, "passed", ["a.py=0:5", "b.py=skipped:0"], 1, ["pass", "not run: out of time budget"]),
        (True, "passed", ["a.py=0:5", "b.py=5:1"], 1, ["pass", "no tests collected"]),
        (False, "skipped", ["a.py=0:5", "b.py=0:3"], 3, ["skipped", "skipped"]),
        (False, "skipped", ["a.py=2:5", "b.py=0:3"], 1, ["error (pytest exit status 2)", "skipped"]),
    ],
)
def test_the_verdict_from_each_files_exit_status(
    cuda: bool, b: str, ran: list[str], code: int, statuses: list[str], tmp_path: Path
) -> None:
    """0 only when every file passed on a CUDA machine (a file whose tests all skipped there checked nothing); 3
    when there is none and every file ran and skipped; 1 otherwise."""
    test = {"outcome": "passed" if cuda else "skipped", "seconds": 1.0, "figures": {}}
    data = {
        "env": {"cuda_available": cuda},
        "files": {"a.py": {"tests": {"test_x": test}}, "b.py": {"tests": {"test_y": {**test, "outcome": b}}}},
    }
    got, report, printed = run_summary(tmp_path / "gpu_check.json", data, *ran)
    assert got == code, printed
    assert [report["files"][name]["status"] for name in ("a.py", "b.py")] == statuses
    assert report["status"] == {0: "pass", 1: "fail", 3: "no CUDA device"}[code]
    assert report["files"]["a.py"]["wall_seconds"] == 5.0


def test_the_versions_name_torch_the_devices_and_every_carried_wheel(tmp_path: Path) -> None:
    import importlib.metadata as md

    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "versions", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    env = json.loads(out.read_text())["env"]
    assert env["torch"] == torch.__version__ and env["cuda_available"] == HAS_CUDA
    assert env["device_count"] == torch.cuda.device_count() == len(env["devices"])
    wheels = [line.split("==") for line in (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines()]
    pinned = {w[0]: w[1] for w in wheels if len(w) == 2 and not w[0].startswith("#")}
    assert pinned, "scripts/gpu_wheels.txt lists no name==version line"

    def installed(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    assert {name: env["packages"][name] for name in pinned} == {name: installed(name) for name in pinned}
    assert f"torch: {torch.__version__}" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="proves the pipeline where there is no GPU")
def test_gpu_check_sh_runs_every_step_without_a_gpu_and_says_so(tmp_path: Path) -> None:
    """``scripts/gpu_check.sh`` with this environment as it is (``GPU_CHECK_INSTALL=0``; docs/gpu.md shows the
    install from wheels into a throwaway environment): versions, the file's pytest, every CUDA test skipped, the
    JSON and the log written, exit status 3."""
    env = {**plugin_env(tmp_path / "unused"), "GPU_CHECK_INSTALL": "0", "GPU_CHECK_ONLY": "hardware"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 3, proc.stdout[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "no CUDA device" and report["env"]["install"] == "skipped (GPU_CHECK_INSTALL=0)"
    assert list(report["files"]) == ["tests/gpu/test_gpu_hardware.py"]
    hardware = report["files"]["tests/gpu/test_gpu_hardware.py"]
    assert hardware["status"] == "skipped" and hardware["exit_status"] == 0
    assert {t["outcome"] for t in hardware["tests"].values()} == {"skipped"} and len(hardware["tests"]) == 2
    assert {t["message"] for t in hardware["tests"].values()} == {"Skipped: needs a CUDA device"}
    assert "--- versions (before installing)" in (tmp_path / "gpu_check.log").read_text()


def test_gpu_check_sh_refuses_an_unknown_check(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_CHECK_ONLY": "parity,gpt2", "PYTHON": sys.executable}
    command = ["bash", "scripts/gpu_check.sh", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown check 'gpt2' in GPU_CHECK_ONLY; known: parity gpt124 hardware checkpoint gloo2" in proc.stdout
