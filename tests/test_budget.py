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
        ("100kB", 100_000),
        ("2PiB", 2 * 2**50),
        # Strings in scientific notation, as YAML and command lines pass numbers: bytes when whole.
        ("4e9", 4 * 10**9),
        ("4E9", 4 * 10**9),
        ("1.5e3 MiB", 1500 * 2**20),
    ],
)
def test_parse(value: int | str, expected: int) -> None:
    assert parse_memory_budget(value) == expected


@pytest.mark.parametrize("value", ["6 gigs", "GiB", "-1GiB", "", 0, -5, True, "4.5e-1"])
def test_unparseable_budgets_are_rejected(value: object) -> None:
    with pytest.raises(ValueError, match="memory budget"):
        parse_memory_budget(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("8g", r"the unit 'g' is ambiguous \(a power of 1000 or of 1024\?\): write 'GB' or 'GiB'"),
        ("2G", r"the unit 'G' is ambiguous"),
        ("8Gb", r"the unit 'Gb' reads as bits \('b'\); for bytes write 'GB' or 'GiB'"),
        ("100kb", r"the unit 'kb' reads as bits"),
        ("6gib", r"reads as bits"),
        ("8KB", r"'KB' is 1000 bytes in SI and 1024 in JEDEC: write 'kB' \(1000\) or 'KiB' \(1024\)"),
        ("8 gb", r"reads as bits"),
        ("6GIB", r"not spelled as accepted: write 'GB' or 'GiB'"),
    ],
)
def test_spellings_that_read_two_ways_are_refused_naming_the_accepted_ones(value: str, hint: str) -> None:
    """One rule (budget.py [Note: how a budget is spelled]): before, "8Gb" read as 8e9 bytes and "8g" as 2^33."""
    with pytest.raises(ValueError, match=hint) as info:
        parse_memory_budget(value)
    assert "KiB, MiB, GiB, TiB, PiB (powers of 1024)" in str(info.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1B", r"memory budget '1B' is 1 B, less than the 4.00 KiB a run accepts: was a unit left out"),
        (1000, r"memory budget 1000 is 1000 B, less than the 4.00 KiB"),
        (1e40, r"memory budget 1e\+40 is 1e\+40 bytes, more than 1.00 EiB, which no device has"),
        ("2000PB", r"memory budget '2000PB' is 2e\+18 bytes, more than 1.00 EiB"),
    ],
)
def test_a_budget_no_run_can_have_is_refused_at_construction(value: object, message: str) -> None:
    """Before: ``memory_budget="1B"`` was accepted and failed after 38 s of profiling ("memory budget must be
    positive, got 0"), and 1e40 bytes was accepted."""
    with pytest.raises(ValueError, match=rf"OSDPStrategy\(memory_budget=...\): {message}"):
        OSDPStrategy(memory_budget=value)  # type: ignore[arg-type]
    assert OSDPStrategy(memory_budget="1MiB").memory_budget == 2**20
    assert OSDPStrategy(memory_budget=2**60).memory_budget == 2**60


def test_a_budget_below_the_sharded_parameters_names_the_smallest_budget_that_trains() -> None:
    """A budget above the 4 KiB floor but below what any plan keeps (the parameters, sharded over every rank) is the
    documented InfeasibleBudgetError at the start of setup, without measuring the model: the floor, and the smallest
    budget that trains, from a profile on fake tensors. Before: the message named the floor alone, and a user looking
    for the smallest budget had to guess again and again; that budget now trains."""
    from lightning_osdp import InfeasibleBudgetError

    from models import TinyGPT, loaders, quiet_trainer

    model = TinyGPT()
    least = sum(p.numel() * p.element_size() for p in model.parameters())
    trainer = quiet_trainer(OSDPStrategy(memory_budget=least // 2, memory_headroom=0.0), devices=1, max_steps=1)
    with pytest.raises(InfeasibleBudgetError, match="cannot hold the model's parameters even sharded") as info:
        trainer.fit(model, loaders()[0])
    minimum = info.value.minimum
    assert minimum > least and format_bytes(least) in str(info.value)
    assert f"the smallest budget any plan meets is {format_bytes(minimum)} ({minimum} bytes)" in str(info.value)
    assert trainer.strategy.profile is None  # nothing was measured

    trainer = quiet_trainer(OSDPStrategy(memory_budget=minimum, memory_headroom=0.0), devices=1, max_steps=1)
    trainer.fit(TinyGPT(), loaders()[0])
    assert trainer.global_step == 1


def test_osdp_plan_memory_follows_the_same_rule(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_osdp.cli import main as osdp

    for value, message in (("1B", "less than the 4.00 KiB"), ("8g", "the unit 'g' is ambiguous")):
        argv = ["plan", "--model", "models.TinyGPT", "--world-size", "2", "--hardware", "a100-80g-nvlink"]
        argv += ["--memory", value]
        assert osdp(argv) == 2
        err = capsys.readouterr().err
        assert f"--memory: {'cannot parse ' if value == '8g' else ''}memory budget {value!r}" in err, err
        assert message in err, err


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
