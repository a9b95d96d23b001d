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
from models import TinyGPT, TokenDataset

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


# ---------------------------------------------------------------------------------------------- pretrained= checked
class _Settings:
    """A harmless class of the user's, held in a checkpoint's hyper-parameters (module level: it pickles)."""

    def __init__(self, width: int) -> None:
        self.width = width


class _CountedTokens(TokenDataset):
    """TinyGPT's tokens, counting the items read (class-level: the profile's copy of a loader reads the same list)."""

    reads: list[int] = []  # a counter shared by every copy

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        self.reads.append(i)
        return super().__getitem__(i)


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def test_a_pretrained_dtype_other_than_the_parameters_is_refused_unless_a_cast_is_asked(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(4, 3))
    # int64 weights into float32 parameters: copied and trained on before, refused even with a cast.
    torch.save({"0.weight": (source[0].weight * 1000).long(), "0.bias": source[0].bias}, tmp_path / "int.pt")
    with pytest.raises(
        CheckpointMismatchError,
        match=r"other dtypes: 1 torch\.int64 in the checkpoint, torch\.float32 in the model: 0\.weight",
    ):
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), tmp_path / "int.pt")
    with pytest.raises(CheckpointMismatchError, match="no cast crosses kinds of values"):
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), tmp_path / "int.pt", cast=True)
    # float16 safetensors into float32 parameters: upcast silently before; now refused, or cast when asked.
    half = {k: v.detach().half() for k, v in source.state_dict().items()}
    _save_safetensors(half, tmp_path / "half" / "model.safetensors")
    model = nn.Sequential(nn.Linear(4, 3))
    before = model[0].weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match=r"pretrained_cast=True") as refused:
        load_pretrained(model, tmp_path / "half")
    dtypes = "2 torch.float16 in the checkpoint, torch.float32 in the model: 0.bias (in model.safetensors), 0.weight"
    assert dtypes in str(refused.value)
    assert torch.equal(model[0].weight, before)  # refused before a row was copied
    loaded = load_pretrained(model, tmp_path / "half", cast=True)
    assert loaded.loaded == 2 and loaded.cast == 2 and "2 cast to the model's dtypes" in loaded.describe()
    assert torch.equal(model[0].weight, half["0.weight"].float())
    # The same dtype loads as before, with no cast counted.
    assert load_pretrained(model.half(), tmp_path / "half").cast == 0
    with pytest.raises(TypeError, match="pretrained_cast"):
        OSDPStrategy(pretrained_cast="yes")  # type: ignore[arg-type]


def test_a_key_in_two_safetensors_files_is_refused_naming_both(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    _save_safetensors({"0.weight": torch.zeros(3, 4), "0.bias": torch.zeros(3)}, folder / "model-1.safetensors")
    _save_safetensors({"0.weight": torch.ones(3, 4)}, folder / "model-2.safetensors")
    with pytest.raises(CheckpointMismatchError, match="is in two files") as refused:
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), folder)
    assert str(folder / "model-1.safetensors") in str(refused.value)
    assert str(folder / "model-2.safetensors") in str(refused.value)


def test_a_truncated_or_damaged_safetensors_file_is_refused_naming_it(tmp_path: Path) -> None:
    import json

    from lightning_osdp.checkpoint import CheckpointError

    path = _save_safetensors({"0.weight": torch.ones(3, 4), "0.bias": torch.ones(3)}, tmp_path / "hf" / "m.safetensors")
    whole = path.read_bytes()
    entry = json.dumps({"dtype": "F32", "shape": [3], "data_offsets": [0, 12]})
    twice = f'{{"0.bias": {entry}, "0.bias": {entry}}}'.encode()
    for damaged, why in (
        (whole[:-8], "truncated"),
        (whole[:5], "truncated"),
        (whole + b"\0" * 4, "follow it"),
        (len(twice).to_bytes(8, "little") + twice + bytes(12), "names '0.bias' more than once"),
    ):
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError, match=why) as refused:
            load_pretrained(nn.Sequential(nn.Linear(4, 3)), tmp_path / "hf")
        assert type(refused.value).__module__.startswith("lightning_osdp")  # not safetensors' SafetensorError
        assert f"pretrained weights file {str(path)!r} is not a readable safetensors file" in str(refused.value)


def test_a_ckpt_refused_for_its_pickle_gives_the_advice_that_applies_to_pretrained(tmp_path: Path) -> None:
    from lightning_osdp.checkpoint import UntrustedContentError

    weights = nn.Sequential(nn.Linear(4, 3)).state_dict()
    torch.save({"state_dict": weights, "hyper_parameters": {"settings": _Settings(3)}}, tmp_path / "run.ckpt")
    with pytest.raises(UntrustedContentError) as refused:
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), tmp_path / "run.ckpt")
    message = str(refused.value)
    assert "run.ckpt" in message and "_Settings" in message and "add_safe_globals" in message
    # Not the spellings of load_checkpoint and osdp consolidate, which pretrained= has no equivalent of.
    assert "--allow-pickle" not in message and "consolidate" not in message and "load_checkpoint" not in message
    # The advice given works: allowed in the process, the weights load.
    model = nn.Sequential(nn.Linear(4, 3))
    with torch.serialization.safe_globals([_Settings]):
        assert load_pretrained(model, tmp_path / "run.ckpt").loaded == 2
    assert torch.equal(model[0].weight, weights["0.weight"])


