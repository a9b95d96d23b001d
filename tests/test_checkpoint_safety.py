"""Checkpoints from elsewhere: a crafted file runs no code, corruption is caught and named, the manifest is checked
field by field, another model's checkpoint is refused before planning, and checkpoints of lightning_osdp 0.1 load.

Every case starts from a real checkpoint of a one-process ``Trainer.fit`` (a sharded directory, and its
consolidated file), altered as an attacker, a failing disk or a careless copy would alter it. Resumes are real
``Trainer.fit(ckpt_path=...)`` runs in this process.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_osdp import OSDPStrategy, Plan
from lightning_osdp import checkpoint as ckpt
from lightning_osdp.checkpoint.integrity import checksumming_writer, file_checksum, written_checksums
from lightning_osdp.checkpoint.unpickle import load_torch_file
from lightning_osdp.cli import main as osdp

from models import TinyGPT, loaders

pytestmark = pytest.mark.slow

PLAN = {"": "no_shard", "h.0": "full_shard", "h.0.fc": ("full_shard", 3), "h.1": "shard_grad_op", "h.2": "full_shard"}
#: The manifest fields lightning_osdp 0.1 wrote (checkpoint layout version 1, no checksums).
FIELDS_0_1 = {
    "format",
    "version",
    "state_dict_type",
    "world_size",
    "memory_budget",
    "optimizers",
    "plan",
    "profile",
    "global_step",
    "epoch",
    "files",
    "created",
    "versions",
}


def fit(
    model: L.LightningModule,
    *,
    max_steps: int = 3,
    ckpt_path: Path | None = None,
    weights_only: bool | None = None,
    plan: Plan | None = None,
) -> L.Trainer:
    """A one-process fit under OSDP; without ``plan`` the strategy takes the resumed checkpoint's (or plans)."""
    environ = dict(os.environ)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=OSDPStrategy(plan=plan, memory_steps=0),
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model, loaders()[0], ckpt_path=ckpt_path, weights_only=weights_only)
    finally:
        os.environ.clear()
        os.environ.update(environ)  # Lightning's rendezvous variables must not reach later child processes
    return trainer


@dataclass
class Saved:
    sharded: Path
    full: Path


