"""Every private torch and Lightning API the package uses is still where ``lightning_osdp._compat`` says, takes the
arguments we pass, and does what we rely on.

When an upgrade moves one of them, the test that fails names it (the parametrised ids are the upstream locations),
rather than a training run failing far from the cause. Where a behaviour is cheap to run, it is run for real.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_osdp import OSDPStrategy, _compat

from conftest import ROOT, child_env
from models import TinyGPT, TokenDataset

# --------------------------------------------------------------------------------------------- where and how we call
SELF = object()  # stands for `self` when a method's signature is bound


def _resolve(dotted: str) -> Any:
    """The object at ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


# Each private API and the call shape `_compat` (or an override in the package) uses, bound against its signature.
CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model": ((None, ["a"]), {}),
    "torch.distributed.checkpoint.planner_helpers._create_chunk_list": ((None,), {}),
    "torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner": ((), {"keys": None}),
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict": (
        ({},),
        {"storage_reader": None, "planner": None, "no_dist": True},
    ),
    "torch.utils._python_dispatch._disable_current_modes": ((), {}),
    "torch.utils._python_dispatch.TorchDispatchMode.__torch_dispatch__": ((SELF, None, (), (), None), {}),
    "torch.utils._pytree.tree_leaves": ((None,), {}),
    "torch.utils._pytree.tree_map": ((None, None), {}),
    "torch._subclasses.fake_tensor.FakeTensorMode": (
        (),
        {"shape_env": None, "static_shapes": True, "allow_non_fake_inputs": True},
    ),
    "torch.fx.experimental.symbolic_shapes.ShapeEnv": ((), {}),
    "torch.autograd._unsafe_preserve_version_counter": (((),), {}),
    "torch.nn.Module._apply": ((SELF, None), {}),
    "torch._subclasses.fake_tensor.is_fake": ((None,), {}),
    # Overridden by lightning_osdp.precision.OSDPGradScaler.
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler._unscale_grads_": (
        (SELF, None, None, None, True),
        {},
    ),
    "lightning.fabric.utilities.distributed._init_dist_connection": (
        (None, "gloo"),
        {"timeout": None, "device_id": None},
    ),
    "lightning.fabric.utilities.distributed._destroy_dist_connection": ((), {}),
    "lightning.fabric.utilities.distributed._sync_ddp_if_available": ((None, None), {"reduce_op": "mean"}),
    "lightning.fabric.utilities.optimizer._optimizers_to_device": (([], "cpu"), {}),
    "lightning.fabric.strategies._StrategyRegistry.register": (
        (SELF, "osdp", None),
        {"description": "Optimal Sharded Data Parallel"},
    ),
    "lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher": ((None, 2, 1), {}),
    "lightning.fabric.strategies.launchers.subprocess_script._SubprocessScriptLauncher": ((None, 2, 1), {}),
    "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher": (
        (None,),
        {"start_method": "fork"},
    ),
    # Overridden by lightning_osdp.launcher; it calls `get_extra_results` and reads `_strategy`.
    "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher._collect_rank_zero_results": (
        (SELF, None, None),
        {},
    ),
    "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher.get_extra_results": (
        (SELF, None),
        {},
    ),
    "lightning.pytorch.strategies.launchers.multiprocessing._WorkerOutput": ((None, None, None, None, {}), {}),
    # Read by _compat.fit_ckpt_path from the frame of this call.
    "lightning.pytorch.trainer.trainer.Trainer._run": ((SELF, None), {"ckpt_path": None}),
    # Strategy hooks OSDPStrategy overrides or calls.
    "lightning.pytorch.strategies.strategy.Strategy._configure_launcher": ((SELF,), {}),
    "lightning.pytorch.strategies.strategy.Strategy._reset_optimizers_and_schedulers": ((SELF,), {}),
}


@pytest.mark.parametrize("location", sorted(CALLS))
def test_the_private_api_is_where_we_call_it(location: str) -> None:
    obj = _resolve(location)
    args, kwargs = CALLS[location]
    inspect.signature(obj).bind(*args, **kwargs)


def test_init_dist_connection_passes_timeout_and_device_id_to_torch() -> None:
    # Lightning forwards its **kwargs to init_process_group.
    inspect.signature(torch.distributed.init_process_group).bind(
        "gloo", rank=0, world_size=1, timeout=timedelta(seconds=1), device_id=None
    )


