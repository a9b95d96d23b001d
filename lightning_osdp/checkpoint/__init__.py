"""Stage 5 of the pipeline: checkpoints that do not depend on the plan.

``sharded`` (default): a directory written by every rank in parallel with torch.distributed.checkpoint, keyed by the
unsharded model's own state-dict names, plus Lightning's metadata, the plan and the profile; it loads under any plan
and world size. ``full``: one consolidated ``torch.save`` file, as Lightning's DDP writes. :func:`consolidate` turns
the first into the second. Saves are atomic and replace only checkpoints; incomplete, corrupted (checksums) or
mismatched checkpoints are refused with a message that names the problem, nothing in a checkpoint runs when it is
read (``unpickle``), and a checkpoint is read from one open directory, never through a link out of it, so that a
save replacing it meanwhile gives the old one whole or a clear error (``files``). See ``docs/checkpointing.md``.
"""

import warnings

from lightning_osdp.apply.state_dict import SliceMap
from lightning_osdp.checkpoint.consolidate import consolidate
from lightning_osdp.checkpoint.context import CheckpointContext
from lightning_osdp.checkpoint.dispatch import (
    StateDictType,
    describe_resume,
    load_checkpoint,
    load_model_state,
    load_optimizer_states,
    model_state,
    optimizer_state,
    save_checkpoint,
)
from lightning_osdp.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UntrustedContentError,
)
from lightning_osdp.checkpoint.files import CheckpointDirectory, CheckpointReplacedError
from lightning_osdp.checkpoint.full import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    save_full_checkpoint,
)
from lightning_osdp.checkpoint.layout import Manifest, is_sharded_checkpoint, read_manifest, remove_checkpoint
from lightning_osdp.checkpoint.pretrained import (
    PretrainedLoad,
    check_before_setup,
    initialize_weights,
    load_pretrained,
    validate_pretrained,
)
from lightning_osdp.checkpoint.resume import PlanChoice, SavedPlan, resume_plan, saved_plan
from lightning_osdp.checkpoint.sharded import (
    ShardedState,
    load_sharded_model_state,
    load_sharded_optimizer_state,
    open_sharded_checkpoint,
    read_sharded_tensors,
    save_sharded_checkpoint,
    sharded_model_state,
    sharded_optimizer_state,
)

__all__ = [
    "CheckpointContext",
    "CheckpointDirectory",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointReplacedError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "Manifest",
    "PlanChoice",
    "PretrainedLoad",
    "SavedPlan",
    "ShardedState",
    "SliceMap",
    "StateDictType",
    "UntrustedContentError",
    "check_before_setup",
    "consolidate",
    "describe_resume",
    "full_model_state",
    "full_optimizer_state",
    "initialize_weights",
    "is_sharded_checkpoint",
    "load_checkpoint",
    "load_full_model_state",
    "load_full_optimizer_state",
    "load_model_state",
    "load_optimizer_states",
    "load_pretrained",
    "load_sharded_model_state",
    "load_sharded_optimizer_state",
    "model_state",
    "open_sharded_checkpoint",
    "optimizer_state",
    "read_manifest",
    "read_sharded_tensors",
    "remove_checkpoint",
    "resume_plan",
    "save_checkpoint",
    "save_full_checkpoint",
    "save_sharded_checkpoint",
    "saved_plan",
    "sharded_model_state",
    "sharded_optimizer_state",
    "validate_pretrained",
]

# NOTE: the module `consolidate` is named after the function it defines, which this package exports under the same
# name, so `python -m lightning_osdp.checkpoint.consolidate` finds the module already imported (by the import
# above) and runpy warns that this "may result in unpredictable behaviour". It cannot here: the module holds no
# state, and run as __main__ it only calls `main`. Only that one warning is silenced.
warnings.filterwarnings(
    "ignore", message=r"'lightning_osdp\.checkpoint\.consolidate' found in sys\.modules", category=RuntimeWarning
)
