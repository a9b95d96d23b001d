"""The user corpus under the default strategy: budgets, measured peaks and predicted against measured step times.

Runs ``tests/distributed/corpus_runner.py`` (the same runs ``tests/test_user_corpus.py`` checks for parity) for every
corpus model at its ample budget (a copy of the step is measured) and its tight one (fake tensors, blocks timed one
by one), on 2 CPU ranks, for ``--epochs`` epochs so that enough steps run untracked to be timed
(``lightning_osdp/step_monitor.py`` [Note: timed steps]), and prints one markdown table: the budget, the measured
step and setup peaks (the larger rank's), predicted over measured peak, and the predicted and measured step time
(rank 0's median of its untracked steps after the first) with their ratio, and rank 0's fastest step with the
prediction's ratio to it (two ranks on two cores: another process on the machine stretches some steps, whichever rank
it preempts, and the fastest is the step it left alone); for a run planned on fake tensors, the
same plan predicted from a profile measured on a copy too (what the fake-tensor path costs in accuracy, apart from
how the step's time is modelled). ``--rounds`` repeats the whole launch; the table gives each ratio's median over
rounds and its range, which is the A/A spread of the measurement.

    python benchmarks/user_corpus.py --epochs 6 --rounds 2     # about 10 minutes on 2 quiet cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_user_corpus import MODELS  # noqa: E402

from corpus import CASES  # noqa: E402

MIB = 2**20


def launch(out: Path, models: list[str], epochs: int) -> float:
    """One torchrun launch of every model's ample and tight runs; its wall seconds."""
    # A DDP run first: it starts the process group the budgets are computed on (one of a model built eagerly: a meta
    # one needs the group for its pretrained folder already).
    first = next((m for m in models if not CASES[m].meta), "gpt2")
    runs = [f"{first}:ddp", *(f"{m}:{k}" for m in models for k in ("ample", "tight"))]
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            str(ROOT / "tests/distributed/corpus_runner.py"),
            str(out),
            *runs,
        ],
        check=True,
        cwd=ROOT,
        env={**os.environ, "CORPUS_EPOCHS": str(epochs), "OMP_NUM_THREADS": "1", "CORPUS_COMPARE_PROFILES": "1"},
        capture_output=True,
    )
    return time.perf_counter() - started


def load(out: Path, model: str, kind: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{model}-{kind}.rank{r}.pt", weights_only=False) for r in range(2)]


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--keep", type=Path, help="keep each round's results (profiles, plans, step times) here")
    args = parser.parse_args()
    rounds: list[dict[tuple[str, str], list[dict[str, Any]]]] = []
    cpu0 = os.times()
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) if args.keep is None else args.keep / f"round{r + 1}"
            seconds = launch(out, args.models, args.epochs)
            rounds.append({(m, k): load(out, m, k) for m in args.models for k in ("ample", "tight")})
            print(f"round {r + 1}: {seconds:.0f} s wall", file=sys.stderr)
    cpu1 = os.times()
    cpu = (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system)
    print(f"{args.rounds} round(s), {args.epochs} epochs, {cpu:.0f} s of CPU in the launches\n")
    print(
        "| model | budget | MiB | step peak | setup peak | peak pred/meas | mode | step pred ms | step meas ms "
        "| time pred/meas | fastest step ms | pred/fastest | timed steps | pred from a measured profile ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for kind in ("ample", "tight"):
            runs = [rnd[(model, kind)] for rnd in rounds]
            first = runs[0][0]
            peaks = [max(r["peak"] or 0 for r in ranks) for ranks in runs]
            setup = [max(r["setup_peak"] or 0 for r in ranks) for ranks in runs]
            memory = [ranks[0]["memory_ratio"] for ranks in runs if ranks[0]["memory_ratio"] is not None]
            predicted = [ranks[0]["predicted_step_time"] * 1e3 for ranks in runs if ranks[0]["predicted_step_time"]]
            measured = [ranks[0]["step_time"] * 1e3 for ranks in runs if ranks[0]["step_time"]]
            ratios = [p / m for p, m in zip(predicted, measured, strict=False)]
            # The fastest timed step: what the step takes when no other process holds a core (see the module's doc).
            fastest = [min(ranks[0]["step_seconds"]) * 1e3 for ranks in runs if ranks[0]["step_seconds"]]
            to_fastest = [p / f for p, f in zip(predicted, fastest, strict=False)]
            # The same plan from a profile measured on a copy (fake-tensor runs only; see corpus_runner.py).
            alternative = [r[0]["predicted_from_measured_profile"] for r in runs]
            alternative = [a * 1e3 for a in alternative if a]
            print(
                f"| {model} | {kind} | {first['budget'] / MIB:.3f} | {max(peaks) / MIB:.3f} | {max(setup) / MIB:.3f} "
                f"| {_spread(memory)} | {first['profile_mode']} | {_spread(predicted)} | {_spread(measured)} "
                f"| {_spread(ratios)} | {_spread(fastest)} | {_spread(to_fastest)} | {first['timed_steps']} "
                f"| {_spread(alternative)} |"
            )


if __name__ == "__main__":
    main()
