"""Stage 1 of the pipeline: measure the model and the process group's collectives.

``profile(module, batch)`` returns a :class:`ModelProfile`: per module its own parameters, gradients, optimizer
state, saved activations, forward/backward time and FLOPs, plus the fitted cost of each collective
(``benchmark_collectives``; on several nodes within a node and across nodes, ``benchmark_levels``).
``print(profile)`` (or :func:`format_profile`) shows it as a table.
"""

from lightning_osdp.profiling.collectives import (
    COLLECTIVE_OPS,
    DEFAULT_SIZES,
    NodeGroups,
    benchmark_collectives,
    benchmark_levels,
    fit_collective,
    zero_cost_collectives,
)
from lightning_osdp.profiling.errors import ProfilingError
from lightning_osdp.profiling.fit import fit_latency_throughput
from lightning_osdp.profiling.mixed_precision import profile_with_policy
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
    "NodeGroups",
    "OptimizerSpec",
    "ProfilingError",
    "benchmark_collectives",
    "benchmark_levels",
    "fit_collective",
    "fit_latency_throughput",
    "format_profile",
    "measure_copy_bandwidth",
    "measure_device_rates",
    "print_profile",
    "profile",
    "profile_with_policy",
    "zero_cost_collectives",
]