@pytest.mark.parametrize("name", sorted(_compat._LIGHTNING_CLASSES))
def test_lightning_classes_resolve_to_lightnings_own(name: str) -> None:
    module, attribute = _compat._LIGHTNING_CLASSES[name]
    assert getattr(_compat, name) is getattr(importlib.import_module(module), attribute)


def test_dispatch_has_kernel_tells_an_operators_own_kernel_from_its_composite_form() -> None:
    # silu_backward runs as one kernel on the CPU; linear exists only as its composite (addmm, mm).
    assert _compat.dispatch_has_kernel("aten::silu_backward", "CPU")
    assert _compat.dispatch_has_kernel("aten::silu_backward", "CompositeImplicitAutograd")
    assert not _compat.dispatch_has_kernel("aten::linear", "CPU")
    assert not _compat.dispatch_has_kernel("aten::linear", "CompositeExplicitAutograd")


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        _compat.NoSuchThing  # noqa: B018


# --------------------------------------------------------------------------------------------- the fence holds
def _private_uses(path: Path) -> list[str]:
    """Imports of private names or modules of torch/Lightning, and ``torch._x``/``lightning._x`` attribute chains."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
            private_module = any(part.startswith("_") for part in node.module.split("."))
            names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private_module or names:
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute):
            chain = [node.attr]
            value: ast.expr = node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            private = any(p.startswith("_") and not p.startswith("__") for p in chain)
            if isinstance(value, ast.Name) and value.id in ("torch", "lightning") and private:
                found.append(f"line {node.lineno}: {value.id}.{'.'.join(reversed(chain))}")
    return found


def test_only_the_compat_module_reaches_into_private_apis() -> None:
    package = ROOT / "lightning_osdp"
    offenders = {
        str(path.relative_to(package)): uses
        for path in sorted(package.rglob("*.py"))
        if path.name != "_compat.py"
        for uses in [_private_uses(path)]
        if uses
    }
    assert offenders == {}, f"import these through lightning_osdp._compat: {offenders}"


def test_importing_it_imports_neither_lightning_nor_heavy_torch_packages() -> None:
    # Loaded from its file, so that the package's __init__ (which imports the Lightning strategy) is not involved.
    path = str(ROOT / "lightning_osdp" / "_compat.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('compat_probe', {path!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "heavy = ['lightning', 'lightning_fabric', 'pytorch_lightning', 'torch.distributed.checkpoint',\n"
        "         'torch.distributed.fsdp', 'torch.fx.experimental.symbolic_shapes']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------- torch versions
def test_the_installed_torch_is_a_validated_one() -> None:
    assert _compat.unvalidated_torch(torch.__version__) is None


def test_pyproject_declares_the_same_torch_floor() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)', pyproject)
    assert floor is not None
    assert (int(floor.group(1)), int(floor.group(2))) == _compat.TORCH_VALIDATED[0]


@pytest.mark.parametrize("version", ["2.9.0", "2.11.0+cu128", "2.13.0+cpu", "2.13.1"])
def test_validated_torch_versions_pass(version: str) -> None:
    assert _compat.unvalidated_torch(version) is None


@pytest.mark.parametrize(
    ("version", "says"),
    [
        ("2.8.1", "needs torch >= 2.9 (FSDP2's custom all-gather and reduce-scatter); found torch 2.8.1"),
        ("2.14.0", "validated on torch 2.9 to 2.13; found torch 2.14.0"),
        ("2.14.0a0+git1234", "found torch 2.14.0a0+git1234. The private torch APIs it uses are listed"),
        ("3.0.0", "`pytest tests/test_compat.py` checks each of them"),
        ("nightly", "cannot read the torch version 'nightly'"),
    ],
)
def test_other_torch_versions_are_named_in_the_warning(version: str, says: str) -> None:
    problem = _compat.unvalidated_torch(version)
    assert problem is not None and says in problem


def test_the_warning_is_raised_for_an_unvalidated_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    with pytest.warns(UserWarning, match="validated on torch 2.9 to 2.13; found torch 2.15.0"):
        _compat._warn_if_unvalidated_torch()
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat._warn_if_unvalidated_torch()


# --------------------------------------------------------------------------------------------- torch, run for real
def test_ddp_leaves_the_ignored_parameters_alone(world1: object) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    _compat.ddp_ignore_parameters(model, ["1.weight", "1.bias"])
    ddp = nn.parallel.DistributedDataParallel(model)
    bucketed: list[nn.Parameter] = []

    def record(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations; these would be strings
        bucketed.extend(bucket.parameters())
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp.register_comm_hook(None, record)
    ddp(torch.randn(2, 3)).sum().backward()
    # Only the first Linear's gradients go through DDP's buckets; the second still gets its own.
    assert {id(p) for p in bucketed} == {id(model[0].weight), id(model[0].bias)}
    assert model[1].weight.grad is not None


def test_fake_tensors_hold_no_memory_and_accept_real_inputs() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    mode = _compat.fake_tensor_mode()
    real = torch.ones(4, 4)
    with mode:
        big = torch.empty(1 << 20, 1 << 10)  # 4 GiB if it were real
        mixed = real @ torch.empty(4, 2)  # a real tensor enters the computation
    assert isinstance(big, FakeTensor) and big.shape == (1 << 20, 1 << 10)
    assert isinstance(mixed, FakeTensor) and mixed.shape == (4, 2)


def test_disable_current_modes_runs_real_tensors_inside_a_fake_mode() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    with _compat.fake_tensor_mode():
        with _compat.disable_current_modes():
            real = torch.ones(3) * 2
        fake = torch.ones(3) * 2
    assert not isinstance(real, FakeTensor) and real.sum().item() == 6.0
    assert isinstance(fake, FakeTensor)


def test_a_dispatch_mode_sees_each_aten_operator() -> None:
    seen: list[str] = []

    class Recorder(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder():
        (torch.ones(2) + 1).sum()
    assert seen == ["aten.ones.default", "aten.add.Tensor", "aten.sum.default"]


def test_pytree_flattens_and_maps_nested_containers() -> None:
    nested = {"a": [1, (2, 3)], "b": {"c": 4}}
    assert _compat.tree_leaves(nested) == [1, 2, 3, 4]
    assert _compat.tree_map(lambda x: 10 * x, nested) == {"a": [10, (20, 30)], "b": {"c": 40}}


def test_storage_resizes_are_reported_while_the_hook_is_open() -> None:
    original = torch.UntypedStorage.resize_
    sizes: list[int] = []
    storage = torch.empty(64).untyped_storage()
    with _compat.storage_resize_hook(lambda s: sizes.append(s.nbytes())):
        storage.resize_(0)
        with _compat.storage_resize_hook(lambda s: sizes.append(-s.nbytes())):
            storage.resize_(128)
        storage.resize_(512)
    storage.resize_(8)
    assert sizes == [0, 128, -128, 512]  # the inner hook runs around the outer one
    assert torch.UntypedStorage.resize_ is original
    with pytest.raises(ValueError), _compat.storage_resize_hook(sizes.append):
        raise ValueError
    assert torch.UntypedStorage.resize_ is original


def test_fsdp2_frees_and_reallocates_gathered_parameters_through_storage_resize(world1: object) -> None:
    # Why the hook exists: the dispatcher does not see these, the patched method does.
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model[0], mesh=world1)  # type: ignore[arg-type]
    fully_shard(model, mesh=world1)  # type: ignore[arg-type]
    sizes: list[int] = []
    with _compat.storage_resize_hook(lambda s: sizes.append(s.nbytes())):
        model(torch.randn(2, 8)).sum().backward()
    # Each unsharded parameter's storage: freed (0) after use and re-allocated (weight 8 * 8 * 4, bias 8 * 4 bytes).
    assert {0, 8 * 8 * 4, 8 * 4} <= set(sizes)


def test_chunk_lists_describe_what_this_rank_holds(world1: object) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    plain = _compat.dcp_chunk_list(torch.zeros(6, 4))
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in plain] == [((0, 0), (6, 4))]
    sharded = distribute_tensor(torch.zeros(6, 4), world1, [Shard(0)])  # type: ignore[arg-type]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in _compat.dcp_chunk_list(sharded)] == [((0, 0), (6, 4))]


def test_a_checkpoint_loads_whole_into_an_empty_dict(world1: object, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    saved = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": {"n": torch.tensor(7)}}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path))
    everything: dict[str, Any] = {}
    _compat.dcp_load_into_empty(everything, dcp.FileSystemReader(tmp_path), None)
    assert torch.equal(everything["model"]["w"], saved["model"]["w"]) and everything["step"]["n"].item() == 7
    only: dict[str, Any] = {}
    _compat.dcp_load_into_empty(only, dcp.FileSystemReader(tmp_path), ["step"])
    assert list(only) == ["step"]


# --------------------------------------------------------------------------------------------- Lightning, run for real
def test_dcp_writes_every_file_through_the_writers_file_system(world1: object, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Recording(FileSystem):
        def __init__(self) -> None:
            self.created: list[str] = []

        def create_stream(self, path: Any, mode: str) -> Any:
            self.created.append(Path(path).name)
            return super().create_stream(path, mode)

    writer = FileSystemWriter(tmp_path)
    recording = Recording()
    assert _compat.dcp_writer_file_system(writer, replace_with=recording) is recording
    save({"w": torch.arange(4.0)}, storage_writer=writer)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written and set(written) <= set(recording.created) | {".metadata"}
    assert ".metadata.tmp" in recording.created or ".metadata" in recording.created


def test_sync_ddp_reduces_with_lightnings_semantics(world1: object) -> None:
    assert _compat.sync_ddp_if_available(torch.tensor(3.0), None, "mean").item() == 3.0
    assert _compat.sync_ddp_if_available(torch.tensor(3.0), None, "sum").item() == 3.0


def test_optimizer_state_moves_but_the_step_counter_stays() -> None:
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([param])
    param.grad = torch.ones(3)
    optimizer.step()
    _compat.optimizers_to_device([optimizer], torch.device("meta"))
    state = optimizer.state[param]
    assert state["exp_avg"].device.type == "meta" and state["step"].device.type == "cpu"


def test_init_dist_connection_leaves_an_existing_group_alone(world1: object) -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    group = torch.distributed.group.WORLD
    _compat.init_dist_connection(LightningEnvironment(), "gloo", timeout=timedelta(seconds=30), device_id=None)
    assert torch.distributed.group.WORLD is group


def test_a_gloo_group_created_here_is_destroyed_before_the_interpreter_finalizes(tmp_path: Path) -> None:
    """See [Note: gloo groups at exit]: the group is gone by the time the exit handlers registered before it run."""
    script = tmp_path / "exit.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit
            from datetime import timedelta

            import torch.distributed as dist
            from lightning.fabric.plugins.environments import LightningEnvironment

            from lightning_osdp import _compat

            atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))  # runs after later ones
            _compat.init_dist_connection(LightningEnvironment(), "gloo", timeout=timedelta(seconds=30), device_id=None)
            print("initialized:", dist.is_initialized())
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "initialized: True" in out.stdout and "initialized at exit: False" in out.stdout, out.stdout


def test_a_spawned_process_ends_with_its_exit_handlers_and_threads_but_no_finalization(tmp_path: Path) -> None:
    script = tmp_path / "spawned.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, os, sys, threading, time
            import multiprocessing as mp

            from lightning_osdp import _compat

            class Finalized:
                def __del__(self):
                    print("finalized", flush=True)

            def work(out):
                global KEPT
                KEPT = Finalized()  # a module global: the interpreter's finalization would delete it
                atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write("ran"))

                def late():
                    time.sleep(0.5)
                    open(os.path.join(out, "thread"), "w").write("ran")

                threading.Thread(target=late).start()  # not a daemon: joined before the end
                _compat.end_spawned_process()

            if __name__ == "__main__":
                process = mp.get_context("spawn").Process(target=work, args=(sys.argv[1],))
                process.start()
                process.join()
                print("exitcode", process.exitcode)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "exitcode 0" in out.stdout and "finalized" not in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "ran"


def test_the_strategy_builds_lightnings_launchers() -> None:
    popen = L.Trainer(strategy=OSDPStrategy(), accelerator="cpu", devices=2, logger=False)
    assert isinstance(popen.strategy.launcher, _compat.SubprocessScriptLauncher)
    assert popen.strategy.launcher.num_processes == 2
    spawn = L.Trainer(strategy=OSDPStrategy(start_method="spawn"), accelerator="cpu", devices=2, logger=False)
    assert isinstance(spawn.strategy.launcher, _compat.MultiProcessingLauncher)
    assert _compat.WorkerOutput._fields == (
        "best_model_path",
        "weights_path",
        "trainer_state",
        "trainer_results",
        "extra",
    )


def test_the_registry_is_the_one_register_strategies_receives() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(StrategyRegistry, _compat.StrategyRegistry)
    # The package registers a factory (it must not import the strategy while Lightning is being imported).
    assert isinstance(StrategyRegistry.get("osdp"), OSDPStrategy)


def test_lightning_routes_the_step_through_the_wrappers_forward() -> None:
    # OSDP's FSDP2 root is a wrapper around the LightningModule: its forward (and FSDP2's root hooks) must run.
    class Doubling(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor(2.0))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.w * batch

    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, *args: Any) -> Any:
            self.calls += 1
            return self.module(*args)

    module = Doubling()
    strategy = SingleDeviceStrategy("cpu")
    strategy.connect(module)
    strategy.model = wrapper = Wrapper(module)
    assert strategy.training_step(torch.tensor(3.0), 0).item() == 6.0
    assert wrapper.calls == 1


class _Probe(SingleDeviceStrategy):
    """Records, in `setup`, what OSDPStrategy reads there."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.seen: dict[str, Any] = {}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # as OSDPStrategy's: the checkpoint loads after setup

    def setup(self, trainer: L.Trainer) -> None:
        self.seen = {
            "ckpt_path": _compat.fit_ckpt_path(trainer),
            "public ckpt_path": trainer.ckpt_path,
            "loader": _compat.fit_train_dataloader(trainer),
        }
        super().setup(trainer)


