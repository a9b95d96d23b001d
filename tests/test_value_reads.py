"""A ``training_step`` that reads values profiles in every mode, and profiling leaves no trace in the user's module.

User steps log ``loss.item()``, format a loss, guard on NaN, all-gather for logging, and route with data-dependent
shapes (``nonzero``, boolean masks, ``unique``). On fake tensors each read is answered with a stand-in and each
data-dependent size taken at its upper bound (``lightning_osdp/profiling/values.py``); measured mode runs the real
values. Single process: the distributed path is the user corpus (``tests/test_user_corpus.py``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_osdp import profile


class ValueReadingLM(L.LightningModule):
    """A language model whose step does what tutorials do with values."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2)])
        self.head = nn.Linear(16, 50)
        self.losses: list[float] = []
        self.seen = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.emb(x)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        self.seen += int(targets.numel())
        if loss.isnan() or not torch.isfinite(loss):
            return None
        if float(loss) > 1e6:  # a divergence guard
            return None
        self.print(f"step {batch_idx}: {loss:.3f} {targets[0].tolist()} {loss.detach().numpy()}")
        self.log("loss", loss, sync_dist=True)
        gathered = self.all_gather(loss.detach())
        self.log("mean", float(gathered.mean()))
        # Data-dependent shapes: a masked mean over the frequent tokens, the positions of one token, distinct tokens.
        frequent = tokens < 25
        masked = logits[frequent].logsumexp(-1).mean()
        positions = torch.nonzero(tokens == 3)
        distinct = torch.unique(tokens)
        return loss + 0.0 * masked + 0.0 * positions.float().sum() + 0.0 * distinct.float().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 50, (4, 12), generator=generator), torch.randint(0, 50, (4, 12), generator=generator)


@pytest.mark.parametrize("mode", ["auto", "measured", "estimated", "blocks"])
def test_a_step_that_reads_values_profiles_in_every_mode(mode: str) -> None:
    model = ValueReadingLM()
    result = profile(model, _batch(), mode=mode)
    assert result.mode == ("measured" if mode == "auto" else mode)
    assert sum(m.activation_bytes for m in result.modules.values()) > 0
    if mode in ("estimated", "blocks"):
        reads = result.info["value_reads"]
        # Each line of the step that reads a value is reported (item; isnan/isfinite; float; format, tolist and numpy;
        # the all-gathered mean).
        assert all(site.startswith("<outside the step") or site.rsplit(":", 1)[1].isdigit() for site in reads), reads
        assert sum(1 for site in reads if site.startswith(__file__)) >= 5, reads
        sized = result.info["upper_bound_sizes"]
        assert any("nonzero" in site for site in sized), sized
        assert any("_unique2" in site for site in sized), sized
        assert any("index.Tensor" in site for site in sized), sized


def test_profiling_leaves_no_trace_in_the_users_module(capsys: pytest.CaptureFixture[str]) -> None:
    model = ValueReadingLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    for mode in ("auto", "estimated"):
        profile(model, _batch(), mode=mode)
    assert model.losses == [] and model.seen == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert "step 0" not in capsys.readouterr().out  # the copy's prints are not the run's


def test_a_masked_selection_is_counted_at_its_upper_bound_on_fake_tensors() -> None:
    # Estimated bytes of a data-dependent selection are never below the measured ones: a plan made on them holds.
    class Masked(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 256)

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            hidden = self.proj(batch)
            return hidden[batch[..., 0] > 0].square().sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batch = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    measured = profile(Masked(), batch, mode="measured")
    estimated = profile(Masked(), batch, mode="estimated")
    assert _activations(estimated) >= _activations(measured) > 0


def test_a_value_guard_takes_the_ordinary_branch_on_fake_tensors() -> None:
    # `if loss.isnan(): return None` reads False on fake tensors: the step that trains is the one profiled.
    model = ValueReadingLM()
    result = profile(model, _batch(), mode="estimated")
    assert sum(m.grad_bytes for m in result.modules.values()) > 0


def _activations(result: Any) -> int:
    return sum(m.activation_bytes for m in result.modules.values()) + result.extra_activation_bytes
