"""Memory budgets: bytes or human units, and a clear error for anything else."""

from __future__ import annotations

import pytest
import torch

from lightning_osdp import OSDPStrategy
from lightning_osdp.budget import device_memory_capacity, format_bytes, parse_memory_budget


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1024, 1024),
        ("512MiB", 512 * 2**20),
        ("6GiB", 6 * 2**30),
        ("8GB", 8 * 10**9),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("100kb", 100_000),
        ("2G", 2 * 2**30),
    ],
)
def test_parse(value: int | str, expected: int) -> None:
    assert parse_memory_budget(value) == expected


@pytest.mark.parametrize("value", ["6 gigs", "GiB", "-1GiB", "", 0, -5, True, "1e9"])
def test_unparseable_budgets_are_rejected(value: object) -> None:
    with pytest.raises(ValueError, match="memory budget"):
        parse_memory_budget(value)  # type: ignore[arg-type]


def test_strategy_rejects_a_bad_budget_at_construction() -> None:
    with pytest.raises(ValueError, match="cannot parse memory budget '6 gigs'"):
        OSDPStrategy(memory_budget="6 gigs")


def test_cpu_capacity_is_shared_among_local_processes() -> None:
    one = device_memory_capacity(torch.device("cpu"), 1)
    two = device_memory_capacity(torch.device("cpu"), 2)
    assert one > 0 and abs(two - one // 2) <= one * 0.05  # available RAM moves a little between the two reads


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
