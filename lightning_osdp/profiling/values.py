"""Stand-in values for a step traced on fake tensors: what lets the user's ``training_step`` run there as written.

[Note: value reads on fake tensors]
A fake tensor has shapes and no values, and user steps read values: ``self.losses.append(loss.item())``,
``print(f"{loss:.3f}")``, ``if loss.isnan(): return None``, ``float(self.all_gather(loss).mean())``; a mixture of
experts routes with ``nonzero``/boolean masks, whose output *shape* depends on values. Plain ``FakeTensorMode`` turns
the first kind into an unbacked symbol that fails at the first guard (``GuardOnDataDependentSymNode``) and the second
into unbacked sizes that the memory accounting cannot add up. Three mechanisms were weighed:

* torch's ``fake_tensor_propagate_real_tensors`` runs real tensors beside the fakes: it needs real weights and the
  real memory, which is what a trace on fake tensors exists to avoid (a model on meta, a model too large to copy);
* unbacked symbols with size hints (``ShapeEnv``): still fail at ``bool()``/``float()`` of a value, which is most of
  what user steps do, and give no number to a Python ``print``;
* answering each read with a stand-in, here: :class:`StandInValues` is a dispatch mode over the fake mode that
  answers ``aten._local_scalar_dense`` (``.item()``, ``float``, ``int``, ``bool``, ``if``, ``.tolist()``),
  ``torch.equal`` and ``torch.allclose`` (equal when the shapes are) with a neutral value (numbers read as ``1``, so
  that a logarithm or a division by a count runs; a NaN or infinity check reads as "none found" and a finiteness check
  as "all finite", through negations and ``any``/``all``; any other boolean as ``False``), and gives every operator
  whose output *size* depends on values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``) its largest
  possible size (every element selected). :class:`StandInMethods` does the same for the ``Tensor`` methods that never
  reach the dispatcher on a fake tensor (``numpy()``, ``__format__``) and watches the guards' checks. (Not a value
  read, but a fake tensor's failure all the same: an operator whose meta kernel is stricter than the CPU's, see
  ``_BF16_META``.)

What a stand-in costs: the trace follows the branch the stand-in selects (the common, "nothing wrong" branch of a
guard), and a data-dependent size is counted at its upper bound, so bytes and FLOPs of such operators are over-, never
under-estimated (a budget planned on them holds; a mixture of experts whose routing sends each token to k of E experts
is charged as if every expert saw every token). A model that is materialized and whose step fits is then measured on
its real values (``profiler.py`` [Note: measured and estimated]): there the stand-ins only decide that it fits. Each
call site that read a value is reported in ``ModelProfile.info["value_reads"]`` (``file:line`` of the user's code and
how often), so a profile says where it answered for the user.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_osdp._compat import TorchDispatchMode, is_fake

__all__ = ["StandInMethods", "StandInValues"]

aten = torch.ops.aten

# Frames inside these packages are not the user's code: a value read is reported at the first frame outside them.
_LIBRARY_PARTS = (f"{__package__.split('.')[0]}/", "/torch/", "/lightning/", "/torchmetrics/", "/lightning_utilities/")


def _call_site() -> str:
    """``file:line`` of the innermost frame of the user's code; a read made by the profiler's own calls (an optimizer's
    step count, backward) is reported as such."""
    deeper = ""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename == __file__:  # the stand-ins' own frames
            continue
        path = frame.filename.replace("\\", "/")
        if not any(part in path for part in _LIBRARY_PARTS) and not path.startswith("<"):
            if _LIBRARY_PARTS[0] in deeper:  # the user's code calling the profiler: not the step
                return "<outside the step: backward or optimizer>"
            return f"{frame.filename}:{frame.lineno}"
        deeper = path
    return "<outside the step: backward or optimizer>"


def _stand_in(dtype: torch.dtype) -> int | float:
    # One, not zero: `math.log(loss.item())` and `total / int(mask.sum())` are what user steps do with a value.
    if dtype.is_floating_point or dtype.is_complex:
        return 1.0
    return 1


# Where a boolean tensor's value is known without values: the checks of a guard. A NaN or infinity check reads as
# "none found" (every element False); a finiteness check as "all finite"; negations and reductions carry the verdict.
# Seen as torch functions: several of them are composite and never reach the dispatcher as themselves.
def _functions(*names: str) -> frozenset[Any]:
    return frozenset(f for name in names for f in (getattr(torch, name, None), getattr(Tensor, name, None)) if f)


_ALL_FALSE = _functions("isnan", "isinf", "isposinf", "isneginf")
_ALL_TRUE = _functions("isfinite")
_NEGATE = _functions("logical_not", "bitwise_not", "__invert__")
_KEEP = _functions("any", "all", "clone", "detach", "to", "cpu", "squeeze", "reshape", "view", "flatten")


def _full_indices(mask: Tensor) -> list[Tensor]:
    # The long indices of a boolean mask with every element selected: the largest result it can give.
    return [torch.zeros(mask.numel(), dtype=torch.long, device=mask.device) for _ in range(mask.dim())]


# Operators whose meta kernel (what a fake tensor runs) accepts bfloat16 alone while the CPU kernel takes any float:
# Hugging Face's mixtures of experts call `grouped_mm` in fp32 on CPU. Their fake outputs are made in bfloat16 and cast
# back: the shapes are the kernel's, the dtype the real kernel's.
_BF16_META = frozenset(getattr(aten, name).default for name in ("_grouped_mm",) if hasattr(aten, name))


def _in_bf16(func: Any, args: Any, kwargs: Any) -> Any:
    dtypes = {t.dtype for t in args if isinstance(t, Tensor) and t.is_floating_point()}
    if len(dtypes) != 1 or torch.bfloat16 in dtypes:
        return func(*args, **kwargs)  # the kernel's own verdict
    dtype = dtypes.pop()
    cast = [t.to(torch.bfloat16) if isinstance(t, Tensor) and t.is_floating_point() else t for t in args]
    out = func(*cast, **{k: v for k, v in kwargs.items() if k != "out_dtype"})
    return out.to(dtype)


class StandInValues(TorchDispatchMode):
    """Answers value reads and value-dependent sizes of fake tensors (see [Note: value reads on fake tensors]).

    Enter it inside the fake mode (it must see the operators first). ``reads`` counts the call sites that read a
    value; ``sized`` the operators whose size was taken at its upper bound.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.sized: Counter[str] = Counter()
        # Boolean tensors whose every element is known (see `_ALL_FALSE`); any other boolean reads as False.
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            self.reads[_call_site()] += 1
            tensor = args[0]
            return self._known.get(tensor, False) if tensor.dtype == torch.bool else _stand_in(tensor.dtype)
        if func in (aten.equal.default, aten.allclose.default):
            self.reads[_call_site()] += 1
            return bool(args[0].shape == args[1].shape)
        if func is aten.nonzero.default:
            self._sized(func)
            tensor = args[0]
            return torch.zeros((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)
        if func is aten.masked_select.default:
            self._sized(func)
            tensor, mask = args
            return tensor.expand(torch.broadcast_shapes(tensor.shape, mask.shape)).reshape(-1).clone()
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._unsafe_index.Tensor):
            indices = args[1]
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self._sized(func)
                expanded: list[Tensor | None] = []
                for i in indices:
                    expanded.extend(_full_indices(i) if i is not None and i.dtype in (torch.bool, torch.uint8) else [i])
                return func(args[0], expanded, *args[2:], **kwargs)
        if func in _BF16_META:
            return _in_bf16(func, args, kwargs)
        if func in (aten._unique2.default, aten.unique_consecutive.default):
            self._sized(func)
            tensor = args[0]
            flat = tensor.reshape(-1).clone()
            inverse = torch.zeros(tensor.shape, dtype=torch.long, device=tensor.device)
            counts = torch.zeros(flat.numel(), dtype=torch.long, device=tensor.device)
            return flat, inverse, counts
        return func(*args, **kwargs)

    def _sized(self, func: Any) -> None:
        self.sized[f"{func} at {_call_site()}"] += 1

    def report(self) -> dict[str, dict[str, int]]:
        """What was answered, for ``ModelProfile.info``: call sites of value reads and of upper-bound sizes."""
        return {
            "value_reads": dict(sorted(self.reads.items())),
            "upper_bound_sizes": dict(sorted(self.sized.items())),
        }


