"""Turn a sharded checkpoint into one plain Lightning ``.ckpt`` file.

Function :func:`consolidate` (exported as ``lightning_osdp.checkpoint.consolidate``); command ``osdp consolidate SRC
OUT``, also run as ``python -m lightning_osdp.checkpoint.consolidate SRC OUT`` (:func:`main`).

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
from lightning_osdp.checkpoint.keys import optimizer_state_to_native
from lightning_osdp.checkpoint.sharded import MODEL_KEY, read_sharded_tensors

__all__ = ["consolidate", "main"]


def consolidate(src: str | os.PathLike[str], out: str | os.PathLike[str], *, optimizer: bool = True) -> Path:
    """Write the sharded checkpoint directory ``src`` as one Lightning checkpoint file ``out`` (atomically).

    Args:
        src: a sharded checkpoint directory (refused if its save did not complete).
        out: the file to write.
        optimizer: keep the optimizer states (``False``: a weights-only file, smaller, enough for inference and
            ``load_from_checkpoint``).

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
    keys = [MODEL_KEY] + ([f"optimizer_{i}" for i in range(manifest.optimizers)] if optimizer else [])
    tensors = read_sharded_tensors(src, keys)
    checkpoint: dict[str, Any] = torch.load(src / layout.META, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = tensors.get(MODEL_KEY, {})
    if optimizer and manifest.optimizers:
        checkpoint["optimizer_states"] = [_tuples(optimizer_state_to_native(tensors[k])) for k in keys[1:]]
    entry = manifest.to_dict()
    entry.update(
        state_dict_type="full",
        files={},
        consolidated_from=str(src),
        plan=json.loads((src / manifest.plan).read_text()) if manifest.plan else None,
        profile=json.loads((src / manifest.profile).read_text()) if manifest.profile else None,
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
