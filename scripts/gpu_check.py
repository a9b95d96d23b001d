"""What ``scripts/gpu_check.sh`` needs beside pytest: the versions, one JSON for the figures of several pytest
processes, and the verdict. The checks themselves are the tests in ``tests/gpu/`` (docs/gpu.md).

``python scripts/gpu_check.py versions JSON``
    prints Python, torch, CUDA, cuDNN, NCCL, the devices as torch reports them and the versions of the packages the
    check needs (those of ``scripts/gpu_wheels.txt`` among them), and writes them to JSON's ``env``. Imports torch
    only, so it runs before anything is installed.
``pytest -p gpu_check ...`` (``scripts/`` on ``PYTHONPATH``, ``OSDP_GPU_CHECK_JSON=JSON``)
    this module as a pytest plugin: each test's outcome, seconds, failure or skip message and the figures it gave
    ``record_property`` go to JSON's ``files`` -> test file -> ``tests``, rewritten after every test (a process killed
    at its time limit keeps what it finished), with the session's exit status at its end.
``python scripts/gpu_check.py summary JSON FILE=STATUS:SECONDS ...``
    each file's pytest exit status as the shell saw it (``124``: killed at its time limit; ``skipped``: not started,
    out of time budget), the table of files and failures, and JSON's ``status``. Exit status 0: every file passed; 1:
    some did not (or a file's every test skipped on a CUDA machine); 3: no CUDA device (every file ran and every CUDA
    test skipped: the pipeline works, nothing was checked).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Where the plugin writes; unset, the plugin records nothing.
JSON_VARIABLE = "OSDP_GPU_CHECK_JSON"
#: What the GPU machine's image is expected to hold; scripts/gpu_wheels.txt lists what it lacks.
BASE_PACKAGES = ("torch", "lightning", "torchmetrics", "rich", "PyYAML", "pytest", "setuptools", "lightning-osdp")


def update(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Read the JSON at ``path`` (an empty object when missing), apply ``change``, write it back atomically."""
    data = json.loads(path.read_text()) if path.exists() else {}
    change(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, default=_jsonable))
    partial.replace(path)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # tensor and numpy scalars
        return value.item()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


# ============================================================================================== versions
def wheel_names() -> list[str]:
    """The distributions ``scripts/gpu_wheels.txt`` lists (one ``name==version`` a line, ``#`` comments)."""
    lines = (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    return [line.split("#")[0].split("==")[0].strip() for line in lines if line.split("#")[0].strip()]


def versions() -> dict[str, Any]:
    """Python, torch and its CUDA, cuDNN and NCCL, the devices, the driver and the packages, without importing more
    than torch."""
    import importlib.metadata as md
    import importlib.util
    import platform

    env: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _commit()}
    env.update(python=platform.python_version(), executable=sys.executable)
    env["packages"] = packages = {}
    for name in (*BASE_PACKAGES, *wheel_names()):
        try:
            packages[name] = md.version(name)
        except md.PackageNotFoundError:
            packages[name] = None
    spec = importlib.util.find_spec("lightning_osdp")
    env["lightning_osdp_path"] = str(Path(spec.origin).parent) if spec and spec.origin else None
    env["install"] = os.environ.get("OSDP_GPU_CHECK_INSTALL", "not installed by gpu_check.sh")
    try:
        import torch
    except ImportError as error:
        env["torch"] = f"not importable: {error}"
        env["cuda_available"] = False
        return env
    env.update(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        gloo=torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        nccl=torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        cuda_available=torch.cuda.is_available(),
        device_count=torch.cuda.device_count(),
        cpu_threads=torch.get_num_threads(),
    )
    if env["nccl"] and env["cuda_available"]:
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        env["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    env["devices"] = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        env["devices"].append(
            {
                "name": torch.cuda.get_device_name(i),
                "capability": f"{props.major}.{props.minor}",
                "total_memory_bytes": int(props.total_memory),
                "multiprocessors": props.multi_processor_count,
            }
        )
    env["device_name"] = env["devices"][0]["name"] if env["devices"] else None
    try:
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        env["nvidia_smi"] = f"unavailable: {error}"
    return env


def _commit() -> str | None:
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return git.stdout.strip() or None


def print_versions(env: dict[str, Any]) -> None:
    for key, value in env.items():
        if key == "packages":
            print("  packages: " + ", ".join(f"{n} {v or '(missing)'}" for n, v in value.items()))
        elif key == "devices":
            for i, d in enumerate(value):
                size = d["total_memory_bytes"] / 2**30
                print(
                    f"  cuda:{i}: {d['name']}, capability {d['capability']}, {size:.1f} GiB, {d['multiprocessors']} SMs"
                )
        else:
            print(f"  {key}: {value}")