def save_both(out: Path) -> Saved:
    """A real checkpoint of a 3-step one-process fit under :data:`PLAN` in ``out``: sharded, and consolidated."""
    torch.manual_seed(0)
    trainer = fit(TinyGPT(), plan=Plan(PLAN))
    trainer.save_checkpoint(out / "sharded.ckpt")
    return Saved(out / "sharded.ckpt", ckpt.consolidate(out / "sharded.ckpt", out / "full.ckpt"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return save_both(tmp_path_factory.mktemp("saved"))


def copy(path: Path, to: Path) -> Path:
    if path.is_dir():
        shutil.copytree(path, to)
    else:
        shutil.copyfile(path, to)
    return to


def reseal(path: Path) -> None:
    """Make the manifest agree with the files again (sizes and checksums), as whoever edited them would."""
    manifest = json.loads((path / "osdp.json").read_text())
    manifest["files"] = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.name != "osdp.json"}
    if "checksums" in manifest:
        manifest["checksums"] = {n: f"crc32:{zlib.crc32((path / n).read_bytes()):08x}" for n in manifest["files"]}
    (path / "osdp.json").write_text(json.dumps(manifest))


def edit_manifest(path: Path, **fields: Any) -> None:
    manifest = json.loads((path / "osdp.json").read_text())
    manifest.update(fields)
    (path / "osdp.json").write_text(json.dumps(manifest))


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def largest_record(path: Path) -> tuple[str, int, int]:
    """Name, first byte and length of the largest record (a tensor's storage) of a torch.save zip file."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.filename, info.header_offset + 30 + name_length + extra_length, info.file_size


# ============================================================================================== code in a checkpoint
class Payload:
    """Unpickling it creates ``marker``: what a crafted checkpoint would do with a shell command instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@dataclass
class Crafted:
    marker: Path
    full: Path  # a consolidated file with the payload among the hyper-parameters
    meta: Path  # a sharded directory with the payload in meta.pt
    index: Path  # a sharded directory with the payload in DCP's .metadata
    items: Path  # a sharded directory with the payload as a DCP item (an optimizer hyper-parameter)


@pytest.fixture
def crafted(saved: Saved, tmp_path: Path) -> Iterator[Crafted]:
    marker = tmp_path / "payload-ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists(), "precondition: the payload runs when unpickled"
    marker.unlink()

    full = tmp_path / "full.ckpt"
    content = torch.load(saved.full, weights_only=False)
    content["hyper_parameters"]["note"] = Payload(marker)
    torch.save(content, full)

    meta = copy(saved.sharded, tmp_path / "meta.ckpt")
    content = torch.load(meta / "meta.pt", weights_only=False)
    content["hyper_parameters"]["note"] = Payload(marker)
    torch.save(content, meta / "meta.pt")
    reseal(meta)

    index = copy(saved.sharded, tmp_path / "index.ckpt")
    metadata = pickle.loads((index / ".metadata").read_bytes())
    metadata.planner_data["note"] = Payload(marker)
    (index / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(index)

    items = tmp_path / "items.ckpt"
    model = nn.Linear(4, 3)
    optimizer_state = {"state": {}, "param_groups": [{"lr": Payload(marker), "params": ["weight", "bias"]}]}
    ckpt.save_checkpoint(
        {"state_dict": ckpt.sharded_model_state(model), "optimizer_states": [optimizer_state]},
        items,
        module=model,
        context=ckpt.CheckpointContext(world_size=1),
    )
    yield Crafted(marker, full, meta, index, items)
    assert not marker.exists(), "the checkpoint's payload ran"


def test_osdp_show_runs_no_code_from_a_checkpoint(crafted: Crafted, capsys: pytest.CaptureFixture[str]) -> None:
    # The plan is read from a file without trusting the rest of it: the hyper-parameters never run.
    assert osdp(["show", str(crafted.full)]) == 0
    assert Plan(PLAN).summary() in capsys.readouterr().out
    assert osdp(["show", str(crafted.meta)]) == 0
    assert osdp(["show", str(crafted.index)]) == 2
    err = capsys.readouterr().err
    assert ".metadata" in err and "builtins.exec" in err


def test_osdp_consolidate_runs_no_code_from_a_checkpoint(
    crafted: Crafted, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for src, named in ((crafted.meta, "meta.pt"), (crafted.index, ".metadata"), (crafted.items, "optimizer_0")):
        assert osdp(["consolidate", str(src), str(tmp_path / "out.ckpt")]) == 2, src
        err = capsys.readouterr().err
        assert named in err and "builtins.exec" in err and "made to run code" in err, err
    assert not (tmp_path / "out.ckpt").exists()


def test_resuming_runs_no_code_from_a_checkpoint(crafted: Crafted) -> None:
    for path, named in ((crafted.full, "full.ckpt"), (crafted.meta, "meta.pt"), (crafted.index, ".metadata")):
        with pytest.raises(ckpt.UntrustedContentError, match=r"builtins\.exec.*made to run code") as info:
            fit(TinyGPT(), ckpt_path=path)
        assert named in str(info.value)
    # The optimizer state of a sharded checkpoint is read item by item: a crafted item is refused too.
    model = nn.Linear(4, 3)
    checkpoint = ckpt.load_checkpoint(crafted.items)
    with pytest.raises(ckpt.CheckpointError, match="optimizer_0.param_groups"):
        ckpt.load_optimizer_states(model, [torch.optim.SGD(model.parameters(), lr=0.1)], checkpoint)


def test_the_resume_plan_reader_runs_no_code_from_a_checkpoint(crafted: Crafted) -> None:
    for path in (crafted.full, crafted.meta):
        found = ckpt.saved_plan(path)
        assert found is not None and found.plan.decisions == Plan(PLAN).decisions
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata.*builtins\.exec"):
        ckpt.saved_plan(crafted.index)
    with pytest.raises(ckpt.UntrustedContentError, match="made to run code"):
        ckpt.load_checkpoint(crafted.full)


@dataclass
class Config:
    """A user's own class among the hyper-parameters: loading it means trusting the checkpoint."""

    width: int = 21


def test_a_checkpoint_that_needs_more_than_plain_data_loads_only_when_trusted(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy(saved.sharded, tmp_path / "configured.ckpt")
    content = torch.load(path / "meta.pt", weights_only=False)
    content["hyper_parameters"]["config"] = Config()
    torch.save(content, path / "meta.pt")
    reseal(path)
    refusal = r"meta\.pt.*test_checkpoint_safety\.Config.*add_safe_globals\(\[test_checkpoint_safety\.Config\]\)"
    with pytest.raises(ckpt.UntrustedContentError, match=refusal):
        fit(TinyGPT(), ckpt_path=path)
    # The user vouches for the class, and only for it (torch's own allow-list), or for the whole checkpoint.
    with torch.serialization.safe_globals([Config]):
        assert fit(TinyGPT(), ckpt_path=path, max_steps=5).global_step == 5
    loaded = ckpt.load_checkpoint(path, weights_only=False)
    assert loaded["hyper_parameters"]["config"] == Config() and loaded["global_step"] == 3
    out = tmp_path / "configured-full.ckpt"
    assert osdp(["consolidate", str(path), str(out)]) == 2
    assert "--allow-pickle" in capsys.readouterr().err and not out.exists()
    assert osdp(["consolidate", "--allow-pickle", str(path), str(out)]) == 0
    assert torch.load(out, weights_only=False)["hyper_parameters"]["config"] == Config()


def test_only_a_pickle_that_names_code_is_called_crafted(tmp_path: Path) -> None:
    torch.save({"hyper_parameters": {"layers": range(3)}}, tmp_path / "range.pt")
    with pytest.raises(ckpt.UntrustedContentError, match=r"builtins\.range.*add_safe_globals") as info:
        load_torch_file(tmp_path / "range.pt", weights_only=True, what="meta.pt")
    assert "made to run code" not in str(info.value)
    torch.save({"hyper_parameters": {"x": Payload(tmp_path / "ran")}}, tmp_path / "payload.pt")
    with pytest.raises(
        ckpt.UntrustedContentError, match=r"builtins\.exec.*made to run code when it is loaded\. Do not load it"
    ):
        load_torch_file(tmp_path / "payload.pt", weights_only=True, what="meta.pt")
    assert not (tmp_path / "ran").exists()


def test_lightning_does_not_pass_fit_weights_only_to_a_strategy_that_restores_after_setup(
    saved: Saved, tmp_path: Path
) -> None:
    """Lightning 2.6 drops ``Trainer.fit(..., weights_only=...)`` for strategies that restore after ``setup``, as
    OSDP must (``_restore_modules_and_callbacks(ckpt_path)``; Lightning-AI/pytorch-lightning#21072 passes it). When
    this test fails, Lightning passes it: say so in docs/checkpointing.md and in the refusal message."""
    path = copy(saved.sharded, tmp_path / "configured.ckpt")
    content = torch.load(path / "meta.pt", weights_only=False)
    content["hyper_parameters"]["config"] = Config()
    torch.save(content, path / "meta.pt")
    reseal(path)
    with pytest.raises(ckpt.UntrustedContentError):
        fit(TinyGPT(), ckpt_path=path, weights_only=False)


# ============================================================================================== corruption
def test_every_file_dcp_writes_is_checksummed_as_it_is_written(tmp_path: Path) -> None:
    """The checksums of a sharded save are computed as DCP writes the bytes, through its writer's file system (not a
    documented extension point: if torch stops writing through it, this fails, and saves fall back to reading the
    files back)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    writer = checksumming_writer(tmp_path / "dcp")
    dcp.save({"state_dict": model.state_dict(), "step": 3}, storage_writer=writer)
    files = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp"]
    assert written_checksums(writer) == {name: file_checksum(tmp_path / "dcp" / name) for name in files}


def test_a_flipped_bit_in_a_shard_is_caught_naming_the_file(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy(saved.sharded, tmp_path / "flipped.ckpt")
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    flip_bit(shard, size // 2)
    assert shard.stat().st_size == size
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp.*checksum"):
        ckpt.load_checkpoint(path)
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp"):
        fit(TinyGPT(), ckpt_path=path)
    assert osdp(["consolidate", str(path), str(tmp_path / "out.ckpt")]) == 2
    assert "__0_0.distcp" in capsys.readouterr().err
    # The plan the resume reader takes is checked too.
    (path / "plan.json").write_text((path / "plan.json").read_text().replace("full_shard", "full_shari", 1))
    with pytest.raises(ckpt.CheckpointError, match=r"plan\.json.*checksum"):
        ckpt.saved_plan(path)


def test_a_flipped_bit_in_a_full_file_is_caught_naming_the_file(saved: Saved, tmp_path: Path) -> None:
    path = copy(saved.full, tmp_path / "flipped-full.ckpt")
    record, start, length = largest_record(path)
    flip_bit(path, start + length // 2)
    with pytest.raises(ckpt.CheckpointError, match=rf"flipped-full\.ckpt.*{record}"):
        ckpt.load_checkpoint(path)
    with pytest.raises(ckpt.CheckpointError, match=r"flipped-full\.ckpt"):
        fit(TinyGPT(), ckpt_path=path)


def test_truncated_shards_are_named(saved: Saved, tmp_path: Path) -> None:
    for checksums in (True, False):
        path = copy(saved.sharded, tmp_path / f"truncated-{checksums}.ckpt")
        shard = path / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        # The sizes recorded agree with the truncated file; the checksums (when the checkpoint has them) do not.
        manifest = json.loads((path / "osdp.json").read_text())
        manifest["files"]["__0_0.distcp"] = shard.stat().st_size
        if not checksums:
            manifest = {k: v for k, v in manifest.items() if k in FIELDS_0_1}
        (path / "osdp.json").write_text(json.dumps(manifest))
        with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp") as info:
            ckpt.load_checkpoint(path)
        assert ("checksum" if checksums else "truncated") in str(info.value)
        with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp"):
            ckpt.consolidate(path, tmp_path / "out.ckpt")


# ============================================================================================== the manifest is data
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"files": ["meta.pt", ".metadata"]}, r"'files' must be an object"),
        ({"world_size": "two"}, r"'world_size' must be an integer >= 1, got 'two'"),
        ({"world_size": True}, r"'world_size' must be an integer >= 1, got True"),
        ({"optimizers": -1}, r"'optimizers' must be an integer >= 0"),
        ({"optimizers": 3}, r"3 optimizer states.*holds 1"),
        ({"memory_budget": "6GiB"}, r"'memory_budget' must be a number of bytes"),
        ({"global_step": [5]}, r"'global_step'"),
        ({"versions": "2.13"}, r"'versions'"),
        ({"state_dict_type": "full"}, r"'state_dict_type' of a checkpoint directory must be 'sharded'"),
        ({"plan": "../plan.json"}, r"'plan' must name a file of the checkpoint.*'\.\./plan\.json'"),
        ({"plan": "missing.json"}, r"'plan'.*'missing\.json'.*not listed"),
        ({"profile": "/etc/passwd"}, r"'profile' must name a file of the checkpoint"),
        ({"checksums": {"__0_0.distcp": "md5:00"}}, r"'checksums'.*crc32"),
    ],
)
def test_every_manifest_field_is_checked(saved: Saved, tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    path = copy(saved.sharded, tmp_path / "edited.ckpt")
    edit_manifest(path, **fields)
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load_checkpoint(path)


def test_a_plan_outside_the_checkpoint_is_never_read(saved: Saved, tmp_path: Path) -> None:
    outside = Plan({"": "full_shard"}).save(tmp_path / "elsewhere.json")
    path = copy(saved.sharded, tmp_path / "pointing-out.ckpt")
    edit_manifest(path, plan=str(outside))
    with pytest.raises(ckpt.CheckpointError, match=r"'plan' must name a file of the checkpoint"):
        ckpt.saved_plan(path)
    with pytest.raises(ckpt.CheckpointError, match=r"'plan' must name a file of the checkpoint"):
        fit(TinyGPT(), ckpt_path=path)


def test_a_full_file_entry_is_checked_like_a_manifest(saved: Saved, tmp_path: Path) -> None:
    path = tmp_path / "edited-full.ckpt"
    content = torch.load(saved.full, weights_only=True)
    content["osdp"]["world_size"] = "two"
    torch.save(content, path)
    with pytest.raises(ckpt.CheckpointError, match=r"'world_size' must be an integer >= 1, got 'two'"):
        ckpt.saved_plan(path)


# ============================================================================================== another model
def test_a_checkpoint_of_another_model_is_refused_before_planning(saved: Saved) -> None:
    for path in (saved.sharded, saved.full):
        # Its saved plan names `h.2`, which a two-block model does not have: the keys say why, before any profiling.
        with pytest.raises(ckpt.CheckpointMismatchError, match=r"not in the model: h\.2\.") as info:
            fit(TinyGPT(layers=2), ckpt_path=path)
        assert "before planning" in str(info.value)
        with pytest.raises(
            ckpt.CheckpointMismatchError, match=r"h\.0\.fc\.weight: checkpoint \(85, 21\), model \(86, 21\)"
        ):
            fit(TinyGPT(hidden=86), ckpt_path=path)


def test_a_saved_plan_that_does_not_fit_the_model_is_replaced_with_a_reason() -> None:
    saved = ckpt.SavedPlan(Plan({"": "full_shard", "blocks.2": "no_shard"}), None, 1, None, "c.ckpt")
    choice = ckpt.resume_plan(saved, world_size=1, memory_budget=None, module=TinyGPT())
    assert not choice.reuse
    assert "re-planning: the plan saved in c.ckpt does not fit this model" in choice.reason
    assert "blocks.2" in choice.reason
    fitting = ckpt.SavedPlan(Plan(PLAN), None, 1, None, "c.ckpt")
    assert ckpt.resume_plan(fitting, world_size=1, memory_budget=None, module=TinyGPT()).reuse


# ============================================================================================== old checkpoints
def test_checkpoints_of_lightning_osdp_0_1_still_load(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy(saved.sharded, tmp_path / "old.ckpt")
    manifest = json.loads((path / "osdp.json").read_text())
    (path / "osdp.json").write_text(json.dumps({k: v for k, v in manifest.items() if k in FIELDS_0_1}))
    assert set(json.loads((path / "osdp.json").read_text())) == FIELDS_0_1
    trainer = fit(TinyGPT(), ckpt_path=path, max_steps=5)
    assert trainer.global_step == 5
    assert osdp(["show", str(path)]) == 0
    assert osdp(["consolidate", str(path), str(tmp_path / "old-full.ckpt")]) == 0
    assert torch.load(tmp_path / "old-full.ckpt", weights_only=True)["global_step"] == 3
