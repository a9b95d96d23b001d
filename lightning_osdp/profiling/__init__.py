"""Stage 1 of the pipeline: measure the model and the process group's collectives.

``profile(module, batch)`` returns a :class:`ModelProfile`: per module its own parameters, gradients, optimizer
state, saved activations, forward/backward time and FLOPs, plus the fitted cost of each collective
(``benchmark_collectives``). ``print(profile)`` (or :func:`format_profile`) shows it as a table.
"""

from lightning_osdp.profiling.collectives import (
    COLLECTIVE_OPS,
    DEFAULT_SIZES,
    benchmark_collectives,
    fit_collective,
    zero_cost_collectives,
)
from lightning_osdp.profiling.errors import ProfilingError
from lightning_osdp.profiling.fit import fit_latency_throughput
from lightning_osdp.profiling.model_profile import CollectiveFit, LossMemory, ModelProfile, ModuleProfile
from lightning_osdp.profiling.optimizer_state import OptimizerSpec
from lightning_osdp.profiling.profiler import MODES, profile
from lightning_osdp.profiling.rates import DeviceRates, measure_copy_bandwidth, measure_device_rates
from lightning_osdp.profiling.report import format_profile, print_profile

__all__ = [
    "COLLECTIVE_OPS",
    "DEFAULT_SIZES",
    "MODES",
    "CollectiveFit",
    "DeviceRates",
    "LossMemory",
    "ModelProfile",
    "ModuleProfile",
    "OptimizerSpec",
    "ProfilingError",
    "benchmark_collectives",
    "fit_collective",
    "fit_latency_throughput",
    "format_profile",
    "measure_copy_bandwidth",
    "measure_device_rates",
    "print_profile",
    "profile",
    "zero_cost_collectives",
]