class StandInMethods(TorchFunctionMode):
    """The ``Tensor`` methods that read values without reaching the dispatcher on a fake tensor: ``numpy()`` gives
    zeros of the tensor's shape, ``format(t, spec)`` formats the stand-in of a 0-d tensor (see [Note: value reads on
    fake tensors]). ``values`` records the reads with the dispatch mode's counters."""

    def __init__(self, values: StandInValues) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is Tensor.numpy and _is_fake(args[0]):
            import numpy

            self.values.reads[_call_site()] += 1
            tensor = args[0]
            name = str(tensor.dtype).removeprefix("torch.")
            return numpy.zeros(tuple(tensor.shape), dtype=numpy.float32 if name == "bfloat16" else numpy.dtype(name))
        if func is Tensor.__format__ and _is_fake(args[0]) and args[0].dim() == 0:
            return format(args[0].detach().item(), args[1])
        out = func(*args, **kwargs)
        if isinstance(out, Tensor) and out.dtype == torch.bool and _is_fake(out):
            known = self.values._known
            if func in _ALL_FALSE or func in _ALL_TRUE:
                known[out] = func in _ALL_TRUE
            elif (func in _NEGATE or func in _KEEP) and isinstance(args[0], Tensor) and args[0] in known:
                known[out] = known[args[0]] != (func in _NEGATE)
        return out


def _is_fake(tensor: Any) -> bool:
    return isinstance(tensor, Tensor) and is_fake(tensor)
