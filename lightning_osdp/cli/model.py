"""Which model a dry run plans for: a class named on the command line or in a LightningCLI config, and its
arguments; built on the meta device, so that a model of any size costs no memory.

A model is named as ``package.module:Class`` (or ``package.module.Class``), or as ``path/to/file.py:Class`` for
code that is not an installed package (the file's folder is put first on ``sys.path`` while it is imported, as
``python path/to/file.py`` would, so that its sibling imports work). Its ``__init__`` arguments come from the
config's ``model:`` section (LightningCLI's ``class_path``/``init_args`` form or bare arguments), then from
``--init-args`` (JSON), then from each ``--init-arg key=value`` (the value read as YAML: ``8`` is an int,
``true`` a bool, ``[1, 2]`` a list), later ones overriding earlier ones.

[Note: a config without class_path]
LightningCLI scripts usually fix the model class in code (``LightningCLI(GPTModule, ...)``), so their configs
name only its arguments. Then the class is read from the script: the ``.py`` files beside the config and one
folder up are parsed (not run) for a call to ``LightningCLI`` or a subclass of it whose first argument is a class
imported from a sibling module or defined in the script. ``--model`` names it explicitly instead.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from lightning_osdp.cli.errors import CLIError

__all__ = ["RunConfig", "build_on_meta", "discover_cli_model", "import_object", "parse_init_args", "read_configs"]


@dataclass
class RunConfig:
    """What LightningCLI configs say that a dry run uses (``None``: not said).

    Attributes:
        model: the model class path (``class_path``), or the class found in the config's CLI script.
        init_args: the model's ``__init__`` arguments.
        batch_size: the data section's ``batch_size`` (per device, as Lightning's data loaders take it).
        precision: ``trainer.precision`` (``"bf16-fsdp"``: ``bf16-mixed`` with the strategy's
            ``mixed_precision: bf16``).
        world_size: ``trainer.devices`` times ``trainer.num_nodes``, when both are numbers.
        nodes: ``trainer.num_nodes``, when ``world_size`` is known.
        accumulate_grad_batches: ``trainer.accumulate_grad_batches``, when a number.
        memory_budget, memory_headroom, modes, max_split, shard_group_size, activation_checkpointing: the OSDP
            strategy's init args.
        sources: the config files read.
    """

    model: str | None = None
    init_args: dict[str, Any] = field(default_factory=dict)
    batch_size: int | None = None
    precision: str | None = None
    world_size: int | None = None
    nodes: int | None = None
    accumulate_grad_batches: int | None = None
    shard_group_size: int | None = None
    memory_budget: int | str | None = None
    memory_headroom: float | None = None
    modes: list[str] | None = None
    max_split: int | None = None
    activation_checkpointing: bool | str | None = None
    sources: list[str] = field(default_factory=list)


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _section(value: Any) -> tuple[str | None, dict[str, Any]]:
    """``(class_path, init_args)`` of a LightningCLI section given either way."""
    if value is None:
        return None, {}
    if isinstance(value, str):
        return value, {}
    if not isinstance(value, Mapping):
        raise CLIError(f"expected a mapping, got {value!r}")
    if "class_path" in value:
        return str(value["class_path"]), dict(value.get("init_args") or {})
    return None, dict(value)


def _devices(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text) or None
        if "," in text:
            return len([d for d in text.split(",") if d.strip()])
    return None  # "auto", -1: depends on the machine it runs on


def read_configs(paths: Sequence[str | os.PathLike[str]]) -> RunConfig:
    """Merge LightningCLI YAML configs (later ones override earlier ones, as ``--config`` does) into a
    :class:`RunConfig`."""
    merged: dict[str, Any] = {}
    for path in paths:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise CLIError(f"config file {str(path)!r} does not exist") from None
        except yaml.YAMLError as err:
            raise CLIError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(err).split())}") from None
        if loaded is None:
            continue
        if not isinstance(loaded, Mapping):
            raise CLIError(f"config file {str(path)!r} must hold a mapping (trainer:, model:, data:)")
        # A model section may switch between the class_path form and bare arguments across files.
        if "model" in loaded and "model" in merged:
            old_class, old_args = _section(merged["model"])
            new_class, new_args = _section(loaded["model"])
            loaded = {**loaded, "model": {"class_path": new_class or old_class, "init_args": {**old_args, **new_args}}}
        merged = _merge(merged, loaded)
    config = RunConfig(sources=[str(p) for p in paths])
    try:
        config.model, config.init_args = _section(merged.get("model"))
        _, data_args = _section(merged.get("data"))
    except CLIError as err:
        raise CLIError(f"{', '.join(config.sources)}: model/data section: {err}") from None
    if isinstance(data_args.get("batch_size"), int):
        config.batch_size = data_args["batch_size"]
    trainer = merged.get("trainer") or {}
    if not isinstance(trainer, Mapping):
        raise CLIError(f"{', '.join(config.sources)}: the trainer section must be a mapping")
    if trainer.get("precision") is not None:
        config.precision = str(trainer["precision"])
    accumulation = trainer.get("accumulate_grad_batches")
    if isinstance(accumulation, int) and not isinstance(accumulation, bool):
        config.accumulate_grad_batches = accumulation
    devices = _devices(trainer.get("devices"))
    nodes = trainer.get("num_nodes", 1)
    if devices is not None and isinstance(nodes, int) and nodes > 0:
        config.world_size = devices * nodes
        config.nodes = nodes
    strategy_class, strategy_args = _section(trainer.get("strategy"))
    if strategy_class is not None and (strategy_class == "osdp" or strategy_class.endswith("OSDPStrategy")):
        config.memory_budget = strategy_args.get("memory_budget")
        headroom = strategy_args.get("memory_headroom")
        if isinstance(headroom, (int, float)) and not isinstance(headroom, bool):
            config.memory_headroom = float(headroom)
        if strategy_args.get("modes") is not None:
            config.modes = list(strategy_args["modes"])
        if isinstance(strategy_args.get("max_split"), int):
            config.max_split = strategy_args["max_split"]
        if "activation_checkpointing" in strategy_args:
            from lightning_osdp.options import check_activation_checkpointing

            try:
                config.activation_checkpointing = check_activation_checkpointing(
                    strategy_args["activation_checkpointing"]
                )
            except ValueError as err:
                raise CLIError(f"{', '.join(config.sources)}: {err}") from None
        if strategy_args.get("mixed_precision") == "bf16" and config.precision in ("bf16-mixed", "bf16"):
            config.precision = "bf16-fsdp"  # the dry run's name for bf16-mixed under FSDP2's policy
        if isinstance(strategy_args.get("shard_group_size"), int):
            config.shard_group_size = strategy_args["shard_group_size"]
    return config


def _cli_class(tree: ast.Module) -> str | None:
    """The first argument of a ``...CLI(Model, ...)`` call in a script, if it is a plain name."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Name):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name.endswith("CLI"):
            return node.args[0].id
    return None


