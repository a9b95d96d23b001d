"""Nothing lost, nothing read from outside: a consolidation onto its own input, files that are symbolic links out of
the checkpoint, a reader racing a writer, a full disk, an index that declares tensors its files cannot hold, and
pickles that would run code, as torch 2.13 words its refusal.

Every case starts from a real checkpoint (a one-process ``Trainer.fit``, see tests/test_checkpoint_safety.py, or
the generations of ``tests/distributed/hostile_runner.py``), altered or raced as a hostile user, a careless script or
a running training would.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_safety import FIELDS_0_1, Saved, copy, fit, reseal, save_both
from torch import nn

from lightning_osdp import checkpoint as ckpt
from lightning_osdp.cli import main as osdp

from conftest import ROOT, child_env, free_port
from distributed.hostile_runner import generation_model, save_generation
from models import TinyGPT

RUNNER = ROOT / "tests" / "distributed" / "hostile_runner.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return save_both(tmp_path_factory.mktemp("saved"))


def files_of(path: Path) -> dict[str, int]:
    """Name -> CRC-32 of every file of a checkpoint directory: what must not change."""
    return {p.name: zlib.crc32(p.read_bytes()) for p in sorted(path.iterdir())}


# ============================================================================================== consolidate onto itself
def test_consolidating_a_checkpoint_onto_itself_is_refused_and_loses_nothing(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy(saved.sharded, tmp_path / "same.ckpt")
    before = files_of(path)
    (tmp_path / "link.ckpt").symlink_to(path)
    spellings = [str(path), str(path) + "/", str(tmp_path / "." / "same.ckpt"), str(tmp_path / "link.ckpt")]
    for out in [*spellings, str(path / "inside.ckpt")]:
        assert osdp(["consolidate", str(path), out, "--weights-only"]) == 2, out
        err = capsys.readouterr().err
        assert "same.ckpt" in err and "the checkpoint being consolidated" in err, err
        with pytest.raises(ckpt.CheckpointError, match="consolidat"):
            ckpt.consolidate(path, out, optimizer=False)
    # The sharded checkpoint is as it was: every file, and the optimizer state in it.
    assert files_of(path) == before
    assert len(ckpt.load_checkpoint(path)["optimizer_states"]) == 1
    # Through the link, to another name: allowed, and the source is untouched.
    assert osdp(["consolidate", str(tmp_path / "link.ckpt"), str(tmp_path / "out.ckpt")]) == 0
    assert files_of(path) == before


_ALIASED = """
import contextlib, io, json, os, sys
from lightning_osdp.cli import main as osdp
src, outs = sys.argv[1], sys.argv[2:]
results = []
for out in outs:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = osdp(["consolidate", src, out, "--weights-only"])
    results.append({"out": out, "code": code, "err": err.getvalue()})
