"""Setup memory of a model larger than its budget: built on the meta device against built whole, on 2 CPU ranks.

A GPT (``examples/gpt``: width 768, 6 blocks, vocabulary 8,192, 49M parameters; fp32 parameters, gradients and
AdamW's two moments are 0.79 GiB) under ``OSDPStrategy(memory_budget=0.55 GiB)``, where no replicated plan fits.
Each case is a fresh ``torchrun`` launch of 2 ranks that plans, applies and trains 3 steps; every rank reports:

* the largest live tensor bytes over ``setup`` (the live-storage tracker, started by a callback's ``setup`` hook and
  stopped at ``on_fit_start``: the same measurement on any version of the package) and over the training steps
  (``strategy.peak_memory_bytes``);
* the process's peak resident memory (``VmHWM``) less that of the same script run with a tiny model (imports,
  interpreter, gloo): what the model itself cost the process.

The resident memory is read with glibc's allocator told to return large blocks to the system when they are freed
(``MALLOC_MMAP_THRESHOLD_=131072``): by default it raises its threshold as blocks are freed and keeps later ones in
its heap, so a process's resident memory grows past its live tensors step after step (measured here: 1.46 GiB
resident after 3 steps of 0.54 GiB live); ``--glibc-default`` runs without it.

``--breakdown`` also samples each rank's memory every half millisecond and splits its high-water mark (less the tiny
model's) by where it lives: the large blocks glibc maps for ``malloc`` (tensors of 128 KiB and more, and any native
buffer that size: MKL's pool of matmul buffers), glibc's heap (in use and free), the libraries' code pages, and the
rest (the interpreter's object arenas, thread stacks). ``--mkl-no-pool`` launches with ``MKL_DISABLE_FAST_MM=1``.

Cases: ``meta`` (``trainer.init_module(empty_init=True)``), ``eager`` (the model built whole, as before meta support),
``tiny`` (the baseline). ``--osdp-path DIR`` runs them against another checkout of the package (``git worktree add``
of an older commit): the figures "before". Run: ``python benchmarks/large_model_setup.py [--osdp-path DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
BUDGET = int(0.55 * GIB)
SHAPES = {
    "large": {"vocab_size": 8192, "context_length": 128, "width": 768, "depth": 6, "heads": 12},
    "tiny": {"vocab_size": 256, "context_length": 128, "width": 64, "depth": 1, "heads": 4},
}


_MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class MemorySampler:
    """This process's resident memory sampled in a thread, and at its largest so far, where it lives (Linux, glibc):
    ``malloc``'s mapped blocks, its heap in use and free (``mallinfo2``), file-backed pages (``/proc/self/smaps``)."""

    def __init__(self) -> None:
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in _MALLINFO2]

        self._mallinfo2 = ctypes.CDLL(None).mallinfo2
        self._mallinfo2.restype = MallInfo2
        self.at_peak: dict[str, int] = {"rss": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.0005):
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * page
            if rss <= self.at_peak["rss"] + (1 << 20):
                continue
            m = self._mallinfo2()
            with open("/proc/self/smaps") as f:
                files = sum(self._file_rss(f))
            self.at_peak = {
                "rss": rss,
                "malloc_mapped": m.hblkhd,
                "heap_in_use": m.uordblks,
                "heap_free": m.fordblks,
                "files": files,
            }

    @staticmethod
    def _file_rss(lines: Any) -> Any:
        named = False
        for line in lines:
            first = line.split(maxsplit=6)
            if first[0].endswith(":"):
                if named and first[0] == "Rss:":
                    yield int(first[1]) * 1024
            else:
                named = len(first) > 5 and first[5].startswith("/")