def discover_cli_model(config_path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(model spec, script)`` for the LightningCLI script beside a config, if one is found (see
    [Note: a config without class_path]); the spec is ``file.py:Class`` or ``module:Class``."""
    folder = Path(config_path).resolve().parent
    for directory in (folder, folder.parent):
        for script in sorted(directory.glob("*.py")):
            try:
                text = script.read_text()
            except OSError:
                continue
            if "LightningCLI" not in text:
                continue
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            name = _cli_class(tree)
            if name is None:
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return f"{script}:{name}", str(script)
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                    continue
                original = next((a.name for a in node.names if (a.asname or a.name) == name), None)
                if original is not None:
                    sibling = script.parent / (node.module.replace(".", "/") + ".py")
                    if sibling.is_file():
                        return f"{sibling}:{original}", str(script)
                    return f"{node.module}:{original}", str(script)
    return None


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise CLIError(f"model file {str(path)!r} does not exist")
    # Sibling imports in the file (``from gpt import Block``) resolve as when the file is run as a script.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = path.stem
    if name in sys.modules:
        existing = getattr(sys.modules[name], "__file__", None)
        if existing and Path(existing).resolve() == path.resolve():
            return sys.modules[name]
        name = f"_osdp_user_{abs(hash(str(path.resolve())))}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CLIError(f"cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses and pickling look the module up by name.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise CLIError(f"importing {str(path)!r} failed: {type(err).__name__}: {err}") from err
    return module


def import_object(spec: str) -> Any:
    """The object ``spec`` names: ``file.py:Name``, ``package.module:Name`` or ``package.module.Name``."""
    if ":" in spec:
        where, _, attr = spec.rpartition(":")
    else:
        where, _, attr = spec.rpartition(".")
    if not where or not attr:
        raise CLIError(f"cannot read {spec!r} as a class path: use module:Class, package.module.Class or file.py:Class")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_file(Path(where))
    else:
        # A console script does not put the working directory on sys.path; `python -m` does. Do it for both,
        # so that `examples.gpt.gpt:GPTModule` (a namespace package in the checkout) resolves from its root.
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            raise CLIError(f"module {where!r} not found ({err}); for a file use path/to/file.py:{attr}") from None
        except Exception as err:
            raise CLIError(f"importing module {where!r} failed: {type(err).__name__}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError:
        import difflib

        defined = sorted(
            n
            for n, v in vars(module).items()
            if isinstance(v, type) and v.__module__ == module.__name__ and not n.startswith("_")
        )
        close = difflib.get_close_matches(attr, list(vars(module)), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise CLIError(f"{where!r} has no {attr!r}{hint}; it defines: {', '.join(defined) or 'no classes'}") from None


def parse_init_args(json_text: str | None, pairs: Sequence[str]) -> dict[str, Any]:
    """``--init-args`` (a JSON object) updated by each ``--init-arg key=value`` (the value read as YAML)."""
    args: dict[str, Any] = {}
    if json_text:
        try:
            loaded = json.loads(json_text)
        except json.JSONDecodeError as err:
            raise CLIError(f"--init-args is not valid JSON ({err}): {json_text!r}") from None
        if not isinstance(loaded, dict):
            raise CLIError(f"--init-args must be a JSON object, got {json_text!r}")
        args.update(loaded)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"--init-arg takes key=value, got {pair!r}")
        try:
            args[key.strip()] = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            args[key.strip()] = value
    return args


def build_on_meta(cls: Any, init_args: Mapping[str, Any]) -> nn.Module:
    """``cls(**init_args)`` with every parameter and buffer on the meta device: shapes only, no memory."""
    name = getattr(cls, "__name__", repr(cls))
    if not callable(cls):
        raise CLIError(f"{name} is not a class")
    try:
        with torch.device("meta"):
            model = cls(**init_args)
    except TypeError as err:
        raise CLIError(f"cannot build {name}(**{dict(init_args)}): {err}") from err
    except Exception as err:
        raise CLIError(
            f"building {name} on the meta device failed: {type(err).__name__}: {err} (a model that loads weights "
            "or computes on tensor values in __init__ cannot be planned without them)"
        ) from err
    if not isinstance(model, nn.Module):
        raise CLIError(f"{name}(...) returned a {type(model).__name__}, not a torch.nn.Module")
    return model