print(json.dumps(results))
"""


def _bind_mounts_work(tmp_path: Path) -> bool:
    """Whether this machine lets a process bind-mount in a mount namespace of its own (``unshare -rm``)."""
    a, b = tmp_path / "probe_a", tmp_path / "probe_b"
    a.mkdir()
    b.mkdir()
    try:
        proc = subprocess.run(
            ["unshare", "-rm", "mount", "--bind", str(a), str(b)], capture_output=True, text=True, timeout=60
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def test_consolidating_onto_itself_through_a_bind_mount_is_refused_and_loses_nothing(
    saved: Saved, tmp_path: Path
) -> None:
    """``alias/`` a bind mount of the checkpoint's parent (``mount --bind``, in a mount namespace of the command's
    own): ``alias/src.ckpt`` is the same directory (device and inode) under a path no link resolution leads to.
    Before: exit 0, the sharded checkpoint and its optimizer state replaced by a weights-only file."""
    if not _bind_mounts_work(tmp_path):
        pytest.skip("no bind mounts here (unshare -rm mount --bind is refused)")
    parent = tmp_path / "real"
    parent.mkdir()
    path = copy(saved.sharded, parent / "src.ckpt")
    before = files_of(path)
    alias, inner = tmp_path / "alias", tmp_path / "inner"
    alias.mkdir()
    inner.mkdir()
    outs = [alias / "src.ckpt", inner, inner / "inside.ckpt", alias / "src.ckpt" / "inside.ckpt"]
    mounts = f"mount --bind {parent} {alias} && mount --bind {path} {inner}"
    checks = f"stat -L -c '%d %i' {path} {alias / 'src.ckpt'} {inner}"
    command = f'{mounts} && {checks} && exec {sys.executable} -c "$0" "$@"'
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", command, _ALIASED, str(path), *map(str, outs)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(set(lines[:3])) == 1, lines[:3]  # precondition: one directory (device, inode) under three paths
    for result in json.loads(lines[-1]):
        assert result["code"] == 2, result
        assert "the checkpoint being consolidated" in result["err"] and "src.ckpt" in result["err"], result
    assert files_of(path) == before
    assert len(ckpt.load_checkpoint(path)["optimizer_states"]) == 1


def test_consolidating_onto_itself_through_a_linked_parent_or_a_hard_link_is_refused(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A symbolic link to the checkpoint's parent directory (``link/src.ckpt``), and a hard link of a single-file
    checkpoint (one inode, two names, which no path resolution relates): refused, nothing lost."""
    parent = tmp_path / "real"
    parent.mkdir()
    path = copy(saved.sharded, parent / "src.ckpt")
    before = files_of(path)
    (tmp_path / "link").symlink_to(parent)
    for out in (tmp_path / "link" / "src.ckpt", tmp_path / "link" / "src.ckpt" / "inside.ckpt"):
        assert osdp(["consolidate", str(path), str(out), "--weights-only"]) == 2, out
        err = capsys.readouterr().err
        assert "the checkpoint being consolidated" in err, err
    assert files_of(path) == before
    full = copy(saved.full, parent / "full.ckpt")
    os.link(full, tmp_path / "hard.ckpt")
    content = full.read_bytes()
    assert osdp(["consolidate", str(full), str(tmp_path / "hard.ckpt"), "--weights-only"]) == 2
    assert "already consolidated" in capsys.readouterr().err
    assert full.read_bytes() == content and os.path.samefile(full, tmp_path / "hard.ckpt")


# ============================================================================================== symbolic links
OUTSIDE_NAMES = ["__0_0.distcp", "meta.pt", ".metadata", "plan.json"]


def link_out(path: Path, name: str, target: Path) -> None:
    """Replace ``name`` of checkpoint ``path`` by a symbolic link to ``target``, outside the checkpoint."""
    (path / name).unlink()
    (path / name).symlink_to(target)


@pytest.mark.parametrize("name", OUTSIDE_NAMES)
def test_a_file_that_links_out_of_the_checkpoint_is_never_read(
    saved: Saved, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The link points at an exact copy of the file, outside the directory, and the manifest's size and checksum
    match it: everything would load, were links followed."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    target = Path(shutil.copyfile(saved.sharded / name, outside / name))
    path = copy(saved.sharded, tmp_path / "linked.ckpt")
    link_out(path, name, target)
    reseal(path)
    refusal = rf"{name}.*symbolic link"
    with pytest.raises(ckpt.CheckpointError, match=refusal):
        ckpt.load_checkpoint(path)
    with pytest.raises(ckpt.CheckpointError, match=refusal):
        ckpt.read_sharded_tensors(path)
    with pytest.raises(ckpt.CheckpointError, match=refusal):
        fit(TinyGPT(), ckpt_path=path)
    assert osdp(["consolidate", str(path), str(tmp_path / "out.ckpt")]) == 2
    assert "symbolic link" in capsys.readouterr().err and not (tmp_path / "out.ckpt").exists()
    if name in ("plan.json", ".metadata"):  # what `osdp show` and the resume-plan reader read
        with pytest.raises(ckpt.CheckpointError, match=refusal):
            ckpt.saved_plan(path)
        assert osdp(["show", str(path)]) == 2
        assert "symbolic link" in capsys.readouterr().err


def test_a_plan_that_links_to_a_system_file_in_an_old_checkpoint_is_refused_by_name(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan.json -> /etc/passwd``-style, in a checkpoint of lightning_osdp 0.1 (no checksums): the size recorded is
    the target's. Before: read by show, consolidate and fit (fit died in a raw JSONDecodeError)."""
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    path = copy(saved.sharded, tmp_path / "old.ckpt")
    link_out(path, "plan.json", target)
    reseal(path)
    manifest = json.loads((path / "osdp.json").read_text())
    (path / "osdp.json").write_text(json.dumps({k: v for k, v in manifest.items() if k in FIELDS_0_1}))
    for command in (["show", str(path)], ["consolidate", str(path), str(tmp_path / "out.ckpt")]):
        assert osdp(command) == 2, command
        err = capsys.readouterr().err
        assert "plan.json" in err and "symbolic link" in err, err
    with pytest.raises(ckpt.CheckpointError, match=r"plan\.json.*symbolic link"):
        fit(TinyGPT(), ckpt_path=path)


def test_a_checkpoint_path_that_is_itself_a_link_loads(saved: Saved, tmp_path: Path) -> None:
    """``last.ckpt -> epoch=3.ckpt`` (Lightning's ``ModelCheckpoint(save_last="link")``): the path the user names is
    followed; only what is inside the checkpoint must be its own."""
    (tmp_path / "last.ckpt").symlink_to(saved.sharded)
    assert ckpt.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3
    assert ckpt.saved_plan(tmp_path / "last.ckpt") is not None
    (tmp_path / "last-full.ckpt").symlink_to(saved.full)
    assert ckpt.load_checkpoint(tmp_path / "last-full.ckpt")["global_step"] == 3


def test_dcp_reads_every_shard_through_the_open_directory(tmp_path: Path) -> None:
    """DCP's reader opens files through its file system (``FileSystemReader.fs``, not a documented extension point,
    fenced in ``_compat.dcp_reader_file_system``): OSDP's opens each shard by name relative to the open checkpoint
    directory. If a torch release stops reading through it, shards would be opened by path again: this fails."""
    path = tmp_path / "last.ckpt"
    save_generation(path, 1)
    opened: list[str] = []

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, Path)) and "distcp" in os.fsdecode(args[0]):
            opened.append(os.fsdecode(args[0]))

    HOOKS.append(hook)
    try:
        tensors = ckpt.read_sharded_tensors(path)["state_dict"]
    finally:
        HOOKS.remove(hook)
    assert set(tensors) == set(generation_model(0).state_dict())
    assert opened and all(name == "__0_0.distcp" for name in opened), opened


