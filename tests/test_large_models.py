"""Models larger than one device: built on the meta device, initialized after sharding as the unsharded model would
be, started from pretrained weights of every kind without any rank reading the whole model, and trained as
Lightning's DDP trains the same weights (tests/distributed/large_model_runner.py, 2 ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_osdp import OSDPStrategy, Plan
from lightning_osdp.apply.materialize import has_meta_tensors, materialize, meta_parameters
from lightning_osdp.checkpoint import CheckpointMismatchError, load_pretrained

from conftest import ROOT, torchrun
from models import TinyGPT

RTOL = 1e-5
KINDS = ("state_dict", "lightning", "consolidated", "safetensors")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("large")
    torchrun(ROOT / "tests" / "distributed" / "large_model_runner.py", str(out), timeout=900)
    return [torch.load(out / f"large.rank{r}.pt", weights_only=False) for r in range(2)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["full_shard", "shard_grad_op", "mixed"])
def test_initialization_after_sharding_equals_the_unsharded_models(results: list[dict[str, Any]], plan: str) -> None:
    reference, state = results[0]["reference_init"], results[0][f"init:{plan}"]
    assert set(state) == set(reference)
    for key, value in reference.items():
        assert torch.equal(state[key], value), key


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_meta_model_from_pretrained_weights_trains_as_ddp_from_the_same_weights(
    results: list[dict[str, Any]], kind: str
) -> None:
    for rank in range(2):
        got, want = results[rank][f"pretrained:{kind}"], results[rank]["ddp"]
        assert len(got["losses"]) == len(want["losses"]) == 6
        for a, b in zip(got["losses"], want["losses"], strict=True):
            assert abs(a - b) <= RTOL * abs(b), (kind, rank, a, b)
    state, reference = results[0][f"pretrained:{kind}"]["state"], results[0]["ddp"]["state"]
    assert set(state) == set(reference)
    for key, value in reference.items():
        assert _rel(state[key], value) <= RTOL, (kind, key)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_model_that_fits_built_on_meta_plans_and_trains_as_the_eager_path(results: list[dict[str, Any]]) -> None:
    eager, meta = results[0]["fits:eager"], results[0]["fits:meta"]
    assert meta["plan"]["decisions"] == eager["plan"]["decisions"]
    # Its copy's step fits the budget: both are measured profiles.
    assert eager["profile_mode"] == meta["profile_mode"] == "measured"
    assert meta["losses"] == eager["losses"]
    for key, value in eager["state"].items():
        assert torch.equal(meta["state"][key], value), key


# ---------------------------------------------------------------------------------------------- one process
def test_init_module_puts_parameters_on_meta_and_keeps_buffers_real() -> None:
    strategy = OSDPStrategy()
    with strategy.tensor_init_context(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # running statistics, computed in __init__
    assert has_meta_tensors(model)


def test_meta_parameters_keeps_ties_and_parameter_classes() -> None:
    with meta_parameters():
        model = TinyGPT()
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.is_meta
    assert isinstance(model.wte.weight, nn.Parameter) and not model.frozen.weight.requires_grad


def test_materializing_an_unsharded_meta_model_equals_lightnings_materialization() -> None:
    from lightning.fabric.utilities.init import _materialize_distributed_module

    from models import BatchNormCNN

    torch.manual_seed(3)
    with torch.device("meta"):
        reference = BatchNormCNN()
    _materialize_distributed_module(reference, torch.device("cpu"))
    torch.manual_seed(3)
    with torch.device("meta"):
        model = BatchNormCNN()
    assert materialize(model, torch.device("cpu")) == []
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # Its construction order is its modules' order: the eager model of the same seed, too.
    torch.manual_seed(3)
    for (name, a), b in zip(model.state_dict().items(), BatchNormCNN().state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_tied_parameter_keeps_its_first_holders_initialization() -> None:
    # Lightning's to_empty unties the head; here it stays tied and keeps the embedding's N(0, 1) draw, as eagerly.
    torch.manual_seed(3)
    with torch.device("meta"):
        model = TinyGPT()
    assert materialize(model, torch.device("cpu")) == []
    assert model.lm_head.weight is model.wte.weight
    assert 0.8 < float(model.wte.weight.std()) < 1.2  # an embedding's draw, not a Linear's kaiming bound (0.22)


def test_pretrained_keys_are_read_under_the_prefix_that_matches_them_all(tmp_path: Path) -> None:
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))

    source = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    torch.save(source.state_dict(), tmp_path / "w.pt")
    target = Wrapped()
    loaded = load_pretrained(target, tmp_path / "w.pt")
    assert loaded.prefix == "model." and loaded.loaded == 4 and loaded.missing == []
    for a, b in zip(target.parameters(), source.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointMismatchError, match="pretrained_prefix"):
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), tmp_path / "w.pt")
    with pytest.raises(CheckpointMismatchError, match="other shapes"):
        load_pretrained(nn.Sequential(nn.Linear(4, 5), nn.Linear(3, 2)), tmp_path / "w.pt")


def test_pretrained_weights_lacking_model_keys_are_refused_unless_loading_is_not_strict(tmp_path: Path) -> None:
    torch.save({"0.weight": torch.ones(3, 4)}, tmp_path / "w.pt")
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(CheckpointMismatchError, match=r"lack 1 of the model's keys: 0\.bias"):
        load_pretrained(model, tmp_path / "w.pt")
    loaded = load_pretrained(model, tmp_path / "w.pt", strict=False)
    assert loaded.missing == ["0.bias"] and torch.equal(model[0].weight, torch.ones(3, 4))


def test_pretrained_weights_that_would_run_code_are_refused(tmp_path: Path) -> None:
    import os

    from lightning_osdp.checkpoint.errors import CheckpointError

    class Payload:
        def __reduce__(self) -> Any:
            return (os.getcwd, ())

    torch.save({"0.weight": torch.ones(3, 4), "x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError):
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), tmp_path / "evil.pt")


def test_a_pretrained_path_that_does_not_exist_fails_when_the_strategy_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        OSDPStrategy(pretrained=tmp_path / "nothing.pt")
    with pytest.raises(ValueError, match="no .safetensors files"):
        OSDPStrategy(pretrained=tmp_path)
    assert OSDPStrategy(plan=Plan({"": "no_shard"})).plan is not None
