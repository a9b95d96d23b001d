"""Turn a sharded checkpoint into one plain Lightning ``.ckpt`` file.

Function :func:`consolidate` (exported as ``lightning_osdp.checkpoint.consolidate``); command ``osdp consolidate SRC
OUT [--weights-only] [--allow-pickle]``, also run as ``python -m lightning_osdp.checkpoint.consolidate SRC OUT``
(:func:`main`).

The output is what ``state_dict_type="full"`` would have saved: ``MyModule.load_from_checkpoint(OUT)`` loads it with
no OSDP and no process group, Lightning's DDP resumes from it, and so does OSDP under any plan. It needs no
process group and no GPU, but holds the whole model and optimizer state in memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lightning_osdp.checkpoint import layout
from lightning_osdp.checkpoint.errors import CheckpointError
from lightning_osdp.checkpoint.files import CheckpointDirectory, dangling_link_error, read_retrying
from lightning_osdp.checkpoint.keys import optimizer_state_to_native
from lightning_osdp.checkpoint.sharded import MODEL_KEY, read_sharded_tensors
from lightning_osdp.checkpoint.unpickle import load_torch_file

__all__ = ["consolidate", "main"]


def consolidate(
    src: str | os.PathLike[str], out: str | os.PathLike[str], *, optimizer: bool = True, weights_only: bool = True
) -> Path:
    """Write the sharded checkpoint directory ``src`` as one Lightning checkpoint file ``out`` (atomically).

    Every file of ``src`` is checked against its checksum, read relative to the directory opened once (a checkpoint
    replaced while it is read, ``last.ckpt`` of a running training, is read again: see ``files``), and nothing in it
    runs code unless ``weights_only=False``.

    Args:
        src: a sharded checkpoint directory (refused if its save did not complete, or a file changed since).
        out: the file to write: a path where nothing is, or a checkpoint to replace (anything else is refused), but
            never ``src`` itself or a path inside it, however spelled (a link, ``./``, a trailing ``/``, a bind mount:
            compared by device and inode).
        optimizer: keep the optimizer states (``False``: a weights-only file, smaller, enough for inference and
            ``load_from_checkpoint``).
        weights_only: create only plain data and tensors from the checkpoint's pickles; ``False`` trusts it (needed
            when its hyper-parameters are objects of the user's own classes).

    Returns:
        ``out`` as a :class:`~pathlib.Path`.

    Raises:
        CheckpointError: ``src`` cannot be read, ``out`` is ``src`` or inside it, or ``out`` cannot be written (the
            message names it; a partial file is removed).
    """
    src, out = Path(src), Path(out)
    # A link to nothing (`last.ckpt` between two saves of a running training) is read again below, not refused here.
    if not src.is_dir() and dangling_link_error(src) is None:
        raise CheckpointError(
            f"{str(src)!r} is not a sharded checkpoint directory"
            + (" (it is a file: already consolidated)" if src.is_file() else "")
        )
    _check_not_onto_source(src, out)
    layout.check_replaceable(out)
    checkpoint = read_retrying(lambda: _read(src, optimizer=optimizer, weights_only=weights_only))
    tmp = layout.temporary_path(out, layout.new_token())
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.save(checkpoint, tmp)
        layout.commit(tmp, out)
    except Exception as err:
        full = layout.no_room(err, out.parent)
        layout.discard(tmp)
        raise layout.save_error(out, err, full=full) from err
    return out


def _check_not_onto_source(src: Path, out: Path) -> None:
    """Refuse an ``out`` that is the checkpoint being consolidated, or inside it: the commit would replace the sharded
    checkpoint (its optimizer state with it) by the file, or write into the directory being read.

    Paths are compared resolved (links, ``..``, ``./``), and what exists of them as files: ``out`` or a directory
    above it with ``src``'s device and inode is ``src`` under another name, which no path resolution can see (a bind
    mount of a parent directory, a second mount of the file system)."""
    source, target = src.resolve(), out.resolve()
    identity = _file_id(source)
    where = None
    if target == source or (identity is not None and _file_id(target) == identity):
        where = "is"
    elif source in target.parents or (identity is not None and any(_file_id(p) == identity for p in target.parents)):
        where = "is inside"
    if where is None:
        return
    alias = "" if target == source or source in target.parents else " (the same directory under another path)"
    raise CheckpointError(
        f"refusing to consolidate {str(src)!r} into {str(out)!r}: that path {where} the checkpoint being "
        f"consolidated{alias}, and writing it would replace the sharded checkpoint (and its optimizer state) with "
        "the file. Give another output path, such as "
        f"{str(src.with_name(src.name.removesuffix('.ckpt') + '-full.ckpt'))!r}"
    )


def _file_id(path: Path) -> tuple[int, int] | None:
    """``path``'s device and inode (after links), or ``None`` where nothing can be found there."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def _read(src: Path, *, optimizer: bool, weights_only: bool) -> dict[str, Any]:
    """The consolidated checkpoint dict of ``src``, every part read from the one save the directory held."""
    with CheckpointDirectory(src) as directory:
        manifest = layout.read_manifest(directory)
        meta = directory.read(
            layout.META, size=manifest.files.get(layout.META), checksum=manifest.checksums.get(layout.META)
        )
        checkpoint = load_torch_file(meta, weights_only=weights_only, what=layout.META, source=src)
        if not isinstance(checkpoint, dict):
            raise CheckpointError(f"{layout.META} of checkpoint {str(src)!r} does not hold Lightning's checkpoint dict")
        keys = [MODEL_KEY] + ([f"optimizer_{i}" for i in range(manifest.optimizers)] if optimizer else [])
        tensors = read_sharded_tensors(directory, keys, weights_only=weights_only)
        plan, profile = (_json(directory, manifest, name) for name in (manifest.plan, manifest.profile))
    checkpoint["state_dict"] = tensors.get(MODEL_KEY, {})
    if optimizer and manifest.optimizers:
        checkpoint["optimizer_states"] = [_tuples(optimizer_state_to_native(tensors[k])) for k in keys[1:]]
    entry = manifest.to_dict()
    entry.update(state_dict_type="full", files={}, checksums={}, consolidated_from=str(src), plan=plan, profile=profile)
    checkpoint["osdp"] = entry
    return checkpoint


def _json(directory: CheckpointDirectory, manifest: layout.Manifest, name: str | None) -> Any:
    if name is None:
        return None
    return directory.json(name, size=manifest.files.get(name), checksum=manifest.checksums.get(name))


def _tuples(osd: dict[str, Any]) -> dict[str, Any]:
    # DCP gives sequences of hyper-parameters back as lists; PyTorch's optimizers hold them as tuples (`betas`).
    groups = [
        {k: tuple(v) if k != "params" and isinstance(v, list) else v for k, v in group.items()}
        for group in osd["param_groups"]
    ]
    return {**osd, "param_groups": groups}


if __name__ == "__main__":  # `python -m lightning_osdp.checkpoint.consolidate SRC OUT`: the CLI's verb
    from lightning_osdp.cli.consolidate import main

    raise SystemExit(main())