# ============================================================================================== torn reads
def consistent(checkpoint: dict[str, Any], model: nn.Module) -> int:
    """The generation a loaded checkpoint holds; raises if its parts come from different generations."""
    step = checkpoint["global_step"]
    values = {float(v) for p in model.parameters() for v in p.detach().flatten().unique()}
    assert values == {float(step)}, f"a mixed state: metadata of generation {step}, parameters {sorted(values)}"
    return int(step)


def load_generation(path: Path, template: Callable[[], nn.Module]) -> int:
    model = template()
    checkpoint = ckpt.load_checkpoint(path)
    ckpt.load_model_state(model, checkpoint)
    return consistent(checkpoint, model)


def consolidate_generation(path: Path, template: Callable[[], nn.Module]) -> int:
    out = path.with_name("consolidated.ckpt")
    ckpt.consolidate(path, out)
    content = torch.load(out, weights_only=True)
    model = template()
    model.load_state_dict(content["state_dict"])
    assert content["osdp"]["global_step"] == content["global_step"]
    return consistent(content, model)


def tensors_generation(path: Path, template: Callable[[], nn.Module]) -> int:
    tensors = ckpt.read_sharded_tensors(path)["state_dict"]
    assert set(tensors) == set(template().state_dict())
    values = {float(v) for t in tensors.values() for v in t.flatten().unique()}
    assert len(values) == 1, f"a mixed state: tensors of generations {sorted(values)}"
    return int(values.pop())


READERS: dict[str, Callable[[Path, Callable[[], nn.Module]], int]] = {
    "load_checkpoint": load_generation,
    "consolidate": consolidate_generation,
    "read_sharded_tensors": tensors_generation,
}


@contextmanager
def swap_at_open(path: Path, count: int, replace: Callable[[], None]) -> Iterator[list[int]]:
    """Run ``replace()`` (a save of the next generation to ``path``) just before the reader's ``count``-th open of a
    file of the checkpoint (``count`` 0: never; the list yielded gets the number of opens seen). Opens are seen by
    the interpreter's audit hook: whatever way the reader opens files (by path, relative to a directory), the swap
    lands exactly there, deterministically."""
    names = {p.name for p in path.iterdir()} | {path.name}
    state = {"seen": 0, "busy": False, "active": True}
    seen = [0]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or state["busy"] or not state["active"] or not isinstance(args[0], (str, bytes, Path)):
            return
        if os.path.basename(os.fsdecode(args[0]).rstrip("/")) not in names:
            return
        state["seen"] += 1
        seen[0] = state["seen"]
        if state["seen"] == count:
            state["busy"] = True
            try:
                replace()
            finally:
                state["busy"] = False

    HOOKS.append(hook)
    try:
        yield seen
    finally:
        state["active"] = False
        HOOKS.remove(hook)


