"""CUDA checks (skipped without a GPU; run by scripts/cuda_check.sh on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, torchrun

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_measured_peak_is_the_allocators_peak() -> None:
    """On CUDA the strategy's peak is ``torch.cuda.max_memory_allocated`` over the step, nothing else."""
    import lightning as L

    from lightning_osdp import OSDPStrategy, Plan

    from models import TinyGPT, loaders

    model = TinyGPT(width=48, hidden=192)
    train, _ = loaders()
    strategy = OSDPStrategy(plan=Plan({"": "no_shard", "h.0": "full_shard", "h.1": "shard_grad_op"}))
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False
    )
    trainer.fit(model, train)
    assert strategy.peak_memory_bytes is not None
    assert strategy.peak_memory_bytes <= torch.cuda.max_memory_allocated()
    assert strategy.peak_memory_bytes > sum(p.numel() * 4 * 4 for p in model.parameters()) // 2


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
def test_precisions_on_nccl(precision: str, tmp_path: object) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for a 2-rank nccl run")
    out = str(tmp_path)
    torchrun(
        ROOT / "tests" / "distributed" / "runner.py",
        out,
        f"ddp@{precision}",
        f"mixed@{precision}",
        env={"OSDP_TEST_ACCELERATOR": "cuda"},
    )
    from test_parity import assert_matches

    runs = {
        c: [torch.load(f"{out}/{c}@{precision}.rank{r}.pt", weights_only=False) for r in range(2)]
        for c in ("ddp", "mixed")
    }
    # CUDA kernels are not bitwise deterministic across reduction orders: float tolerance by precision.
    rtol = {"32-true": 1e-5, "bf16-mixed": 1e-2, "bf16-true": 2e-2, "16-mixed": 1e-2}[precision]
    for rank in range(2):
        assert_matches(runs["mixed"][rank], runs["ddp"][rank], rtol)
