"""The CPU live-storage tracker counts exactly what is allocated, freed and resized while it runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_osdp.memory import LiveStorageTracker

from conftest import ROOT, child_env


def test_counts_allocations_frees_and_peak() -> None:
    tracker = LiveStorageTracker().start()
    a = torch.empty(1000)  # 4,000 bytes
    b = torch.empty(500, dtype=torch.float64)  # 4,000 bytes
    assert tracker.live == 8000
    del a
    assert tracker.live == 4000
    c = b[10:]  # a view: no new storage
    assert tracker.live == 4000
    del b, c
    assert tracker.live == 0
    assert tracker.stop() == 8000


def test_counts_what_roots_hold_at_start() -> None:
    model = nn.Linear(10, 10)  # 440 bytes of parameters
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()  # grads 440 + exp_avg/exp_avg_sq 880 + two 4-byte steps
    tracker = LiveStorageTracker().start(model, opt)
    assert tracker.live == 440 + 440 + 880 + 8
    assert tracker.stop() == tracker.peak


def test_activations_saved_for_backward_live_until_backward() -> None:
    x = torch.randn(64, 100, requires_grad=True)
    tracker = LiveStorageTracker().start(x)
    y = (x * 2).relu()  # (x*2) is freed only if nothing saves it; relu saves its output
    live_after_forward = tracker.live
    loss = y.sum()
    del y
    loss.backward()
    tracker.stop()
    assert live_after_forward >= 25600 + 25600  # x and relu's saved output
    assert tracker.peak >= live_after_forward


def test_storage_resize_is_tracked() -> None:
    original = torch.UntypedStorage.resize_
    tracker = LiveStorageTracker().start()
    t = torch.empty(256)
    t.untyped_storage().resize_(0)  # how FSDP2 frees gathered parameters
    assert tracker.live == 0
    t.untyped_storage().resize_(4096)
    assert tracker.live == 4096
    assert tracker.stop() == 4096
    assert torch.UntypedStorage.resize_ is original  # restored once tracking stops


# A 16 MiB tensor freed raises glibc's default mmap threshold to its size (and its trim threshold to twice that): eight
# 4 MiB tensors then come from the heap, and with the first kept, freeing the others leaves 28 MiB at the heap's top
# below the trim threshold, resident. Printed: the resident bytes the pattern leaves beyond what it started with.
_PATTERN = """
import sys, torch
def resident(): return int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "fit":
    import lightning as L
    from lightning_osdp import OSDPStrategy
    from models import TinyGPT, loaders, quiet_trainer
    quiet_trainer(OSDPStrategy(memory_budget="1GiB"), devices=1, max_steps=1).fit(TinyGPT(), loaders()[0])
if sys.argv[1] == "trainer":
    import lightning as L
    import lightning_osdp
    L.Trainer(strategy="osdp", accelerator="cpu", devices=1, logger=False)
if sys.argv[1] == "fabric":
    import lightning as L
    import lightning_osdp
    L.Fabric(strategy="osdp", accelerator="cpu", devices=1)
big = torch.ones(4 << 20); del big
start = resident()
blocks = [torch.ones(1 << 20) for _ in range(8)]
keep = blocks[0]
del blocks
print(resident() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_on_cpu_the_strategy_gives_freed_blocks_back_to_the_system() -> None:
    def retained(case: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _PATTERN, case], env=child_env(), capture_output=True, text=True, cwd=ROOT
        )
        assert run.returncode == 0, run.stderr[-3000:]
        return int(run.stdout.split()[-1])

    block = 4 << 20
    assert retained("plain") > 4 * block  # glibc's default: the freed blocks stay resident
    assert retained("fit") < 2 * block  # after a CPU run's setup: only the block still alive
    # From the moment the Trainer or Fabric knows its devices, before any setup: what a script allocates while it
    # builds its model and data is not left in glibc's heap.
    assert retained("trainer") < 2 * block
    assert retained("fabric") < 2 * block