HOOKS: list[Callable[[str, tuple[Any, ...]], None]] = []
sys.addaudithook(lambda event, args: [hook(event, args) for hook in list(HOOKS)] and None)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_checkpoint_replaced_while_it_is_read_gives_one_whole_generation_or_a_clear_error(
    tmp_path: Path, reader: str
) -> None:
    """A reader of ``last.ckpt`` while a training saves it again: the save lands at each of the reader's file opens
    in turn (a bounded number of rounds). Every round gives one whole generation or says the checkpoint was replaced
    while it was read: never a mix (before: metadata of one generation with tensors of the next, or a false
    'corrupt' verdict)."""
    read = READERS[reader]
    path = tmp_path / "last.ckpt"
    save_generation(path, 1)
    with swap_at_open(path, 0, lambda: None) as seen:
        assert read(path, lambda: generation_model(0)) == 1
    opens = seen[0]
    assert opens >= 3, opens  # the manifest, the index, a shard at least
    outcomes = []
    for count in range(1, opens + 1):
        shutil.rmtree(path)
        save_generation(path, 1)
        with swap_at_open(path, count, lambda: save_generation(path, 2)):
            try:
                outcomes.append(read(path, lambda: generation_model(0)))
            except ckpt.CheckpointError as err:
                assert isinstance(err, ckpt.CheckpointReplacedError), err
                outcomes.append(0)
    # A swap before the first open gives the new generation whole; the others, either one whole or the error.
    assert outcomes[0] == 2 and set(outcomes) <= {0, 1, 2}, outcomes


class _Stopped(Exception):
    """Raised from the audit hook to stop a deletion half-way: what a reader sees while it is in progress."""


def remove_stopped_at(path: Path, event: int) -> int:
    """``layout.remove_checkpoint(path)`` (what ``ModelCheckpoint(save_top_k=...)`` calls, through the strategy, on
    the save it drops), stopped just before its ``event``-th renaming or removal of a file or directory (0: run
    whole). Returns how many such steps it took (or reached)."""
    steps = [0]

    def hook(name: str, args: tuple[Any, ...]) -> None:
        if name in ("os.rename", "os.remove", "os.rmdir", "shutil.rmtree"):
            steps[0] += 1
            if steps[0] == event:
                raise _Stopped

    HOOKS.append(hook)
    try:
        ckpt.layout.remove_checkpoint(path)
    except _Stopped:
        pass
    finally:
        HOOKS.remove(hook)
    return steps[0]


def _rotation(tmp_path: Path) -> tuple[Path, Path]:
    """``last.ckpt -> step=1.ckpt`` as ``ModelCheckpoint(save_last="link")`` makes it, generation 1 saved."""
    for leftover in tmp_path.glob("step=1.ckpt*"):
        shutil.rmtree(leftover)
    saved, last = tmp_path / "step=1.ckpt", tmp_path / "last.ckpt"
    save_generation(saved, 1)
    if not last.is_symlink():
        last.symlink_to(saved.name)
    return saved, last


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_checkpoint_deleted_while_it_is_read_through_a_link_is_called_replaced(tmp_path: Path, reader: str) -> None:
    """``save_last="link"`` with ``save_top_k=1``: ``last.ckpt`` links to the newest save, and the previous one is
    deleted once the next is saved. A reader of ``last.ckpt`` meets the deletion at each of its steps in turn, before
    it opens anything and at each of its file opens: every read gives the whole generation or says the checkpoint was
    replaced while it was read (and is retried). Before: "the save that wrote it did not complete (killed or failed
    mid-save)" or "files were lost after it was written", of a checkpoint that was complete until it was deleted."""
    read = READERS[reader]
    saved, last = _rotation(tmp_path)
    steps = remove_stopped_at(saved, 0)
    assert steps >= 3, steps  # the checkpoint's files and the directory
    saved, last = _rotation(tmp_path)
    with swap_at_open(last, 0, lambda: None) as seen:
        assert read(last, lambda: generation_model(0)) == 1
    opens = seen[0]
    outcomes = []
    for step in range(1, steps + 1):
        for count in range(opens + 1):
            saved, last = _rotation(tmp_path)
            if count == 0:  # before the reader starts
                remove_stopped_at(saved, step)
                deleting: Any = nullcontext()
            else:
                deleting = swap_at_open(last, count, lambda step=step, saved=saved: remove_stopped_at(saved, step))
            with deleting:
                try:
                    outcomes.append(read(last, lambda: generation_model(0)))
                except ckpt.CheckpointError as err:
                    assert isinstance(err, ckpt.CheckpointReplacedError), (step, count, err)
                    outcomes.append(0)
    assert set(outcomes) <= {0, 1} and 0 in outcomes, outcomes


