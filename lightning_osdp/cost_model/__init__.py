"""The cost model: a plan's per-device peak memory and step time, predicted from a profile.

It models what the executor runs (``lightning_osdp/apply/executor.py``) and what FSDP2 allocates for it
(``torch/distributed/fsdp/_fully_shard``, torch 2.13), on rank 0 (which holds the largest padded shards), for
one optimizer step as ``lightning_osdp.memory`` measures it: from the start of the step (the model, last step's
gradients and the optimizer state are live) to the end of ``optimizer_step``.

Memory
------
Each decided module is one unit covering the parameters no decided descendant covers (a ``split=k`` Linear is
``k`` units, one per slice; tied holders in different units are one list group): an FSDP2 unit when sharded, plain
tensors under DDP when ``no_shard``. Per unit, with ``P`` its parameters, FSDP2 pads dim 0 to a multiple of the
world size ``N`` (``shard(P) = ceil(rows/N) * row``):

=================  =============================  =============================  ==========================
                   ``no_shard`` (DDP)             ``shard_grad_op``              ``full_shard``
=================  =============================  =============================  ==========================
kept all step      ``P`` + opt(``P``) + bucket P  ``shard(P)`` + opt(shard)      ``shard(P)`` + opt(shard)
gradient kept      in the bucket (kept all run)   ``shard(P)``                   ``shard(P)``
gathered           none                           ``N*shard(P)``, fwd->bwd       ``N*shard(P)``, own fwd, own bwd
all-gather buffer  none                           ``N*shard(P)``                 ``N*shard(P)``
reduction          in place, in the bucket        input ``N*shard(P)``           input ``N*shard(P)``
=================  =============================  =============================  ==========================

``hybrid_shard`` is ``full_shard`` with ``N`` its shard group's ranks (one node's, by default): its replicas across
the groups keep the same bytes, and its all-reduce across the groups runs in place on the sharded gradient.

The step is walked as a timeline of instants (``timeline.py``); the predicted peak is the largest:

1. **Start**: every unit's kept parameters and optimizer state, and last step's sharded gradients; a correction a
   run measured (``ModelProfile.measured_peak_correction``) is held from here to the end. DDP rebuilds its buckets
   once, at the second step, before the old ones are freed: an instant with every bucket twice.
2. **Forward**, units in forward order (global units first: the root ``""``, whose FSDP2 group encloses the whole
   step, and tied groups). A gather allocates the all-gather output, frees the output kept for the previous
   gather, then allocates the unsharded parameters (FSDP2 keeps each forward all-gather output until the next
   unit's copy-out). Each module adds the activations it saves for backward, and its output is live while it
   finishes. A ``full_shard`` unit frees its parameters after its forward; ``shard_grad_op`` and ``no_shard``
   keep them until their backward.
3. **Loss**: the loss region as the profile measured it (``LossMemory``: the logits, their log-softmax, a float
   copy, metrics computed on them, tensors a returned dict keeps), on top of the level where the model's last
   call returned; then the root reshards and ``zero_grad`` frees last step's gradients (Lightning calls it after
   ``training_step``, before ``backward``).
4. **Backward**, in reverse. The root's pre-backward gathers it again and prefetches the unit whose forward ended
   last (a tied embedding/LM-head group, else the last segment's); the loss's backward adds its measured peak; a
   tied group gathers again on the logits' gradient, and what the loss region still holds (a returned dict's
   logits) stays to the end of the step. A ``full_shard`` unit is gathered again (its all-gather output freed right
   after the copy-out); FSDP2 prefetches the previous sharded unit's all-gather meanwhile (past DDP's units). Each
   module's backward produces its parameters' unsharded gradients, holds its output gradient and input gradient,
   then frees its activations (a split Linear's slices each hold the whole output gradient, and their input
   gradients add up). After a unit's backward its parameters are freed (all modes), the previous reduce-scatter
   input is dropped, a new input is allocated, the unsharded gradients freed, and the sharded gradient
   allocated. Units that take the model's raw input (and global units) are reduced in the root's final
   callback, after the whole backward.
5. **Optimizer step**: temporaries of the largest local parameter (single-tensor Adam: 2x).

:func:`memory_timeline` (``Prediction.memory_timeline``) lists these instants in order, by category and phase
(forward, loss, backward, optimizer): what ``osdp plan --plot`` draws.

Under FSDP2's mixed precision (a profile whose ``mixed_precision`` is set, ``OSDPStrategy(mixed_precision=...)``),
sharded units gather, all-gather and compute in the policy's ``param_dtype`` and reduce-scatter in its
``reduce_dtype``, while shards, sharded gradients and optimizer state keep the stored dtype; replicated units keep
autocast's compute-dtype copies of their weights (``units.py`` [Note: bytes per dtype under FSDP2's mixed precision]).

Time
----
``step = compute + recomputation + sum over units (exposed communication + contention + copies + optimizer +
overhead)``, where

* ``compute`` is the profiled forward and backward time of every module, plus the profile's step overhead less its
  optimizer step (modelled per unit), plus the training loop around the step (Lightning's closure and hooks,
  ``self.log(..., sync_dist=True)``: ``framework_seconds``);
* communication per unit comes from the profile's ``alpha + bytes / beta`` fits, plus a synchronisation cost per
  blocking call (in training the ranks do not enter a collective together, as they do when it is fitted):
  ``full_shard`` 2 all-gathers and a reduce-scatter, ``shard_grad_op`` 1 all-gather and a reduce-scatter,
  ``hybrid_shard`` ``full_shard``'s within its shard group and an all-reduce of the gradient shard across the groups,
  ``no_shard`` its gradients' bytes in DDP's bucketed all-reduce, and the share of one call's latency and wait
  that its bytes fill of a bucket; a ``split=k`` Linear pays ``k`` calls of about ``1/k`` of the bytes. Each call is
  priced on its group (the world, a shard group, a replicate group) from the profile's fits within and across nodes
  (``network.py``: a ring over several nodes runs at the slower link);
* exposed communication is ``max(0, communication - overlap * compute of the unit's modules)``: FSDP2 prefetches
  the next all-gather during the current unit's compute and reduces during the next backward compute. On CPU
  ``overlap`` is 0 (gloo collectives block the calling thread; FSDP2's streams are no-ops), so every
  collective is exposed; on CUDA it is 1. Collectives with nothing to overlap are exposed whatever the compute: the
  root unit's gathers (before the step's first compute) and the reductions of FSDP2's final callback (after its last;
  ``structure.unit_time``);
* contention: a collective hidden behind compute slows that compute by the share of the device its kernels hold
  (``collective_compute_share``; ``config.py`` [Note: the target's figures]);
* recomputation: the forward seconds of every recomputed module, run again in backward (up to its last saved
  tensor, where torch's recomputation stops, when the profile measured it: ``recompute_replay_seconds``);
* copies are FSDP2's memory copies (all-gather copy-in/out, reduce-scatter copy-in) and DDP's copy of each
  gradient into its bucket, at the copy bandwidth; on CUDA the copy-ins run on FSDP2's side streams and hide in the
  compute the collectives leave;
* the optimizer step is proportional to the unit's local trainable bytes (the profile's measured rate), plus, for
  sharded units, a DTensor-dispatch cost per parameter tensor (FSDP2's parameters are DTensors, DDP's are not);
* overhead, for sharded units, is a fixed cost per unit and per parameter tensor (FSDP2's hooks, views and DTensor
  wrappers in every forward and backward), and per extra slice of a split Linear (a call, and its share of
  ``torch.cat``);
* host work (hooks, DTensor dispatch) adds on the CPU, where host and device are the same cores; on CUDA it costs
  only what the device work it overlaps does not hide (``host_overlap``).

``Prediction.step_parts`` splits the step into these parts (compute, recompute, exposed communication, contention,
copies, optimizer, overhead) and ``Prediction.exposed_by_cause`` the exposed part by cause; ``osdp plan`` prints both.

The constants are in :class:`CostModelConfig`; ``config.py`` [Note: calibration] says how each was measured on the
development CPU, and [Note: the target's figures] where a GPU's come from.
"""

from lightning_osdp.cost_model.config import CostModelConfig
from lightning_osdp.cost_model.parts import CATEGORIES, MemoryParts
from lightning_osdp.cost_model.prediction import (
    MemoryInstant,
    Prediction,
    PredictionCheck,
    UnitPrediction,
    memory_timeline,
    predict,
)
from lightning_osdp.cost_model.units import UnitBytes, UnitTime

__all__ = [
    "CATEGORIES",
    "CostModelConfig",
    "MemoryInstant",
    "MemoryParts",
    "Prediction",
    "PredictionCheck",
    "UnitBytes",
    "UnitPrediction",
    "UnitTime",
    "memory_timeline",
    "predict",
]
