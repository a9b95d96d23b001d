"""What ``OSDPStrategy.setup`` does between a model on its device and a plan to apply: profile -> solve, for a run.

The decision of *which* plan (given, resumed, corrected or solved here) is
:func:`~lightning_osdp.solver.resolve.resolve_plan`, free of Lightning; this module is the run's side of it: the
planner's options (:class:`PlannerOptions`, the same ``plan_model`` call ``osdp plan`` makes), the batch profiling
runs, the profile itself (a collective), and the printout and files of a plan solved here. The strategy calls
:meth:`RunPlanner.resolve` and applies what it returns.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_osdp import checkpoint as osdp_checkpoint
from lightning_osdp import distributed
from lightning_osdp._compat import fit_ckpt_path, fit_train_dataloader, tree_leaves
from lightning_osdp.budget import card_bytes, format_bytes
from lightning_osdp.distributed import from_rank_zero
from lightning_osdp.plan import Plan
from lightning_osdp.profiling.collectives import NodeGroups
from lightning_osdp.profiling.model_profile import ModelProfile
from lightning_osdp.setup_log import SetupLog
from lightning_osdp.solver.policy import PlannerOptions
from lightning_osdp.solver.resolve import Resolution, resolve_plan
from lightning_osdp.topology import Topology

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_osdp.profiling.optimizer_state import OptimizerSpec

__all__ = ["PlannerOptions", "RunPlanner", "accumulation_of", "largest_batch", "representative_batch"]


#: How many batches of the train dataloader each rank looks at for the largest (see :func:`largest_batch`).
SCANNED_BATCHES = 32


def _tensor_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(batch) if isinstance(t, torch.Tensor))


def accumulation_of(trainer: pl.Trainer, module: pl.LightningModule) -> int:
    """Micro-batches per optimizer step of ``trainer``'s fit: an accumulating step holds every unit's unsharded
    gradients between its micro-batches (the cost model's [Note: gradient accumulation]); a manual step accumulates as
    it likes, which the profile cannot know (1)."""
    return int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if module.automatic_optimization else 1


def largest_batch(loader: Iterable[Any], scanned: int = SCANNED_BATCHES) -> tuple[Any, int, int]:
    """The batch with the most tensor bytes among the first ``scanned`` of ``loader``, its index and how many were
    looked at.

    [Note: batches whose shape varies]
    The profile's batch sets the activations the plan is sized for, so it must be the largest the run meets: a collator
    that pads each batch to its own longest sequence, or a last smaller batch, makes the first batch any size. Each
    rank looks at its loader's batches, without running them, up to :data:`SCANNED_BATCHES` (a count, not a time: the
    same loader gives the same batch, so the same plan, on any machine), and the largest over all ranks is profiled
    (:func:`representative_batch`); a larger one later in the epoch is what the step monitor's measured-peak check
    reports. A loader's iterator draws its base seed from the global RNG: the scan runs on a fork of it, so that the
    run's stream (its shuffle, the dropout masks, a meta model's initialization) is the one it would be without it."""
    best, best_bytes, index, seen = None, -1, 0, 0
    with torch.random.fork_rng(devices=[]):
        for seen, batch in enumerate(itertools.islice(loader, scanned), start=1):
            nbytes = _tensor_bytes(batch)
            if nbytes > best_bytes:
                best, best_bytes, index = batch, nbytes, seen - 1
    if seen == 0:
        raise RuntimeError("the train dataloader gave no batch: OSDP plans from a representative batch")
    return best, index, seen


def representative_batch(
    trainer: pl.Trainer, module: pl.LightningModule, to_device: Callable[[Any], Any]
) -> tuple[Any, str, str]:
    """The batch profiling runs, where it came from, and the step it runs: the largest of the first batches of the fit's
    train dataloader over all ranks (:func:`largest_batch`), else ``example_input_array`` through ``forward``
    (``lightning_osdp.profiling`` [Note: the representative batch]). A collective when the process group exists."""
    if trainer.state.fn == TrainerFn.FITTING:
        loader = fit_train_dataloader(trainer)
        if loader is not None:
            batch, index, seen = largest_batch(loader)
            where = f"#{index}"
            if distributed.is_distributed():
                sizes = distributed.all_gather(_tensor_bytes(batch))
                owner = max(range(len(sizes)), key=lambda r: (sizes[r], -r))
                if owner != 0:  # rank 0's profile is the one every rank plans from
                    batch = distributed.broadcast(batch if distributed.rank() == owner else None, src=owner)
                    where = f"rank {owner}'s"
            source = f"largest of the first {seen} batches of the train dataloader per rank ({where})"
            return to_device(batch), source, "training_step"
    if module.example_input_array is not None:
        return to_device(module.example_input_array), "example_input_array", "forward"
    raise RuntimeError(
        "OSDP plans from a representative batch: this run has no train dataloader and the LightningModule "
        "no `example_input_array`. Set one, or pass a plan with OSDPStrategy(plan=...)."
    )


def _profiled(profile: ModelProfile) -> str:
    why = profile.info.get("mode", "")
    return (
        f"{profile.mode} ({why.removeprefix('auto: ') if why else 'as asked'}), on {profile.batch.get('source', '')}; "
        f"collective benchmark {profile.info.get('collectives_seconds', 0.0):.1f} s"
    )


def _solved(plan: Plan) -> str:
    report = plan.report
    return plan.summary() + (f", {report.status}" if report is not None else "")


@dataclass
class RunPlanner:
    """One run's planning in ``setup``: everything the strategy knows that the plan depends on.

    Attributes:
        options: the planner's options.
        budget: the per-device memory budget in force (bytes).
        requested_budget: the budget the user asked for (``None``: the device's capacity): a resumed checkpoint's plan
            is reused only when it is unchanged.
        topology: this run's nodes, ranks per node and shard groups.
        world_size: the number of ranks.
        device: this rank's device.
        mp_policy: FSDP2's mixed-precision policy (the step is profiled with the parameters in its dtype).
        step_context: the precision plugin's context of a training step.
        node_groups: this rank's groups within and across nodes (``None`` on one node).
        plan_out: where a plan solved here is saved (``None``: ``osdp_plan.json`` in the logger's directory).
        is_global_zero: whether this is rank 0 (which prints and saves).
    """

    options: PlannerOptions
    budget: int
    requested_budget: int | None
    topology: Topology
    world_size: int
    device: torch.device
    mp_policy: MixedPrecisionPolicy | None
    step_context: Callable[[], AbstractContextManager[Any]]
    node_groups: NodeGroups | None
    plan_out: Path | None
    is_global_zero: bool
    #: The profile file saved beside a plan solved here (rank 0), where a measured correction is recorded.
    profile_file: Path | None = None
    #: Where the stages are told (profiling, solving), with their seconds.
    log: SetupLog = field(default_factory=SetupLog)

    def resolve(
        self, trainer: pl.Trainer, module: pl.LightningModule, given: Plan | None, to_device: Callable[[Any], Any]
    ) -> Resolution:
        """The plan given, else the resumed checkpoint's, else profile and solve (rank 0 solves, every rank gets
        its plan); a plan solved here is printed and saved with its profile."""
        return self.resolve_with(
            given=given,
            resumed=self._resumed(trainer, module),
            profile=lambda: self._profile(trainer, module, to_device),
            accumulation=accumulation_of(trainer, module),
            # `trainer.log_dir` is a collective (a broadcast): every rank asks, rank 0 writes.
            plan_file=lambda: self.plan_out or Path(trainer.log_dir or trainer.default_root_dir) / "osdp_plan.json",
        )

    def resolve_with(
        self,
        *,
        given: Plan | None,
        resumed: osdp_checkpoint.PlanChoice | None,
        profile: Callable[[], ModelProfile],
        plan_file: Callable[[], Path | None],
        accumulation: int | None = None,
    ) -> Resolution:
        """:meth:`resolve` for any front door: ``profile`` profiles the model (a collective, e.g.
        :meth:`profile_batch`), ``plan_file`` says where a plan solved here is saved (called on every rank; ``None``:
        printed only); ``accumulation``: the run's micro-batches per optimizer step, against a resumed plan's. Fabric's
        strategy calls this with the first forward's batch and no checkpoint."""
        resolution = resolve_plan(
            given=given,
            resumed=resumed,
            topology=self.topology,
            fits=lambda profile, plan: self.options.fits(profile, plan, self.budget, self.topology),
            solve=lambda profile: self.log.timed(
                "solving the plan",
                lambda: from_rank_zero(
                    lambda: self.options.plan(profile, self.budget, self.topology, card_bytes=card_bytes(self.device)),
                    what="planning",
                ),
                done=lambda plan: f"{_solved(plan)} under {format_bytes(self.budget)} per device",
            ),
            profile=lambda: self.log.timed("profiling the model", profile, done=_profiled),
            accumulation=accumulation,
        )
        for message in resolution.messages:
            rank_zero_info(f"OSDP: {message}")
        if resolution.solved_here and resolution.profile is not None:
            self._save(plan_file(), resolution.plan, resolution.profile)
        return resolution

    def holds_parameters(self, module: torch.nn.Module) -> int | None:
        """Before profiling: ``None`` when the budget the planner plans against holds at least the model's parameters
        sharded over every rank, the least any plan keeps; else that least (bytes per rank). A budget below it can only
        be a mistake, and measuring a large model takes long: such a run is profiled on fake tensors only, to name the
        smallest budget that trains (:meth:`_refuse`)."""
        from lightning_osdp.solver import planned_budget

        least = -(-sum(p.numel() * p.element_size() for p in module.parameters()) // self.world_size)
        return least if planned_budget(self.budget, self.options.memory_headroom) < least else None

    def _refuse(self, least: int, estimate: Callable[[], ModelProfile]) -> NoReturn:
        """The error of a budget below the parameters' floor, with the smallest budget that trains: the planner's own
        infeasible-budget message on a profile ``estimate`` makes on fake tensors (no memory, no step measured)."""
        from lightning_osdp.solver import InfeasibleBudgetError

        floor = (
            f"memory budget {format_bytes(self.budget)} per device cannot hold the model's parameters even sharded "
            f"over all {self.world_size} ranks ({format_bytes(least)} each, before gradients, optimizer state and "
            "activations)"
        )
        try:
            self.options.plan(estimate(), self.budget, self.topology)
        except InfeasibleBudgetError as err:
            raise InfeasibleBudgetError(
                f"{floor}. Estimated on fake tensors: {err}",
                budget=self.budget,
                minimum=err.minimum,
                consumers=err.consumers,
            ) from None
        raise InfeasibleBudgetError(
            f"{floor}: raise memory_budget, or run on more ranks", budget=self.budget, minimum=least, consumers=[]
        )

    def _resumed(self, trainer: pl.Trainer, module: pl.LightningModule) -> osdp_checkpoint.PlanChoice | None:
        path = fit_ckpt_path(trainer)
        if path is None or not Path(path).exists():
            return None
        return osdp_checkpoint.resume_plan(
            osdp_checkpoint.saved_plan(path),
            world_size=self.world_size,
            memory_budget=self.requested_budget,
            module=module,
        )

    def _profile(
        self, trainer: pl.Trainer, module: pl.LightningModule, to_device: Callable[[Any], Any]
    ) -> ModelProfile:
        """Profile on the representative batch (a collective: every rank profiles its replica, rank 0's figures are
        broadcast so that all plan alike)."""
        batch, source, step = representative_batch(trainer, module, to_device)
        return self.profile_batch(
            module, batch, source=source, step=step, accumulation=accumulation_of(trainer, module)
        )

    def profile_batch(
        self,
        module: torch.nn.Module,
        batch: Any,
        *,
        source: str,
        step: str,
        accumulation: int = 1,
        optimizer: OptimizerSpec | None = None,
    ) -> ModelProfile:
        """Profile ``module``'s step on ``batch`` (``step``: ``"training_step"`` or ``"forward"``; ``source`` is
        recorded), with ``accumulation`` micro-batches per optimizer step and the optimizer ``optimizer`` (default
        the LightningModule's ``configure_optimizers``): measured on a copy where it fits the budget, else estimated;
        a budget below the parameters' floor is refused on fake tensors first (:meth:`holds_parameters`). A
        collective."""
        from lightning_osdp.profiling import profile, profile_with_policy

        kwargs: dict[str, Any] = {
            "device": self.device,
            "step": step,
            "batch_source": source,
            "step_context": self.step_context,
            # A copy of the model is measured only if its step fits the budget beside the model (else block by block).
            "available_memory": self.budget,
            "node_groups": self.node_groups,
        }
        if optimizer is not None:
            kwargs["optimizer"] = optimizer

        def run(**extra: Any) -> ModelProfile:
            if self.mp_policy is not None:
                # As the policy runs the step: parameters in its dtype (lightning_osdp/profiling/mixed_precision.py).
                return profile_with_policy(module, batch, self.mp_policy, **kwargs, **extra)
            return profile(module, batch, **kwargs, **extra)

        least = self.holds_parameters(module)
        if least is not None:
            self._refuse(least, lambda: run(mode="estimated"))
        profiled = run()
        return dataclasses.replace(profiled, gradient_accumulation=max(int(accumulation), 1))

    def _save(self, out: Path | None, plan: Plan, profile: ModelProfile) -> None:
        """Rank 0 prints the plan solved here and, when ``out`` is given, saves it with its profile beside it."""
        from lightning_osdp.cost_model import predict
        from lightning_osdp.solver import format_plan

        if not self.is_global_zero:
            return
        print(format_plan(plan, predict(profile, plan, self.topology), budget=self.budget))
        if out is None:
            return
        plan.save(out)
        self.profile_file = profile.save(out.with_name(out.stem + ".profile.json"))
        rank_zero_info(f"OSDP: plan saved to {out} (pass it back with OSDPStrategy(plan=...) to skip planning)")