def test_osdp_consolidate_reads_last_ckpt_again_while_its_link_is_moved_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``last.ckpt`` links to a save just deleted, and is linked to the newer one an instant later (Lightning removes
    the old link, then makes the new one): ``osdp consolidate last.ckpt`` reads it again and consolidates the newer
    save. Before: exit 2, "'last.ckpt' does not exist", as if there were none."""
    newer, last = tmp_path / "step=2.ckpt", tmp_path / "last.ckpt"
    save_generation(newer, 2)
    last.symlink_to("step=1.ckpt")  # deleted
    opens = [0]

    def relink(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, Path)) and os.fsdecode(args[0]).endswith("last.ckpt"):
            opens[0] += 1
            if opens[0] == 2:  # the reader's second attempt: the training has linked the newer save meanwhile
                last.unlink()
                last.symlink_to(newer.name)

    HOOKS.append(relink)
    try:
        code = osdp(["consolidate", str(last), str(tmp_path / "out.ckpt")])
    finally:
        HOOKS.remove(relink)
    assert code == 0, capsys.readouterr().err
    assert torch.load(tmp_path / "out.ckpt", weights_only=True)["global_step"] == 2
    # A link that stays dangling is named as such, after the same attempts.
    last.unlink()
    last.symlink_to("step=1.ckpt")
    assert osdp(["consolidate", str(last), str(tmp_path / "out2.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "is a link to 'step=1.ckpt', which does not exist" in err, err


def test_a_reader_racing_a_writer_never_gets_a_mixed_state(tmp_path: Path) -> None:
    """The race itself, with no hook: a writer process saves ``last.ckpt`` over and over while this process reads it
    40 times (bounded). Each read is one whole generation or a clear error; which ones, depends on timing."""
    path = tmp_path / "last.ckpt"
    save_generation(path, 1, width=256, layers=8)
    writer = subprocess.Popen(
        [sys.executable, str(RUNNER), str(tmp_path), "save-generations", str(path), "400"],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    seen: list[int] = []
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().startswith("saved 2")
        for i in range(40):
            read = READERS[sorted(READERS)[i % len(READERS)]]
            try:
                seen.append(read(path, lambda: generation_model(0, width=256, layers=8)))
            except ckpt.CheckpointError as err:
                assert isinstance(err, ckpt.CheckpointReplacedError), err
                seen.append(0)
    finally:
        writer.kill()
        writer.wait()
    assert len(seen) == 40, seen


# ============================================================================================== a full disk
def _can_mount_tmpfs(where: Path) -> str | None:
    """``None`` when this process may mount a tmpfs in a user and mount namespace of its own (``unshare -rm``: no
    root needed where user namespaces are enabled), else why not."""
    if shutil.which("unshare") is None:
        return "no `unshare` command"
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip() or probe.returncode}"
    return None


@pytest.mark.distributed
def test_a_save_onto_a_full_disk_leaves_nothing_behind_and_names_the_checkpoint(tmp_path: Path) -> None:
    """Two ranks save into a 3 MiB file system (a tmpfs mounted in a namespace of the test's own): a checkpoint that
    fits, then one that does not (sharded), a full file that does not, and a consolidation into the filled disk.
    Each failure names the checkpoint and the disk, removes its partial save, and leaves the previous checkpoint
    intact (before: a 1.3 MiB temporary directory left behind, and ``CheckpointException ranks:dict_keys([0, 1])``).
    """
    disk = tmp_path / "disk"
    disk.mkdir()
    reason = _can_mount_tmpfs(disk)
    if reason is not None:
        pytest.skip(reason)
    script = (
        f"mount -t tmpfs -o size=3m tmpfs {disk} && exec {sys.executable} -m torch.distributed.run "
        f"--nproc-per-node=2 --master-addr=127.0.0.1 --master-port={free_port()} {RUNNER} {tmp_path} full-disk {disk}"
    )
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"full-disk.rank{rank}.json").read_text())
        for case, name in (("sharded", "last.ckpt"), ("full", "full.ckpt")):
            outcome = report[case]
            assert outcome["error"] == "CheckpointError", (case, outcome)
            assert str(disk / name) in outcome["message"] and "no space left on device" in outcome["message"]
            assert "removed" in outcome["message"], outcome["message"]
        # Nothing left behind but the previous checkpoint, which is whole.
        assert report["after_sharded"] == ["last.ckpt"], report
        assert report["after_full"] == ["last.ckpt"], report
        assert report["previous_step"] == 1
    report = json.loads((tmp_path / "full-disk.rank0.json").read_text())
    assert report["consolidate"]["error"] == "CheckpointError", report["consolidate"]
    assert str(disk / "small-full.ckpt") in report["consolidate"]["message"]
    assert report["after_consolidate"] == ["filler", "last.ckpt"], report


# ============================================================================================== an index out of bounds
def test_an_index_declaring_a_tensor_larger_than_its_files_is_refused_before_allocating(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crafted ``.metadata`` says ``h.0.fc.weight`` is 10^7 x 10^6 floats (40 TB): consolidating it tried to
    allocate that and died in the allocator. The shapes are checked against the bytes the files hold first."""
    path = copy(saved.sharded, tmp_path / "huge.ckpt")
    index = pickle.loads((path / ".metadata").read_bytes())
    index.state_dict_metadata["state_dict.h.0.fc.weight"].size = torch.Size([10**7, 10**6])
    (path / ".metadata").write_bytes(pickle.dumps(index))
    reseal(path)
    assert osdp(["consolidate", str(path), str(tmp_path / "out.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "h.0.fc.weight" in err and "(10000000, 1000000)" in err, err
    for read in (ckpt.load_checkpoint, ckpt.read_sharded_tensors, ckpt.saved_plan):
        with pytest.raises(ckpt.CheckpointError, match=r"h\.0\.fc\.weight.*\(10000000, 1000000\)"):
            read(path)


# ============================================================================================== os.system in a pickle
class System:
    """Unpickling it runs a shell command: ``os.system``, which torch 2.13 refuses as 'GLOBAL posix.system whose module
    posix is blocked' (not 'was not an allowed global')."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_calls_os_system_is_refused_as_made_to_run_code(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    full = tmp_path / "system-full.ckpt"
    content = torch.load(saved.full, weights_only=False)
    content["hyper_parameters"]["note"] = System(marker)
    torch.save(content, full)
    meta = copy(saved.sharded, tmp_path / "system-meta.ckpt")
    content = torch.load(meta / "meta.pt", weights_only=False)
    content["hyper_parameters"]["note"] = System(marker)
    torch.save(content, meta / "meta.pt")
    reseal(meta)
    items = tmp_path / "system-items.ckpt"
    model = nn.Linear(4, 3)
    optimizer_state = {"state": {}, "param_groups": [{"lr": System(marker), "params": ["weight", "bias"]}]}
    ckpt.save_checkpoint(
        {"state_dict": ckpt.sharded_model_state(model), "optimizer_states": [optimizer_state]},
        items,
        module=model,
        context=ckpt.CheckpointContext(world_size=1),
    )
    crafted = r"(posix|os)\.system.*made to run code when it is loaded\. Do not load it"
    for path in (full, meta):
        with pytest.raises(ckpt.UntrustedContentError, match=crafted) as info:
            ckpt.load_checkpoint(path)
        assert "add_safe_globals" not in str(info.value) and "weights_only=False" not in str(info.value)
        with pytest.raises(ckpt.UntrustedContentError, match=crafted):
            fit(TinyGPT(), ckpt_path=path)
    assert osdp(["consolidate", str(items), str(tmp_path / "out.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "optimizer_0" in err and "made to run code" in err and "--allow-pickle" not in err, err
    assert not marker.exists()


def test_a_damaged_pickle_is_not_called_a_refusal(saved: Saved, tmp_path: Path) -> None:
    """Not every unpickling error is torch refusing an object: a pickle cut short (its record's CRC rewritten to
    match, as a buggy writer would leave it) is damaged, and said so, with no advice to trust it."""
    path = copy(saved.sharded, tmp_path / "cut.ckpt")
    meta = path / "meta.pt"
    with zipfile.ZipFile(meta) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(meta, "w") as archive:
        for info, data in records:
            archive.writestr(info, data[: len(data) // 2] if info.filename.endswith("/data.pkl") else data)
    reseal(path)
    with pytest.raises(ckpt.CheckpointError, match=r"meta\.pt") as info:
        ckpt.load_checkpoint(path)
    assert not isinstance(info.value, ckpt.UntrustedContentError), info.value
    assert "add_safe_globals" not in str(info.value)
