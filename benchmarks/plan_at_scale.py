"""``osdp plan`` at 1,024 GPUs: how long a user waits for a plan of a 70B and a 175B GPT on 128 nodes of 8.

Runs the command as a user would (a fresh process: imports, the model built on the meta device, two profiles on fake
tensors, the solve, the comparison with DDP, ZeRO-2, FSDP and HSDP, the largest-batch search) and reports its wall
time and the stages its closing note names (``profiling``, ``solve``, of which ``CBC``, ``batch search``). The models
are ``examples/gpt``'s GPT: 80 layers of width 8448 (69.0B parameters, ~Llama-2-70B's size) on H100s, and 96 layers
of width 12288 (GPT-3's 175B shape) on H200s, both bf16-true at sequence length 2048 and batch 1 per GPU.

Run: ``python benchmarks/plan_at_scale.py [--no-search]``. docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    "GPT 69B (80 layers)": ({"width": 8448, "depth": 80, "heads": 66}, "h100-sxm"),
    "GPT 175B (96 layers)": ({"width": 12288, "depth": 96, "heads": 96}, "h200-sxm"),
}
_NOTE = re.compile(r"dry run took ([0-9.]+) s \((.*)\)")


def run(name: str, init_args: dict[str, int], hardware: str, *, search: bool) -> dict[str, object]:
    """One ``osdp plan`` on 128 nodes of 8 GPUs; its wall time, stage times and the comparison table."""
    args = {**init_args, "context_length": 2048, "vocab_size": 50304}
    command = [
        sys.executable,
        "-m",
        "lightning_osdp.cli",
        "plan",
        "--model",
        "examples/gpt/gpt.py:GPTModule",
        "--init-args",
        json.dumps(args),
        "--nodes",
        "128",
        "--gpus-per-node",
        "8",
        "--hardware",
        hardware,
        "--precision",
        "bf16-true",
        "--batch-size",
        "1",
        *([] if search else ["--no-search"]),
    ]
    started = time.perf_counter()
    proc = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False
    )
    wall = time.perf_counter() - started
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{name}: osdp plan failed ({proc.returncode}):\n{text[-3000:]}")
    note = _NOTE.search(text)
    stages = dict(re.findall(r"(profiling|solve|batch search|model|CBC) ([0-9.]+) s", note.group(2))) if note else {}
    rows = ("OSDP ", "DDP ", "ZeRO-2", "FSDP", "HSDP")
    table = [line for line in proc.stdout.splitlines() if line.startswith(rows) and "plan:" not in line]
    return {"name": name, "wall": wall, "stages": stages, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    args = parser.parse_args()
    print(f"osdp plan on 128 nodes x 8 GPUs ({os.cpu_count()} CPUs here)")
    for name, (init_args, hardware) in MODELS.items():
        result = run(name, init_args, hardware, search=not args.no_search)
        stages = ", ".join(f"{k} {v} s" for k, v in result["stages"].items())  # type: ignore[union-attr]
        print(f"\n{name} on {hardware}: {result['wall']:.1f} s wall ({stages})")
        for line in result["table"]:  # type: ignore[union-attr]
            print("  " + line)


if __name__ == "__main__":
    main()
