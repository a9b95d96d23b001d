"""The representative batch of a dry run, at any per-device batch size.

A batch is given as

* a shape spec, ``DTYPE:DIMxDIM...`` with one entry per tensor (``int64:8x1025``; ``float32:32x3x224x224,int64:32``
  is a tuple of two), whose first dimension is the per-device batch size (``--batch-size`` replaces it);
* a function, ``module:function`` or ``file.py:function``, called as ``function(batch_size)`` and returning the
  batch the model's ``training_step`` takes;
* nothing: the model's ``example_input_array`` (``forward``'s input, resized along its first dimension; the
  step is then ``forward`` and the loss the output's sum, as when the strategy profiles with it), else, for a
  model whose hyper-parameters have a ``context_length``, windows of ``context_length + 1`` token ids (the
  language-model convention of ``examples/gpt``: input and next-token targets are one window shifted by one).

Tensors are made on the meta device: the profile runs on fake tensors, so neither their values nor their memory
matter, and a batch of any size costs nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_osdp._compat import tree_leaves, tree_map
from lightning_osdp.cli.errors import CLIError
from lightning_osdp.cli.model import import_object

__all__ = ["BatchSource", "batch_source", "parse_shape_spec"]


@dataclass(frozen=True)
class BatchSource:
    """How to make the batch at any per-device batch size.

    Attributes:
        make: ``batch_size -> batch``.
        step: ``profile(step=...)``: ``"training_step"`` or ``"forward"`` (see ``lightning_osdp.profiling.step``).
        description: where the batch comes from, for the report.
        default_size: the batch size the spec itself gives, if any.
        tokens_per_sample: the tokens a sample trains on, where the batch says (the token windows': their
            ``context_length``, one less than the window, whose last id is only a target); ``None``: unknown.
    """

    make: Callable[[int], Any]
    step: str
    description: str
    default_size: int | None = None
    tokens_per_sample: int | None = None


def parse_shape_spec(spec: str) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """``[(dtype, shape), ...]`` of a ``DTYPE:DIMxDIM[,DTYPE:DIMx...]`` spec."""
    entries = []
    for part in spec.split(","):
        dtype_name, sep, dims = part.strip().partition(":")
        dtype = getattr(torch, dtype_name.strip(), None)
        if not sep or not isinstance(dtype, torch.dtype):
            raise CLIError(f"cannot read batch spec {part!r}: expected DTYPE:DIMxDIM..., such as int64:8x1025")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise CLIError(
                f"cannot read the shape in batch spec {part!r}: expected DIMxDIM..., such as 8x1025"
            ) from None
        if not shape or any(d < 1 for d in shape):
            raise CLIError(f"batch spec {part!r}: every dimension must be a positive integer")
        entries.append((dtype, shape))
    return entries


def _resized(value: Any, batch_size: int) -> Any:
    def one(t: Any) -> Any:
        if isinstance(t, Tensor) and t.dim() > 0:
            return torch.zeros((batch_size, *t.shape[1:]), dtype=t.dtype, device="meta")
        return t

    return tree_map(one, value)


def _leading(value: Any) -> int | None:
    for t in tree_leaves(value):
        if isinstance(t, Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def batch_source(spec: str | None, model: nn.Module) -> BatchSource:
    """The :class:`BatchSource` for ``--batch`` (``None``: from the model, see the module docstring)."""
    if spec and ":" in spec and not isinstance(getattr(torch, spec.split(":", 1)[0].strip(), None), torch.dtype):
        fn = import_object(spec)
        if not callable(fn):
            raise CLIError(f"--batch {spec}: {fn!r} is not callable")
        try:
            inspect.signature(fn).bind(1)
        except (TypeError, ValueError):
            raise CLIError(
                f"--batch {spec}: the function must take the per-device batch size as its argument"
            ) from None
        return BatchSource(fn, "training_step", f"{spec}(batch_size)")
    if spec:
        entries = parse_shape_spec(spec)

        def make(batch_size: int) -> Any:
            tensors = [torch.zeros((batch_size, *shape[1:]), dtype=dtype, device="meta") for dtype, shape in entries]
            return tensors[0] if len(tensors) == 1 else tuple(tensors)

        return BatchSource(make, "training_step", f"--batch {spec}", entries[0][1][0])
    example = getattr(model, "example_input_array", None)
    if example is not None:
        size = _leading(example)
        if size is None:
            raise CLIError(f"{type(model).__name__}.example_input_array has no batch dimension; pass --batch")
        return BatchSource(
            lambda b: _resized(example, b), "forward", "example_input_array (forward's input; loss = output sum)", size
        )
    hparams = getattr(model, "hparams", None) or {}
    context = hparams.get("context_length") if hasattr(hparams, "get") else None
    if isinstance(context, int) and context > 0:
        return BatchSource(
            lambda b: torch.zeros((b, context + 1), dtype=torch.int64, device="meta"),
            "training_step",
            f"windows of context_length + 1 = {context + 1} token ids (inputs and next-token targets: {context:,} "
            "tokens trained per sample), from the model's hyper-parameters",
            tokens_per_sample=context,
        )
    raise CLIError(
        f"cannot tell what a batch of {type(model).__name__} looks like: pass --batch DTYPE:SHAPE (e.g. "
        "int64:8x1025) or --batch module:function (called with the batch size), or give the model an "
        "example_input_array"
    )