def test_every_misfit_of_pretrained_weights_is_found_from_headers_on_a_meta_model(tmp_path: Path) -> None:
    from lightning_osdp.checkpoint import validate_pretrained

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 2))
    _save_safetensors(
        {"0.weight": torch.ones(3, 5), "1.weight": torch.ones(2, 3, dtype=torch.int64), "9.bias": torch.ones(2)},
        tmp_path / "hf" / "model.safetensors",
    )
    with pytest.raises(CheckpointMismatchError) as refused:
        validate_pretrained(model, tmp_path / "hf", prefix="")
    message = str(refused.value)
    for part in (
        "9.bias (in model.safetensors)",
        "other shapes: 0.weight",
        "other dtypes: 1 torch.int64 in the checkpoint, torch.float32 in the model: 1.weight",
        "lack 4 of",
    ):
        assert part in message, part
    assert all(p.is_meta for p in model.parameters())


def test_pretrained_weights_are_checked_before_profiling(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from models import quiet_trainer

    torch.manual_seed(1)
    weights = {k: v for k, v in TinyGPT().state_dict().items() if k != "h.0.fc.weight"}
    torch.save(weights, tmp_path / "w.pt")
    trainer = quiet_trainer(OSDPStrategy(memory_budget="1GiB", pretrained=tmp_path / "w.pt"), devices=1, max_steps=1)
    with trainer.init_module(empty_init=True):
        model = TinyGPT()
    _CountedTokens.reads.clear()
    with pytest.raises(CheckpointMismatchError, match=r"lack 1 of the model's keys: h\.0\.fc\.weight"):
        trainer.fit(model, DataLoader(_CountedTokens(), batch_size=4))
    assert _CountedTokens.reads == []  # no batch was drawn: nothing was profiled
    assert trainer.strategy.profile is None and trainer.strategy.plan is None


def test_pretrained_cast_reads_half_weights_into_a_float_model_through_the_strategy(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from models import quiet_trainer

    torch.manual_seed(1)
    half = {k: v.half() for k, v in TinyGPT().state_dict().items() if k != "lm_head.weight"}
    _save_safetensors(half, tmp_path / "hf" / "model.safetensors")
    for cast in (False, True):
        strategy = OSDPStrategy(plan=Plan({"": "no_shard"}), pretrained=tmp_path / "hf", pretrained_cast=cast)
        trainer = quiet_trainer(strategy, devices=1, max_steps=0)
        with trainer.init_module(empty_init=True):
            model = TinyGPT()
        if not cast:
            with pytest.raises(CheckpointMismatchError, match="pretrained_cast=True"):
                trainer.fit(model, DataLoader(TokenDataset(), batch_size=4))
            continue
        trainer.fit(model, DataLoader(TokenDataset(), batch_size=4))
        for key, value in model.state_dict().items():
            assert value.dtype == torch.float32 and torch.equal(value, half.get(key, half["wte.weight"]).float()), key


# ---------------------------------------------------------------------------------------------- links in a folder
def test_a_link_in_a_pretrained_folder_is_followed_only_inside_it(tmp_path: Path) -> None:
    from lightning_osdp.checkpoint import CheckpointError

    weights = nn.Sequential(nn.Linear(4, 3)).state_dict()
    outside = _save_safetensors(weights, tmp_path / "elsewhere" / "model.safetensors")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="is a link to") as refused:
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), folder)
    assert str(outside) in str(refused.value) and "'model.safetensors'" in str(refused.value)
    # Any file outside, whatever it is, is refused before it is opened.
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/etc/passwd")
    with pytest.raises(CheckpointError, match="'/etc/passwd', outside the folder"):
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), folder)
    # A link that stays inside the folder is followed; so is the path given, itself a link.
    (folder / "model.safetensors").unlink()
    _save_safetensors(weights, folder / "store" / "blob")
    (folder / "model.safetensors").symlink_to(Path("store") / "blob")
    (tmp_path / "alias").symlink_to(folder)
    assert load_pretrained(nn.Sequential(nn.Linear(4, 3)), tmp_path / "alias").loaded == 2
    (folder / "loop.safetensors").symlink_to("loop.safetensors")
    with pytest.raises(CheckpointError, match="'loop.safetensors' cannot be resolved"):
        load_pretrained(nn.Sequential(nn.Linear(4, 3)), folder)


def test_a_hugging_face_cache_snapshot_reads_its_blobs_and_no_other_file(tmp_path: Path) -> None:
    from lightning_osdp.checkpoint import CheckpointError

    weights = nn.Sequential(nn.Linear(4, 3)).state_dict()
    entry = tmp_path / "hub" / "models--org--tiny"
    snapshot = entry / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    _save_safetensors(weights, entry / "blobs" / "5f1e0ad")
    (snapshot / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / "5f1e0ad")  # as huggingface_hub links
    model = nn.Sequential(nn.Linear(4, 3))
    assert load_pretrained(model, snapshot).loaded == 2
    assert torch.equal(model[0].weight, weights["0.weight"])
    # Out of the cache entry (another model's blob, or a file elsewhere): refused.
    _save_safetensors(weights, tmp_path / "hub" / "models--org--other" / "blobs" / "77aa")
    (snapshot / "extra.safetensors").symlink_to(Path("../../..") / "models--org--other" / "blobs" / "77aa")
    with pytest.raises(CheckpointError, match="outside the folder or its Hugging Face cache entry"):
        load_pretrained(model, snapshot)