def worker(case: str, out: Path) -> None:
    """One rank of one case (run under torchrun)."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from lightning_osdp import OSDPStrategy
    from lightning_osdp.memory import LiveStorageTracker

    from gpt import GPTModule

    class SetupPeak(Callback):
        def __init__(self) -> None:
            self.tracker: LiveStorageTracker | None = None
            self.peak = 0

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            self.tracker = LiveStorageTracker("cpu", count_fake=False).start(pl_module)

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            assert self.tracker is not None
            self.peak = self.tracker.stop()

    shape = SHAPES["tiny" if case == "tiny" else "large"]
    tokens = torch.randint(
        0, shape["vocab_size"], (64, shape["context_length"] + 1), generator=torch.Generator().manual_seed(0)
    )
    loader = DataLoader(TensorDataset(tokens), batch_size=2, collate_fn=lambda rows: torch.stack([r[0] for r in rows]))
    setup_peak = SetupPeak()
    strategy = OSDPStrategy(memory_budget=BUDGET, solver_time_limit=60)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[setup_peak],
        default_root_dir=str(out),
    )
    if case == "meta":
        with trainer.init_module(empty_init=True):
            model = GPTModule(**shape, lr_schedule="constant")
    else:
        model = GPTModule(**shape, lr_schedule="constant")
    sampler = MemorySampler() if os.environ.get("OSDP_BENCH_BREAKDOWN") else None
    if sampler is not None:
        with sampler:
            trainer.fit(model, loader)
    else:
        trainer.fit(model, loader)
    status = Path("/proc/self/status").read_text()
    hwm = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) * 1024
    result = {
        "setup_peak": setup_peak.peak,
        "step_peak": strategy.peak_memory_bytes,
        "step_time": strategy.step_time,
        "vm_hwm": hwm,
        "plan": strategy.plan.summary() if strategy.plan else None,
        "profile_mode": strategy.profile.mode if strategy.profile else None,
        "at_peak": sampler.at_peak if sampler is not None else None,
        "losses_finite": bool(all(torch.isfinite(torch.tensor(trainer.callback_metrics["train_loss"])).reshape(-1))),
    }
    (out / f"{case}.rank{dist.get_rank()}.json").write_text(json.dumps(result))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    case: str,
    out: Path,
    osdp_path: Path | None,
    glibc_default: bool,
    breakdown: bool = False,
    mkl_no_pool: bool = False,
) -> list[dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if breakdown:
        env["OSDP_BENCH_BREAKDOWN"] = "1"
    if mkl_no_pool:
        env["MKL_DISABLE_FAST_MM"] = "1"
    if not glibc_default:
        env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    paths = [str(osdp_path)] if osdp_path else [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        str(Path(__file__).resolve()),
        "--worker",
        case,
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out)
    if proc.returncode != 0:
        raise SystemExit(f"{case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"{case}.rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--osdp-path", type=Path, default=None, help="the checkout of lightning_osdp to run")
    parser.add_argument("--cases", default="tiny,eager,meta")
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's allocator thresholds as they are")
    parser.add_argument("--breakdown", action="store_true", help="split each rank's high-water mark by where it lives")
    parser.add_argument("--mkl-no-pool", action="store_true", help="launch with MKL_DISABLE_FAST_MM=1")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            results[case] = launch(
                case, Path(tmp), args.osdp_path, args.glibc_default, args.breakdown, args.mkl_no_pool
            )
    base = max(r["vm_hwm"] for r in results["tiny"]) if "tiny" in results else 0
    mib = 1 << 20
    allocator = "glibc default" if args.glibc_default else "MALLOC_MMAP_THRESHOLD_=131072"
    allocator += ", MKL_DISABLE_FAST_MM=1" if args.mkl_no_pool else ""
    print(f"budget {BUDGET / mib:.0f} MiB per rank; checkout {args.osdp_path or ROOT}; {allocator}")
    header = f"{'case':6} {'rank':>4} {'setup peak':>12} {'step peak':>12} {'VmHWM - tiny':>13} {'step s':>7}"
    print(f"{header}  plan / profile")
    for case, ranks in results.items():
        for rank, r in enumerate(ranks):
            step = f"{r['step_peak'] / mib:10.1f}Mi" if r["step_peak"] else f"{'n/a':>12}"
            # A memory-tracked step is not timed: a run whose every step was tracked has no step time (None).
            seconds = f"{r['step_time']:7.2f}" if r["step_time"] is not None else f"{'-':>7}"
            print(
                f"{case:6} {rank:>4} {r['setup_peak'] / mib:10.1f}Mi {step} {(r['vm_hwm'] - base) / mib:11.1f}Mi"
                f" {seconds}"
                f"  {r['plan']} / {r['profile_mode']}{'' if r['losses_finite'] else ' (non-finite loss)'}"
            )
    if args.breakdown and "tiny" in results:
        print(
            "\nat the high-water mark, less the tiny model's (MiB; malloc'd blocks beyond the step's live peak: native"
        )
        print("buffers such as MKL's pool; rest: interpreter arenas, thread stacks)")
        print(
            f"{'case':6} {'rank':>4} {'resident':>9} {'step live':>10} {'malloc blocks':>14} {'beyond live':>12}"
            f" {'heap used':>10} {'heap free':>10} {'code':>6} {'rest':>6}"
        )
        for case, ranks in results.items():
            if case == "tiny":
                continue
            for rank, r in enumerate(ranks):
                p, t = r["at_peak"], results["tiny"][rank]["at_peak"]
                d = {k: (p[k] - t[k]) / mib for k in p}
                rest = d["rss"] - d["malloc_mapped"] - d["heap_in_use"] - d["heap_free"] - d["files"]
                live = r["step_peak"] / mib
                print(
                    f"{case:6} {rank:>4} {d['rss']:9.1f} {live:10.1f} {d['malloc_mapped']:14.1f}"
                    f" {d['malloc_mapped'] - live:12.1f} {d['heap_in_use']:10.1f} {d['heap_free']:10.1f}"
                    f" {d['files']:6.1f} {rest:6.1f}"
                )


if __name__ == "__main__":
    main()
