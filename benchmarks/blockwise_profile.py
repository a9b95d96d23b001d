"""The blocks profile against the measured one on a model that fits: bytes, and per-block times.

``examples/gpt``'s GPT (width 256, 6 blocks, context 128, batch 8, fp32, AdamW) profiled on this CPU in interleaved
rounds: ``measured`` (a copy of the whole model runs its steps) and ``blocks`` (a fake-tensor trace for the bytes, one
block materialized and timed alone for the times). Per round, each block's own forward + backward seconds (the block
and its submodules) in both; the table gives the ratio blocks / measured by the fastest round and by the median, and
the A/A spread (measured against the measured of the next round). The bytes of every module must be identical.

Run: ``python benchmarks/blockwise_profile.py [--rounds N]``. docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from lightning_osdp import profile  # noqa: E402

from gpt import GPTModule  # noqa: E402

BYTES = ("param_bytes", "grad_bytes", "optim_state_bytes", "activation_bytes", "output_bytes", "input_bytes")


def block_seconds(result: object, block: str) -> float:
    modules = result.modules  # type: ignore[attr-defined]
    return sum(m.fwd_seconds + m.bwd_seconds for n, m in modules.items() if n == block or n.startswith(block + "."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPTModule(vocab_size=512, context_length=128, width=256, depth=6, heads=8, lr_schedule="constant")
    batch = torch.randint(0, 512, (8, 129))
    optimizer = torch.optim.AdamW
    blocks = [f"model.blocks.{i}" for i in range(6)]
    times: dict[str, list[list[float]]] = {"measured": [], "blocks": []}
    profiles = {}
    for _ in range(args.rounds):
        for mode in ("measured", "blocks"):
            result = profile(model, batch, mode=mode, optimizer=optimizer)
            profiles[mode] = result
            times[mode].append([block_seconds(result, b) for b in blocks])
    same = all(
        getattr(profiles["measured"].modules[n], f) == getattr(m, f)
        for n, m in profiles["blocks"].modules.items()
        for f in BYTES
    )
    print(f"bytes of every module identical: {same}; blocks timed: {profiles['blocks'].info['blocks']['timed']}")
    columns = ("measured ms (fastest/median)", "blocks ms (fastest/median)", "ratio fastest", "ratio median", "A/A")
    print(f"{'block':16} {columns[0]:>30} {columns[1]:>28} {columns[2]:>14} {columns[3]:>13} {columns[4]:>6}")
    for i, block in enumerate(blocks):
        m = [r[i] for r in times["measured"]]
        b = [r[i] for r in times["blocks"]]
        aa = max(abs(m[j + 1] / m[j] - 1) for j in range(len(m) - 1)) if len(m) > 1 else 0.0
        fastest, median = min(b) / min(m), statistics.median(b) / statistics.median(m)
        print(
            f"{block:16} {min(m) * 1e3:14.2f} / {statistics.median(m) * 1e3:7.2f}    {min(b) * 1e3:12.2f} / "
            f"{statistics.median(b) * 1e3:7.2f} {fastest:14.3f} {median:13.3f} {aa:6.1%}"
        )


if __name__ == "__main__":
    main()
