"""Turn a sharded checkpoint into one plain Lightning ``.ckpt`` file.

Function :func:`consolidate` (exported as ``lightning_osdp.checkpoint.consolidate``); command ``osdp consolidate SRC
OUT [--weights-only] [--allow-pickle]``, also run as ``python -m lightning_osdp.checkpoint.consolidate SRC OUT``
(:func:`main`).

The output is what ``state_dict_type="full"`` would have saved: ``MyModule.load_from_checkpoint(OUT)`` loads it with
no OSDP and no process group, Lightning's DDP resumes from it, and so does OSDP under any plan. It needs no
process group and no GPU, but holds the whole model and optimizer state in memory.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_osdp.checkpoint import layout
from lightning_osdp.checkpoint.errors import CheckpointError
from lightning_osdp.checkpoint.integrity import verify_checksums
from lightning_osdp.checkpoint.keys import optimizer_state_to_native
from lightning_osdp.checkpoint.sharded import MODEL_KEY, read_sharded_tensors
from lightning_osdp.checkpoint.unpickle import load_torch_file

__all__ = ["consolidate", "main"]


def consolidate(
    src: str | os.PathLike[str], out: str | os.PathLike[str], *, optimizer: bool = True, weights_only: bool = True
) -> Path:
    """Write the sharded checkpoint directory ``src`` as one Lightning checkpoint file ``out`` (atomically).

    Every file of ``src`` is checked against its checksum first, and nothing in it runs code unless
    ``weights_only=False``.

    Args:
        src: a sharded checkpoint directory (refused if its save did not complete, or a file changed since).
        out: the file to write: a path where nothing is, or a checkpoint to replace (anything else is refused).
        optimizer: keep the optimizer states (``False``: a weights-only file, smaller, enough for inference and
            ``load_from_checkpoint``).
        weights_only: create only plain data and tensors from the checkpoint's pickles; ``False`` trusts it (needed
            when its hyper-parameters are objects of the user's own classes).

    Returns:
        ``out`` as a :class:`~pathlib.Path`.
    """
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise CheckpointError(
            f"{str(src)!r} is not a sharded checkpoint directory"
            + (" (it is a file: already consolidated)" if src.is_file() else "")
        )
    layout.check_replaceable(out)
    manifest = layout.read_manifest(src)
    verify_checksums(src, manifest)
    checkpoint = load_torch_file(src / layout.META, weights_only=weights_only, what=layout.META, source=src)
    keys = [MODEL_KEY] + ([f"optimizer_{i}" for i in range(manifest.optimizers)] if optimizer else [])
    tensors = read_sharded_tensors(src, keys, weights_only=weights_only, verify=False)
    checkpoint["state_dict"] = tensors.get(MODEL_KEY, {})
    if optimizer and manifest.optimizers:
        checkpoint["optimizer_states"] = [_tuples(optimizer_state_to_native(tensors[k])) for k in keys[1:]]
    entry = manifest.to_dict()
    entry.update(
        state_dict_type="full",
        files={},
        checksums={},
        consolidated_from=str(src),
        plan=_json(src, manifest.plan),
        profile=_json(src, manifest.profile),
    )
    checkpoint["osdp"] = entry
    tmp = layout.temporary_path(out, layout.new_token())
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.save(checkpoint, tmp)
        layout.commit(tmp, out)
    finally:
        layout.remove_checkpoint(tmp)
    return out


def _json(directory: Path, name: str | None) -> Any:
    if name is None:
        return None
    try:
        return json.loads((directory / name).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"checkpoint {str(directory)!r}: unreadable {name} ({err})") from None


def _tuples(osd: dict[str, Any]) -> dict[str, Any]:
    # DCP gives sequences of hyper-parameters back as lists; PyTorch's optimizers hold them as tuples (`betas`).
    groups = [
        {k: tuple(v) if k != "params" and isinstance(v, list) else v for k, v in group.items()}
        for group in osd["param_groups"]
    ]
    return {**osd, "param_groups": groups}


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``osdp consolidate`` with ``argv`` (default ``sys.argv[1:]``); returns its exit
    status (2 when the checkpoint is refused, with the reason on stderr)."""
    from lightning_osdp.cli import main as osdp

    return osdp(["consolidate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