# ============================================================================================== the plugin
def pytest_configure(config: Any) -> None:
    path = os.environ.get(JSON_VARIABLE)
    if path:
        config.pluginmanager.register(FigureWriter(Path(path)), "gpu_check_figures")


class FigureWriter:
    """Each test's outcome, seconds, message and ``record_property`` figures, by test file, into one JSON."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.monotonic()
        self.files: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        file, _, name = report.nodeid.partition("::")
        tests = self.files.setdefault(file, {"tests": {}})["tests"]
        entry = tests.setdefault(name, {"outcome": None, "seconds": 0.0, "figures": {}})
        entry["seconds"] += report.duration
        entry["figures"].update(dict(report.user_properties))
        if report.when == "call" or not report.passed:
            # A failure outside the call (a fixture's setup or teardown) is an error, as pytest counts it.
            entry["outcome"] = "error" if report.failed and report.when != "call" else report.outcome
        if not report.passed:
            entry["message"] = _message(report)
        if report.when == "teardown":
            self.write()

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        for record in self.files.values():
            record["exit_status"] = int(exitstatus)
            record["seconds"] = time.monotonic() - self.started
        self.write()

    def write(self) -> None:
        update(self.path, lambda data: data.setdefault("files", {}).update(self.files))


def _message(report: Any) -> str:
    """A skip's reason, or a failure's exception line and the end of its traceback."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    text = report.longreprtext
    return (f"{crash.message}\n...\n" if crash is not None else "") + text[-2000:]


# ============================================================================================== the verdict
def file_status(code: str, tests: dict[str, Any]) -> str:
    """A test file's status from its pytest exit status (or ``skipped``) and its tests' outcomes."""
    if code == "skipped":
        return "not run: out of time budget"
    if code in ("124", "137"):
        return "timeout"
    if code == "0":
        return "pass" if any(t["outcome"] == "passed" for t in tests.values()) else "skipped"
    return {"1": "fail", "5": "no tests collected"}.get(code, f"error (pytest exit status {code})")


def summary(path: Path, ran: list[str]) -> int:
    """Record each file's status and the overall one in the JSON at ``path``; print them; the exit status."""
    data = json.loads(path.read_text()) if path.exists() else {}
    files = data.setdefault("files", {})
    print(f"{'file':<36}{'status':<30}{'seconds':>8}  passed failed skipped")
    for item in ran:
        name, _, rest = item.partition("=")
        code, _, seconds = rest.partition(":")
        record = files.setdefault(name, {"tests": {}})
        record["status"] = file_status(code, record["tests"])
        record["wall_seconds"] = float(seconds) if seconds else None
        counts = [sum(t["outcome"] == o for t in record["tests"].values()) for o in ("passed", "failed", "skipped")]
        counts[1] += sum(t["outcome"] == "error" for t in record["tests"].values())
        print(f"{name:<36}{record['status']:<30}{seconds or '-':>8}  {counts[0]:>6} {counts[1]:>6} {counts[2]:>7}")
        for test, result in record["tests"].items():
            if result["outcome"] in ("failed", "error"):
                first = (result.get("message") or "no message").partition("\n")[0]
                print(f"  {result['outcome'].upper()} {test}: {first[:400]}")
    statuses = [files[item.partition("=")[0]]["status"] for item in ran]
    if not statuses or any(s not in ("pass", "skipped") for s in statuses):
        data["status"], code = "fail", 1
    elif not data.get("env", {}).get("cuda_available"):
        data["status"], code = "no CUDA device", 3
        data["message"] = "torch sees no CUDA device: every CUDA test was skipped (the pipeline ran, nothing checked)"
    elif all(s == "pass" for s in statuses):
        data["status"], code = "pass", 0
    else:  # a file whose every test skipped on a GPU machine checked nothing
        data["status"], code = "fail", 1
    path.write_text(json.dumps(data, indent=1, default=_jsonable))
    print(f"gpu_check: {data['status']}; figures in {path}")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("versions", help="print the versions and write them to JSON's env").add_argument("json", type=Path)
    verdict = verbs.add_parser("summary", help="each test file's status and the verdict")
    verdict.add_argument("json", type=Path)
    verdict.add_argument("ran", nargs="*", help="FILE=STATUS:SECONDS, one per test file run (or not run)")
    args = parser.parse_args(argv)
    if args.verb == "versions":
        env = versions()
        print_versions(env)
        update(args.json, lambda data: data.update(env=env))
        return 0
    return summary(args.json, args.ran)


if __name__ == "__main__":
    sys.exit(main())