def _probe_fit(ckpt_path: Path | None = None, max_steps: int = 1, **fit: Any) -> tuple[L.Trainer, _Probe]:
    probe = _Probe()
    trainer = L.Trainer(
        strategy=probe,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyGPT(), ckpt_path=ckpt_path, **fit)
    return trainer, probe


def test_setup_sees_the_fits_checkpoint_and_dataloader(tmp_path: Path) -> None:
    loader = DataLoader(TokenDataset(8), batch_size=4)
    trainer, probe = _probe_fit(train_dataloaders=loader)
    assert probe.seen == {"ckpt_path": None, "public ckpt_path": None, "loader": loader}
    assert _compat.fit_ckpt_path(trainer) is None  # no run on the stack
    trainer.save_checkpoint(tmp_path / "one.ckpt")

    _, probe = _probe_fit(tmp_path / "one.ckpt", max_steps=2, train_dataloaders=loader)
    assert probe.seen["ckpt_path"] == str(tmp_path / "one.ckpt")
    assert probe.seen["loader"] is loader
    # If this fails, Lightning now stores the path before `strategy.setup`: read `trainer.ckpt_path` there instead
    # of `_compat.fit_ckpt_path` (see its note).
    assert probe.seen["public ckpt_path"] is None


def test_setup_sees_a_checkpoint_set_on_the_trainer_and_a_datamodules_loader(tmp_path: Path) -> None:
    trainer, _ = _probe_fit(train_dataloaders=DataLoader(TokenDataset(8), batch_size=4))
    trainer.save_checkpoint(tmp_path / "one.ckpt")

    class Data(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(TokenDataset(8), batch_size=2)

    probe = _Probe()
    trainer = L.Trainer(
        strategy=probe, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.ckpt_path = str(tmp_path / "one.ckpt")
    trainer.fit(TinyGPT(), datamodule=Data())
    assert probe.seen["ckpt_path"] == str(tmp_path / "one.ckpt")
    assert isinstance(probe.seen["loader"], DataLoader) and probe.seen["loader"].batch_size == 2


def test_a_detach_inside_a_dispatch_mode_shares_the_version_counter() -> None:
    # `torch._C._SetExcludeDispatchKeyGuard` on ADInplaceOrView, which selective recomputation's kept outputs use to
    # see a later in-place change (lightning_osdp/apply/recompute.py [Note: the operator caches]).
    from lightning_osdp._compat import TorchDispatchMode, detach_sharing_version

    kept: list[tuple[torch.Tensor, int]] = []

    class Keep(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                d = detach_sharing_version(out)
                kept.append((d, d._version))
            return out

    a = torch.randn(2, 2)
    with Keep():
        y = a @ a
        y.relu_()
    ((d, version),) = kept
    assert d.data_ptr() == y.data_ptr() and d._version != version
