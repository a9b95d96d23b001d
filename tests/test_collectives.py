"""The collective cost model: the fit recovers a latency and a bandwidth, and the real benchmark agrees across ranks."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from lightning_osdp.profiling import (
    COLLECTIVE_OPS,
    ModelProfile,
    benchmark_collectives,
    fit_collective,
    fit_latency_throughput,
)

from conftest import torchrun

SIZES = [4096 * 4**k for k in range(7)]


def test_the_fit_recovers_alpha_and_beta_from_exact_samples() -> None:
    alpha, beta = 60e-6, 1.3e9
    fit = fit_collective("all_reduce", 2, [(b, alpha + b / beta) for b in SIZES])
    assert fit.alpha_seconds == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_bytes_per_second == pytest.approx(beta, rel=1e-9)
    assert fit.seconds(2**20) == pytest.approx(alpha + 2**20 / beta, rel=1e-9)
    assert fit.seconds(0) == 0.0
    assert fit.samples == [(b, alpha + b / beta) for b in SIZES]


def test_the_fit_weighs_small_and_large_sizes_alike_under_noise() -> None:
    rng = random.Random(0)
    alpha, beta = 200e-6, 0.16e9
    samples = [(b, (alpha + b / beta) * rng.uniform(0.95, 1.05)) for b in SIZES for _ in range(3)]
    fitted_alpha, fitted_beta = fit_latency_throughput(samples)
    # Relative least squares: the latency of 4 KiB calls is recovered although 16 MiB calls take 500x longer.
    assert fitted_alpha == pytest.approx(alpha, rel=0.15)
    assert fitted_beta == pytest.approx(beta, rel=0.05)


def test_the_latency_is_never_negative_and_a_flat_curve_has_no_bandwidth_term() -> None:
    # Times that grow faster than linearly would fit a negative latency: it is clamped to 0.
    alpha, beta = fit_latency_throughput([(1000, 1e-6), (2000, 3e-6), (4000, 9e-6)])
    assert alpha == 0.0 and 0 < beta < math.inf
    # Times that shrink with size: a constant latency, no size-dependent term.
    alpha, beta = fit_latency_throughput([(1000, 2e-3), (1e6, 1e-3)])
    assert alpha > 0 and math.isinf(beta)
    assert fit_latency_throughput([]) == (0.0, math.inf)


def test_without_a_process_group_collectives_cost_nothing() -> None:
    fits = benchmark_collectives()
    assert set(fits) == set(COLLECTIVE_OPS)
    assert all(f.world_size == 1 and f.seconds(2**30) == 0.0 for f in fits.values())


@pytest.mark.distributed
@pytest.mark.slow
def test_two_gloo_ranks_measure_positive_sane_fits_and_share_rank_zeros_figures(tmp_path: Path) -> None:
    script = Path(__file__).parent / "distributed" / "profile_runner.py"
    torchrun(script, str(tmp_path), nproc=2, timeout=300)
    docs = [json.loads((tmp_path / f"collectives.rank{r}.json").read_text()) for r in range(2)]
    assert docs[0]["fits"] == docs[1]["fits"]  # rank 0's samples, fitted identically everywhere
    for doc in docs:  # on gloo the sharded units reduce with an all-reduce: the same result, bit for bit on 2 ranks
        assert doc["reduce_scatter_max_value"] > 0 and doc["reduce_scatter_max_difference"] == 0.0
    assert docs[0]["seconds"] < 4.0  # a 1.5 s budget, overrun by at most one size's round
    for op in COLLECTIVE_OPS:
        fit = docs[0]["fits"][op]
        assert fit["world_size"] == 2
        assert len(fit["samples"]) >= 2
        assert fit["alpha_seconds"] >= 0
        # Loopback gloo moves between 10 MB/s and 100 GB/s; a 4 KiB call takes between 1 us and 50 ms.
        assert 1e7 < fit["beta_bytes_per_second"] < 1e11, (op, fit)
        small = fit["alpha_seconds"] + 4096 / fit["beta_bytes_per_second"]
        assert 1e-6 < small < 0.05, (op, fit)
    profiles = [ModelProfile.load(tmp_path / f"profile.rank{r}.json") for r in range(2)]
    assert profiles[0] == profiles[1]
    assert profiles[0].world_size == 2
    assert profiles[0].collectives["all_gather"].samples == [tuple(s) for s in docs[0]["fits"]["all_gather"]["samples"]]
    # A batch that fails on rank 1 only fails the profile on both ranks at once, before any collective benchmark.
    errors = [json.loads((tmp_path / f"error.rank{r}.json").read_text()) for r in range(2)]
    assert errors[1]["type"] == "ProfilingError" and "does not run through TinyGPT" in errors[1]["message"]
    assert errors[0]["type"] == "RuntimeError" and errors[0]["message"].startswith("profiling TinyGPT failed on rank 1")
    assert all(e["seconds"] < 60 for e in errors)  # the process group's timeout is minutes: nobody waited for it
