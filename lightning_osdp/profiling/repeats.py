"""Deep models estimated from their first blocks: a trace of 1 and of 2 blocks stands for all ``N``.

[Note: depth by extrapolation]
An estimated profile (a dry run: ``osdp plan``) traces the whole step on fake tensors, operator by operator; a Llama
of 126 blocks costs 126 times the Python work of one block, twice (two batch sizes), and that was most of a 405B dry
run's minutes. The blocks of such a model are identical (one class, the same parameter names, shapes and dtypes,
none shared), and the figures of the step are those of its first blocks repeated: so the estimated mode traces the
model with its block list cut to one block and to two, and writes the profile of all ``N``:

* block 0 is block 0 of the two-block trace; blocks ``1 .. N-1`` are block 1 of it (the first block's input comes
  from the embedding, every later one's from a block);
* every other figure (the root's, the head's, the loss's, the optimizer step's, what runs outside any module) is the
  two-block trace's plus ``N - 2`` times the difference between the two traces: exact for what does not depend on the
  depth (the difference is zero), and for what grows by the same amount per block (a residual add the parent's
  ``forward`` makes around each block);
* the forward order repeats block 1's entries ``N - 1`` times.

It applies to a model with one such list of at least four blocks whose ``forward`` runs with the list cut
(``for block in self.blocks``); a forward that indexes blocks by a count of its own fails on the cut list, and the
model is then traced whole. Measured and blocks profiles are never cut (they run the real step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_osdp.profiling.model_profile import ModelProfile, ModuleProfile

__all__ = ["RepeatedBlocks", "expand_profile", "find_repeated_blocks", "traced_by_depth"]

#: The fewest identical blocks a list must have for its depth to be extrapolated.
MIN_BLOCKS = 4


@dataclass(frozen=True)
class RepeatedBlocks:
    """A ``ModuleList``/``Sequential`` at ``name`` of ``count`` identical blocks."""

    name: str
    count: int

    def block(self, index: int) -> str:
        return f"{self.name}.{index}" if self.name else str(index)

    def cut(self, module: nn.Module, keep: int) -> None:
        """Cut the list of ``module`` (a copy of the model) to its first ``keep`` blocks, in place."""
        blocks = module.get_submodule(self.name)
        kept = list(blocks.children())[:keep]
        shortened = type(blocks)(*kept) if isinstance(blocks, nn.Sequential) else nn.ModuleList(kept)
        parent_name, _, attr = self.name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, shortened)


def _signature(block: nn.Module) -> tuple[Any, ...]:
    return (
        type(block),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
    )


def find_repeated_blocks(module: nn.Module) -> RepeatedBlocks | None:
    """The model's one list of identical blocks (see [Note: depth by extrapolation]), or ``None``."""
    found = []
    for name, sub in module.named_modules():
        if not isinstance(sub, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(sub.children())
        if len(children) < MIN_BLOCKS or not any(True for _ in children[0].parameters()):
            continue
        if len({_signature(c) for c in children}) != 1:
            continue
        params = [id(p) for c in children for p in c.parameters()]
        if len(params) != len(set(params)):
            continue  # blocks sharing weights
        found.append(RepeatedBlocks(name, len(children)))
    outermost = [r for r in found if not any(r.name.startswith(o.name + ".") for o in found if o is not r)]
    return outermost[0] if len(outermost) == 1 else None


def _rename(name: str, blocks: RepeatedBlocks, index: int) -> str:
    """``name`` of a module of block 1 (or the list itself), spelled for block ``index``."""
    one = blocks.block(1)
    if name == one or name.startswith(one + "."):
        return blocks.block(index) + name[len(one) :]
    return name


def _extrapolated(one: Any, two: Any, more: int) -> Any:
    if isinstance(two, bool) or not isinstance(two, (int, float)) or not isinstance(one, (int, float)):
        return two
    value = two + more * (two - one)
    return type(two)(value) if isinstance(two, int) else value


# Fields of a module that are not figures to extrapolate.
_NOT_NUMBERS = frozenset({"name", "type", "parent", "children", "caller"})


def _numbers(a: Any, b: Any, more: int, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    return {
        f.name: _extrapolated(getattr(a, f.name), getattr(b, f.name), more)
        for f in dataclasses.fields(b)
        if f.name not in skip
    }


def expand_profile(one: ModelProfile, two: ModelProfile, blocks: RepeatedBlocks) -> ModelProfile:
    """The profile of the model with all ``blocks.count`` blocks, from its traces with 1 and 2 (see [Note: depth by
    extrapolation])."""
    n, more = blocks.count, blocks.count - 2
    modules: dict[str, ModuleProfile] = {}
    first, second = blocks.block(0), blocks.block(1)
    for name, profile in two.modules.items():
        if name == second or name.startswith(second + "."):
            for index in range(1, n):
                copy = dataclasses.replace(
                    profile,
                    name=_rename(name, blocks, index),
                    parent=_rename(profile.parent, blocks, index) if profile.parent is not None else None,
                    children=[_rename(c, blocks, index) for c in profile.children],
                    caller=_rename(profile.caller, blocks, index) if profile.caller is not None else None,
                )
                modules[copy.name] = copy
        elif name == blocks.name:
            modules[name] = dataclasses.replace(profile, children=[blocks.block(i) for i in range(n)])
        elif name == first or name.startswith(first + "."):
            modules[name] = profile
        else:
            modules[name] = dataclasses.replace(
                profile,
                **_numbers(one.modules[name], profile, more, _NOT_NUMBERS),
            )

    def in_second(name: str) -> bool:
        return name == second or name.startswith(second + ".")

    block_one = [m for m in two.forward_order if in_second(m)]
    order: list[str] = []
    for name in two.forward_order:
        if not in_second(name):
            order.append(name)
        elif name == block_one[0]:
            order.extend(_rename(m, blocks, i) for i in range(1, n) for m in block_one)
    scalars = ("extra_activation_bytes", "step_overhead_seconds", "optimizer_step_seconds")
    result = dataclasses.replace(
        two,
        modules=modules,
        forward_order=order,
        info={**two.info, "depth": f"{blocks.name}: {n} blocks extrapolated from traces of 1 and 2"},
        **{s: _extrapolated(getattr(one, s), getattr(two, s), more) for s in scalars},
    )
    trainable = sum(m.grad_bytes for m in modules.values())
    result.optim_state_factor = sum(m.optim_state_bytes for m in modules.values()) / trainable if trainable else 0.0
    return result


def traced_by_depth(trace: Callable[[int | None], ModelProfile], blocks: RepeatedBlocks | None) -> ModelProfile:
    """``trace(keep)`` profiles the model with its block list cut to ``keep`` blocks (``None``: whole); the whole
    model's profile from the cut traces when the model allows it (see the Note), else traced whole."""
    if blocks is None:
        return trace(None)
    try:
        one, two = trace(1), trace(2)
    except Exception:  # a forward that does not run on the cut list: traced whole
        return trace(None)
    return expand_profile(one, two, blocks)
