"""``osdp plan`` at scale: how long a user waits for a plan, and how much of it is the largest-batch search.

Runs the command as a user would (a fresh process: imports, the model built on the meta device, two profiles on fake
tensors, the solve, the comparison with DDP, ZeRO-2, FSDP and HSDP, the largest-batch search) and reports its wall
time, its CPU seconds (the process's, HiGHS's threads included) and the stages its closing note names (``model``,
``profiling``, ``solve``, ``batch search``); each round runs it once more with ``--no-search``, and the difference of
the two CPU figures is the search's CPU seconds. The cases:

* ``examples/gpt``'s GPT on 128 nodes of 8 GPUs, bf16-true at sequence length 2048 and batch 1 per GPU: 80 layers of
  width 8448 (69.0B parameters, ~Llama-2-70B's size) on H100s, and 96 layers of width 12288 (GPT-3's 175B shape) on
  H200s;
* ``examples/llama``'s Llama 3 8B on 8 nodes of 8 A100 80GB, bf16-fsdp at sequence length 8192 and batch 1 per GPU
  (torchtitan's published run, ``benchmarks/torchtitan_llama.py``).

Run: ``python benchmarks/plan_at_scale.py [--no-search] [--only NAME] [--rounds N] [--solver-time-limit S]``; rounds
run the cases interleaved and report the fastest and the median. docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "llama"))

from llama import LLAMA3_1_8B  # noqa: E402

_GPT = "examples/gpt/gpt.py:GPTModule"
_GPT_ARGS = {"context_length": 2048, "vocab_size": 50304}
#: name: (model, init args, hardware, nodes, precision)
CASES: dict[str, tuple[str, dict[str, object], str, int, str]] = {
    "GPT 69B (80 layers)": (_GPT, {"width": 8448, "depth": 80, "heads": 66, **_GPT_ARGS}, "h100-sxm", 128, "bf16-true"),
    "GPT 175B (96 layers)": (
        _GPT,
        {"width": 12288, "depth": 96, "heads": 96, **_GPT_ARGS},
        "h200-sxm",
        128,
        "bf16-true",
    ),
    "Llama 3 8B": ("examples/llama/llama.py:LlamaModule", dict(LLAMA3_1_8B), "a100-80g-nvlink", 8, "bf16-fsdp"),
}
_NOTE = re.compile(r"dry run took ([0-9.]+) s \((.*)\)")


def run(name: str, *, search: bool, time_limit: float | None = None) -> dict[str, object]:
    """One ``osdp plan`` of case ``name`` on nodes of 8 GPUs: its wall and CPU seconds, stage times and table."""
    model, init_args, hardware, nodes, precision = CASES[name]
    command = [sys.executable, "-m", "lightning_osdp.cli", "plan", "--model", model, "--init-args"]
    command += [json.dumps(init_args), "--nodes", str(nodes), "--gpus-per-node", "8", "--hardware", hardware]
    command += ["--precision", precision, "--batch-size", "1", *([] if search else ["--no-search"])]
    if time_limit is not None:
        command += ["--solver-time-limit", str(time_limit)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{name}: osdp plan failed ({proc.returncode}):\n{text[-3000:]}")
    note = _NOTE.search(text)
    stages = dict(re.findall(r"(profiling|solve|batch search|model|HiGHS) ([0-9.]+) s", note.group(2))) if note else {}
    rows = ("OSDP ", "DDP ", "ZeRO-2", "FSDP", "HSDP")
    table: list[str] = []  # the comparison, the first block of strategy rows (the parts tables follow)
    for line in proc.stdout.splitlines():
        if line.startswith(rows) and "plan:" not in line:
            table.append(line)
        elif table:
            break
    return {"name": name, "wall": wall, "cpu": cpu, "stages": stages, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-search", action="store_true", help="only the runs without the largest-batch search")
    parser.add_argument("--only", choices=sorted(CASES), action="append", help="run this case only (repeatable)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every case")
    parser.add_argument("--solver-time-limit", type=float, help="osdp plan's safety net (seconds per solver run)")
    args = parser.parse_args()
    names = args.only or list(CASES)
    print(f"osdp plan ({os.cpu_count()} CPUs here, {args.rounds} rounds)")
    results: dict[str, list[dict[str, object]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            result = run(name, search=False, time_limit=args.solver_time_limit)
            if not args.no_search:
                plain = result
                result = run(name, search=True, time_limit=args.solver_time_limit)
                result["search_cpu"] = float(result["cpu"]) - float(plain["cpu"])  # type: ignore[arg-type]
            results[name].append(result)
            stages = ", ".join(f"{k} {v} s" for k, v in result["stages"].items())  # type: ignore[union-attr]
            print(f"{name}: {result['wall']:.1f} s wall, {result['cpu']:.1f} s CPU ({stages})", flush=True)
    for name, runs in results.items():
        print(f"\n{name} ({CASES[name][2]}), fastest / median:", end="")
        for key, label in (("wall", "wall"), ("cpu", "CPU"), ("search_cpu", "the search's CPU")):
            values = [float(r[key]) for r in runs if key in r]  # type: ignore[arg-type]
            if values:
                print(f" {label} {min(values):.1f} / {statistics.median(values):.1f} s;", end="")
        print()
        for line in runs[-1]["table"]:  # type: ignore[union-attr]
            print("  " + line)


if __name__ == "__main__":
    main()
