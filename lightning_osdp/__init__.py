"""lightning_osdp: Optimal Sharded Data Parallel for PyTorch Lightning.

``import lightning_osdp`` registers the strategy name ``"osdp"`` with Lightning, so that
``Trainer(strategy="osdp")`` works. The pipeline, one stage a subpackage:
profile (measure the model) -> solve (ILP under the memory budget) -> apply (FSDP2 per module) -> checkpoint.

[Note: a lazy package]
Python runs this file for the import of any submodule, so whatever it imports, every user of the package pays
for: ``import lightning_osdp.solver`` (which plans without Lightning) and the ``osdp`` command would import
Lightning, by far the slowest import of all, if this file imported the strategy. So the public names are resolved
on first use (PEP 562's module ``__getattr__``), and the strategy name is registered when Lightning's strategy
registry exists: at once if Lightning is already imported, else right after it is
(:func:`_register_when_lightning_loads`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and documentation tools
    from lightning_osdp.apply import OSDPModule, SplitLinear, apply_plan
    from lightning_osdp.budget import parse_memory_budget
    from lightning_osdp.cost_model import Prediction, predict
    from lightning_osdp.fabric import OSDPFabricStrategy
    from lightning_osdp.plan import MODES, Decision, Plan, PlanError, default_units
    from lightning_osdp.profiling import ModelProfile, benchmark_collectives, profile
    from lightning_osdp.solve_report import PredictionSummary, SolveReport
    from lightning_osdp.solver import InfeasibleBudgetError, format_plan, minimum_budget, solve
    from lightning_osdp.strategy import OSDPStrategy

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "MODES": "lightning_osdp.plan",
    "Decision": "lightning_osdp.plan",
    "InfeasibleBudgetError": "lightning_osdp.solver",
    "ModelProfile": "lightning_osdp.profiling",
    "OSDPFabricStrategy": "lightning_osdp.fabric",
    "OSDPModule": "lightning_osdp.apply",
    "OSDPStrategy": "lightning_osdp.strategy",
    "Plan": "lightning_osdp.plan",
    "PlanError": "lightning_osdp.plan",
    "Prediction": "lightning_osdp.cost_model",
    "PredictionSummary": "lightning_osdp.solve_report",
    "SolveReport": "lightning_osdp.solve_report",
    "SplitLinear": "lightning_osdp.apply",
    "apply_plan": "lightning_osdp.apply",
    "benchmark_collectives": "lightning_osdp.profiling",
    "default_units": "lightning_osdp.plan",
    "format_plan": "lightning_osdp.solver",
    "minimum_budget": "lightning_osdp.solver",
    "parse_memory_budget": "lightning_osdp.budget",
    "plan_model": "lightning_osdp.solver",
    "predict": "lightning_osdp.cost_model",
    "profile": "lightning_osdp.profiling",
    "solve": "lightning_osdp.solver",
}

__all__ = [
    "MODES",
    "Decision",
    "InfeasibleBudgetError",
    "ModelProfile",
    "OSDPFabricStrategy",
    "OSDPModule",
    "OSDPStrategy",
    "Plan",
    "PlanError",
    "Prediction",
    "PredictionSummary",
    "SolveReport",
    "SplitLinear",
    "apply_plan",
    "benchmark_collectives",
    "default_units",
    "format_plan",
    "minimum_budget",
    "parse_memory_budget",
    "plan_model",
    "predict",
    "profile",
    "solve",
]

#: The name ``Trainer(strategy=...)`` and ``Fabric(strategy=...)`` take; ``OSDPStrategy.strategy_name`` and
#: ``OSDPFabricStrategy.strategy_name`` (a test checks that they agree).
_STRATEGY_NAME = "osdp"
_STRATEGY_DESCRIPTION = "Optimal Sharded Data Parallel (per-module DDP/ZeRO plan)"
# Where Lightning keeps its two strategy registries, the Trainer's and Fabric's, by the name of each registry.
_REGISTRY_MODULE = "lightning.pytorch.strategies"
_FABRIC_REGISTRY_MODULE = "lightning.fabric.strategies"
_REGISTRIES = {_REGISTRY_MODULE: "StrategyRegistry", _FABRIC_REGISTRY_MODULE: "STRATEGY_REGISTRY"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value
    # A subpackage or module reached as an attribute (``lightning_osdp.checkpoint.consolidate(...)``), as it could be
    # when this file imported them all; the import sets the attribute too.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _osdp_strategy(**kwargs: Any) -> Any:
    """What ``StrategyRegistry.get("osdp")`` calls: an :class:`~lightning_osdp.strategy.OSDPStrategy`.

    A factory rather than the class, so that registering imports nothing: the registration runs in the middle of
    Lightning's own import, where importing ``lightning_osdp.strategy`` (most of ``lightning.pytorch``) could meet
    half-initialised modules, and that very module may be the one whose import started Lightning's.
    """
    from lightning_osdp.strategy import OSDPStrategy

    return OSDPStrategy(**kwargs)


def _osdp_fabric_strategy(**kwargs: Any) -> Any:
    """What Fabric's ``STRATEGY_REGISTRY.get("osdp")`` calls: an :class:`~lightning_osdp.fabric.OSDPFabricStrategy`
    (a factory for the same reason as :func:`_osdp_strategy`)."""
    from lightning_osdp.fabric import OSDPFabricStrategy

    return OSDPFabricStrategy(**kwargs)


def _register(strategies: ModuleType) -> None:
    registry = getattr(strategies, _REGISTRIES[strategies.__name__])
    factory = _osdp_fabric_strategy if strategies.__name__ == _FABRIC_REGISTRY_MODULE else _osdp_strategy
    if _STRATEGY_NAME not in registry:
        registry.register(_STRATEGY_NAME, factory, description=_STRATEGY_DESCRIPTION)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that claims nothing: when ``lightning.pytorch.strategies`` or
    ``lightning.fabric.strategies`` is about to be imported, it finds the module with the finders after it and wraps
    that loader's ``exec_module``, so that :func:`_register` runs right after the module's code has run; once both
    are registered it takes itself off ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _REGISTRIES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # a loader of the old protocol: leave it alone (the name then needs registering by hand)
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            if self in sys.meta_path and all(_registry_loaded(name) for name in _REGISTRIES):
                sys.meta_path.remove(self)
            _register(module)

        # On the instance: the loader keeps its class, so everything else asks of it (get_source for tracebacks,
        # resource readers) is unchanged.
        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _register_when_lightning_loads() -> None:
    """Register ``"osdp"`` in Lightning's strategy registry now if Lightning is imported, else right after it is.

    [Note: why an import hook]
    Lightning 2.6 discovers no strategies: its registries (the Trainer's and Fabric's) are filled by Lightning's own
    classes at import, and the only entry points it reads (``lightning.pytorch.callbacks_factory``) are loaded after
    the Trainer has already resolved its ``strategy`` argument. Importing Lightning here would make every import of
    this package pay for it. So a finder on ``sys.meta_path`` (:class:`_RegisterAfterImport`) waits for each
    registry's module, whichever of ``import lightning``, ``import lightning.pytorch``, ``import lightning.fabric``
    or ``from lightning.pytorch.strategies import ...`` brings it in, before or after this package.
    """
    for name in _REGISTRIES:
        if _registry_loaded(name):
            _register(sys.modules[name])
    if not all(_registry_loaded(name) for name in _REGISTRIES) and not any(
        isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _RegisterAfterImport())


def _registry_loaded(name: str) -> bool:
    return hasattr(sys.modules.get(name), _REGISTRIES[name])


_register_when_lightning_loads()
