"""The device's rates beside the ``h200-sxm`` preset: bf16, fp32 and TF32 matmul rates (8192-square operands, CUDA
events) and memory bandwidth (a 2 GiB copy and sum) measured on the device, beside the preset's data-sheet figures,
the rates a dry run on the preset uses, and what ``lightning_osdp.profiling.measure_device_rates`` (the estimated
mode's own benchmark) measures. On the CPU the same measurements at small sizes (fp32 only) are recorded, not
compared.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gpu_helpers import DEVICES, RATE_TOLERANCE

Record = Callable[[str, object], None]


def seconds_per_call(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Mean seconds of ``fn`` over ``repeats`` back-to-back calls: CUDA events around the batch on CUDA (the host
    queues the calls ahead of the device, so launch latency hides behind the kernels, as in a training step),
    ``perf_counter`` on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats


def measure_rates(device: torch.device) -> dict[str, float]:
    """Matmul FLOP/s (fp32 without TF32, and on CUDA bf16 and TF32) on square operands and memory bandwidth (a copy:
    bytes read plus written; a sum: bytes read) on large buffers."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 512
    rates: dict[str, float] = {}
    previous = torch.get_float32_matmul_precision()
    cases = [("fp32_matmul_flops", torch.float32, "highest")]
    if cuda:  # a CPU's bf16 matmul takes seconds and is not what the preset describes
        cases += [("bf16_matmul_flops", torch.bfloat16, "highest"), ("tf32_matmul_flops", torch.float32, "high")]
    try:
        for label, dtype, precision in cases:
            torch.set_float32_matmul_precision(precision)
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            c = torch.empty(n, n, device=device, dtype=dtype)
            repeats = 20 if dtype == torch.bfloat16 else 5
            rates[label] = 2.0 * n**3 / seconds_per_call(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), device, repeats)
            del a, b, c
    finally:
        torch.set_float32_matmul_precision(previous)
    nbytes = (2 << 30) if cuda else (64 << 20)
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty_like(source)
    rates["copy_bytes_per_second"] = 2 * nbytes / seconds_per_call(lambda: target.copy_(source), device, 10)
    rates["read_bytes_per_second"] = nbytes / seconds_per_call(lambda: source.sum(), device, 10)
    return rates


@pytest.fixture(scope="module", params=DEVICES)
def rates(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Measured once per device: this file's rates, ``measure_device_rates``' and the preset's."""
    from lightning_osdp.cli.hardware import MATMUL_EFFICIENCY_FP32, MATMUL_EFFICIENCY_HALF, get_hardware
    from lightning_osdp.profiling import measure_copy_bandwidth, measure_device_rates

    device = torch.device("cuda", 0) if request.param == "cuda" else torch.device("cpu")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32} if device.type == "cuda" else {"fp32": torch.float32}
    hw = get_hardware("h200-sxm")
    half, single = hw.figures(1, "bf16-mixed"), hw.figures(1, "32-true")
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "measured": measure_rates(device),
        "lightning_osdp_measure_device_rates": {
            **{name: measure_device_rates(device, dtype).to_dict() for name, dtype in dtypes.items()},
            "copy_bytes_per_second_64MiB": measure_copy_bandwidth(device, 64 << 20),
        },
        "preset": {
            "name": hw.name,
            "gpu": hw.gpu,
            "source": hw.source,
            "data_sheet": {
                "bf16_matmul_flops": hw.half_flops,
                "fp32_matmul_flops": hw.fp32_flops,
                "memory_bytes_per_second": hw.memory_bytes_per_second,
                "memory_bytes": hw.memory_bytes,
            },
            "dry_run_uses": {
                "bf16_matmul_flops": half.rates.matmul_flops_per_second,
                "fp32_matmul_flops": single.rates.matmul_flops_per_second,
                "memory_bytes_per_second": half.rates.memory_bytes_per_second,
                "copy_bytes_per_second": half.copy_bytes_per_second,
            },
            "efficiencies": {"matmul_half": MATMUL_EFFICIENCY_HALF, "matmul_fp32": MATMUL_EFFICIENCY_FP32},
        },
    }


def test_the_measured_rates_are_the_ones_a_dry_run_on_h200_sxm_uses(
    rates: dict[str, Any], record_property: Record
) -> None:
    """Each measured rate within 25% of the rate a dry run on the preset assumes (on an H200 only)."""
    measured, preset = rates["measured"], rates["preset"]
    for key in ("device_name", "measured", "preset"):
        record_property(key, rates[key])
    assert all(math.isfinite(v) and v > 0 for v in measured.values()), measured
    uses, sheet = preset["dry_run_uses"], preset["data_sheet"]
    memory = sheet["memory_bytes_per_second"], uses["memory_bytes_per_second"]
    rows = [  # (figure, measured, data sheet, what a dry run on the preset uses); the judged ones first
        *(
            (f"{dtype} matmul TFLOP/s", measured[key], sheet[key], uses[key])
            for dtype in ("bf16", "fp32")
            if (key := f"{dtype}_matmul_flops") in measured
        ),
        ("DRAM GB/s (copy r+w)", measured["copy_bytes_per_second"], *memory),
        ("DRAM GB/s (read)", measured["read_bytes_per_second"], *memory),
    ]
    print(f"{'figure':<22}{'measured':>12}{'data sheet':>12}{'dry run':>12}{'meas/dry':>10}")
    for label, value, data_sheet, used in rows:
        unit = 1e12 if "FLOP" in label else 1e9
        print(f"{label:<22}{value / unit:>12.1f}{data_sheet / unit:>12.1f}{used / unit:>12.1f}{value / used:>10.2f}")
    if "tf32_matmul_flops" in measured:
        print(f"tf32 matmul TFLOP/s {measured['tf32_matmul_flops'] / 1e12:>12.1f} (float32_matmul_precision 'high')")
    if "H200" not in rates["device_name"]:
        pytest.skip(f"the device is {rates['device_name']!r}, not an H200: the h200-sxm preset does not describe it")
    for label, value, _, used in rows[:3]:
        assert abs(value / used - 1) <= RATE_TOLERANCE, (
            f"{label}: measured {value:.4g} against the {used:.4g} a dry run on h200-sxm uses (x{value / used:.2f}; "
            f"within {RATE_TOLERANCE:.0%} expected)"
        )


def test_the_estimated_modes_benchmark_reaches_the_large_operand_rate(
    rates: dict[str, Any], record_property: Record
) -> None:
    """``measure_device_rates`` (operands of 32 to 768 square) rates the matmuls at least 75% of the large-operand
    rate: a launch-bound benchmark would make the estimated mode's times too long (on CUDA only: on a shared CPU a
    verdict on rates measured while the test runs is noise)."""
    own, measured = rates["lightning_osdp_measure_device_rates"], rates["measured"]
    record_property("lightning_osdp_measure_device_rates", own)
    ratios = {
        dtype: own[dtype]["matmul_flops_per_second"] / measured[f"{dtype}_matmul_flops"]
        for dtype in ("bf16", "fp32")
        if dtype in own
    }
    record_property("ratios", ratios)
    if rates["device"].type != "cuda":
        pytest.skip("rates of a shared CPU are recorded, not judged")
    for dtype, ratio in ratios.items():
        assert ratio >= 1 - RATE_TOLERANCE, (
            f"measure_device_rates rates the {dtype} matmul at {own[dtype]['matmul_flops_per_second'] / 1e12:.1f} "
            f"TFLOP/s, x{ratio:.2f} of the large-operand rate: its operands are launch-bound on this device"
        )
