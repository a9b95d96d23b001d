"""The batch a plan is sized for is the largest the run meets, not the first (``lightning_osdp/planning.py``
[Note: batches whose shape varies])."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from lightning_osdp.planning import SCANNED_BATCHES, largest_batch

from corpus import RandomTokens, pad_collate


def _loader() -> DataLoader:
    # Each batch is padded to its own longest sequence; one sample in eight is 30 long, the others 7 to 14.
    dataset = RandomTokens(n=64, lengths=(8, 12, 10, 9, 30, 11, 7, 14))
    return DataLoader(dataset, batch_size=2, shuffle=True, collate_fn=pad_collate)


def test_the_largest_of_the_first_batches_is_chosen_and_the_runs_rng_is_untouched() -> None:
    torch.manual_seed(3)
    state = torch.get_rng_state()
    batch, index, seen = largest_batch(_loader())
    assert torch.equal(torch.get_rng_state(), state)  # the run's shuffle and dropout are the ones without profiling
    assert seen == SCANNED_BATCHES == 32 and batch["input_ids"].shape[1] == 30
    torch.manual_seed(3)
    first = next(iter(_loader()))
    assert first["input_ids"].shape[1] < 30 and index > 0  # the first batch would have sized the plan too small


def test_the_choice_is_the_same_on_every_run_of_the_same_loader() -> None:
    torch.manual_seed(5)
    a = largest_batch(_loader(), scanned=8)
    torch.manual_seed(5)
    b = largest_batch(_loader(), scanned=8)
    assert a[1:] == b[1:] and torch.equal(a[0]["input_ids"], b[0]["input_ids"])
    assert a[2] == 8
