"""The cost model: bytes and seconds of a plan, checked against hand-computed figures and FSDP2's rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_osdp.cost_model import CostModelConfig, MemoryParts, predict
from lightning_osdp.cost_model.units import ParamSpec, unit_bytes
from lightning_osdp.plan import Plan
from lightning_osdp.profiling.model_profile import ModelProfile

import synthetic
from synthetic import gpt_profile

CONFIG = CostModelConfig(
    copy_bytes_per_second=1e6,
    unit_overhead_seconds=1e-4,
    tensor_overhead_seconds=0.0,
    collective_sync_seconds=5e-4,
    optimizer_seconds_per_tensor=2e-4,
    framework_seconds=1e-3,
    ddp_bucket_bytes=120,  # twice the test Linear's gradients: a model with less than a bucket all-reduces once
)


def one_linear(world_size: int = 2) -> ModelProfile:
    """A root holding one Linear(4 -> 3): weight (3, 4) and bias (3,), fp32 (60 bytes), AdamW."""
    return synthetic.one_linear(
        world_size=world_size,
        device="cpu",
        step_overhead_seconds=10e-3,
        optimizer_step_seconds=6e-3,
        extra_activation_bytes=20,
    )


def test_full_shard_bytes_by_hand():
    """Linear(4 -> 3) under full_shard on 2 ranks: dim 0 (3 rows) pads to 2 rows per rank."""
    profile = one_linear()
    prediction = predict(profile, Plan({"": "no_shard", "a": "full_shard"}), config=CONFIG)
    (unit,) = [u for u in prediction.units if u.name == "a"]
    # Shard: 2 of 3 weight rows (8 elements) + 2 of 3 bias entries = 10 elements = 40 bytes; gathered: 2 x 40.
    assert unit.kept == MemoryParts(parameters=40, gradients=40, optimizer_states=120 * 40 // 60 + 8)
    assert unit.gathered == 80 + 80  # unsharded parameters and the all-gather output
    # The peak is the forward of `a`: kept state (40 + 40 + 88), its all-gather output (80) and gathered
    # parameters (80), its saved activations (100) and its output (60).
    assert prediction.peak_at == "forward a"
    assert prediction.peak == MemoryParts(
        parameters=40,
        gradients=40,
        optimizer_states=88,
        activations=160,
        gathered_parameters=80,
        communication_buffers=80,
    )
    assert prediction.peak_bytes == 488
    instants = dict(prediction.instants)
    assert instants["step start"] == 168
    # On CPU the executor frees a unit's all-gather output when its forward ends: at the loss only the level
    # (kept state and a's activations), the loss and the logits.
    assert instants["loss"] == 168 + 100 + 20 + 60
    # Where FSDP2 keeps it until the next gather or the root's post-forward (CUDA), it is still there at the loss.
    kept = predict(
        profile,
        Plan({"": "no_shard", "a": "full_shard"}),
        config=dataclasses.replace(CONFIG, release_all_gather_after_forward=False),
    )
    assert dict(kept.instants)["loss"] == 168 + 100 + 80 + 20 + 60
    assert instants["optimizer step"] == 168 + 2 * 32  # AdamW temporaries: twice the largest local parameter


def test_no_shard_bytes_by_hand():
    profile = one_linear()
    prediction = predict(profile, Plan({"": "no_shard", "a": "no_shard"}), config=CONFIG)
    (unit,) = [u for u in prediction.units if u.name == "a"]
    # DDP: the parameters and their gradient bucket (kept all run, a view is `.grad`), AdamW's state.
    assert unit.kept == MemoryParts(parameters=60, gradients=60, optimizer_states=128)
    assert unit.gathered == 0  # plain tensors: nothing is gathered or copied
    instants = dict(prediction.instants)
    assert instants["step start"] == 248  # zero_grad drops the views, not the bucket
    assert instants["loss"] == 248 + 100 + 20 + 60  # activations, loss, logits
    # Peak in a's backward: kept state 248, autograd's gradient before DDP copies it into the bucket (60), a's
    # saved activations (100) and its output gradient (60).
    assert prediction.peak_at == "backward a"
    assert prediction.peak == MemoryParts(parameters=60, gradients=120, optimizer_states=128, activations=160)


def test_step_time_by_hand():
    profile = one_linear()
    full = predict(profile, Plan({"": "no_shard", "a": "full_shard"}), config=CONFIG)
    # compute: 3 ms of modules + (10 - 6) ms step overhead without the optimizer + 1 ms of training loop.
    assert full.compute_seconds == pytest.approx(8e-3)
    gather = 1e-3 + 80 / 1e6 + 5e-4  # alpha + bytes / beta, + the ranks' wait for each other in training
    reduce = 2e-3 + 80 / 5e5 + 5e-4
    assert full.communication_seconds == pytest.approx(2 * gather + reduce)
    assert full.exposed_seconds == pytest.approx(2 * gather + reduce)  # CPU: nothing overlaps
    copies = 2 * (40 + 80) / 1e6 + 80 / 1e6
    optimizer = 40 * 6e-3 / 60 + 2 * 2e-4  # the optimizer steps the local shard only; two DTensors
    assert full.step_seconds == pytest.approx(8e-3 + 2 * gather + reduce + copies + optimizer + 1e-4)
    ddp = predict(profile, Plan({"": "no_shard", "a": "no_shard"}), config=CONFIG)
    # DDP: the bytes over the fitted bandwidth, and a whole call's latency and wait: the model's 60 bytes of
    # gradients fill less than the 120-byte bucket, and a step all-reduces them once.
    all_reduce = 60 / 2e6 + (5e-4 + 5e-4)
    # Gradients copied into the bucket; the optimizer steps plain tensors (no DTensor cost), no FSDP2 hooks.
    assert ddp.step_seconds == pytest.approx(8e-3 + all_reduce + 60 / 1e6 + 6e-3)


def test_a_step_of_two_backward_passes_all_reduces_ddp_buckets_in_each():
    from lightning_osdp.profiling.model_profile import StepCalls

    # The figures of test_step_time_by_hand, as a manually optimized step with two backward passes (a GAN's).
    one, two = (dataclasses.replace(one_linear(), step_calls=StepCalls(backwards=n)) for n in (1, 2))
    plan = Plan({"": "no_shard", "a": "no_shard"})
    all_reduce, bucket_copy = 60 / 2e6 + (5e-4 + 5e-4), 60 / 1e6
    difference = predict(two, plan, config=CONFIG).step_seconds - predict(one, plan, config=CONFIG).step_seconds
    assert difference == pytest.approx(all_reduce + bucket_copy)
    # A sharded unit's reduction is counted once: FSDP2 reduces after a pass what got gradients in it, and under
    # toggle_optimizer (Lightning's GAN recipe) each unit gets them in one pass.
    sharded = Plan({"": "no_shard", "a": "full_shard"})
    assert predict(two, sharded, config=CONFIG).step_seconds == pytest.approx(
        predict(one, sharded, config=CONFIG).step_seconds
    )


def test_accumulated_micro_batches_repeat_compute_gathers_and_hooks_but_not_reductions_or_the_optimizer():
    # Two micro-batches per optimizer step (timeline.py [Note: gradient accumulation]); the figures of
    # test_step_time_by_hand.
    profile = dataclasses.replace(one_linear(), gradient_accumulation=2)
    full = predict(profile, Plan({"": "no_shard", "a": "full_shard"}), config=CONFIG)
    # The modules' 3 ms and the 4 ms outside them twice, the 1 ms training loop as configured.
    assert full.compute_seconds == pytest.approx(2 * 7e-3 + 1e-3)
    gather = 1e-3 + 80 / 1e6 + 5e-4
    reduce = 2e-3 + 80 / 5e5 + 5e-4
    assert full.communication_seconds == pytest.approx(4 * gather + reduce)
    copies = 4 * (40 + 80) / 1e6 + 80 / 1e6
    optimizer = 40 * 6e-3 / 60 + 2 * 2e-4
    assert full.step_seconds == pytest.approx(15e-3 + 4 * gather + reduce + copies + optimizer + 2 * 1e-4)
    ddp = predict(profile, Plan({"": "no_shard", "a": "no_shard"}), config=CONFIG)
    all_reduce = 60 / 2e6 + (5e-4 + 5e-4)
    assert ddp.step_seconds == pytest.approx(15e-3 + all_reduce + 60 / 1e6 + 6e-3)


def test_the_training_loop_is_priced_by_the_calls_the_step_made():
    from lightning_osdp.cost_model.config import loop_seconds
    from lightning_osdp.profiling.model_profile import StepCalls

    quiet = dataclasses.replace(one_linear(), step_calls=StepCalls())
    logging = dataclasses.replace(one_linear(), step_calls=StepCalls(logged=3, synced=1, gathered=1))
    # Each value logged and each collective costs time; the synced one its all-reduce too (fit: 2 ms of latency).
    assert loop_seconds(logging) > loop_seconds(quiet) + 2e-3
    accumulating = dataclasses.replace(logging, gradient_accumulation=2)
    assert loop_seconds(accumulating) == pytest.approx(2 * loop_seconds(logging))
    # The loop is in the step's constant overhead when the configuration does not fix it.
    free = CostModelConfig(**{**dataclasses.asdict(CONFIG), "framework_seconds": None})
    plan = Plan({"": "no_shard", "a": "no_shard"})
    difference = predict(logging, plan, config=free).step_seconds - predict(quiet, plan, config=free).step_seconds
    assert difference == pytest.approx(loop_seconds(logging) - loop_seconds(quiet))


def test_padding_follows_fsdp2_dim0_rule():
    # 5 rows on 4 ranks: chunks of ceil(5/4) = 2 rows, padded to 8 rows in all.
    p = ParamSpec(rows=5, row_numel=3, itemsize=4, trainable=True)
    b = unit_bytes([p], "full_shard", 4, optim_tensor_bytes=120, optim_scalar_bytes=4)
    assert b.params == 2 * 3 * 4
    assert b.gathered == b.flat == b.reduce_input == 8 * 3 * 4
    assert b.grad == 24 and b.grad_full == 60
    assert b.optim == 120 * 24 // 60 + 4
    replicated = unit_bytes([p], "no_shard", 4, optim_tensor_bytes=120, optim_scalar_bytes=4)
    assert replicated.params == replicated.bucket == replicated.grad_full == 60
    assert replicated.gathered == replicated.flat == replicated.grad == replicated.reduce_input == 0


def test_more_sharding_is_less_memory_and_more_time():
    profile = gpt_profile(depth=4, width=128, tokens=64)
    blocks = [f"model.blocks.{i}" for i in range(4)]
    by_mode = {
        mode: predict(profile, Plan({"": mode, **{b: mode for b in blocks}}))
        for mode in ("no_shard", "shard_grad_op", "full_shard")
    }
    peaks = [by_mode[m].peak_bytes for m in ("no_shard", "shard_grad_op", "full_shard")]
    steps = [by_mode[m].step_seconds for m in ("no_shard", "shard_grad_op", "full_shard")]
    assert peaks[0] > peaks[1] > peaks[2]
    assert steps[0] < steps[1] < steps[2]


def test_splitting_a_linear_gathers_one_slice_at_a_time():
    profile = gpt_profile(depth=2, width=128, tokens=8)
    plan = {"": "full_shard", "model.blocks.0": "full_shard", "model.blocks.1": "full_shard"}
    whole = predict(profile, Plan({**plan, "model.blocks.1.mlp.fc": "full_shard"}))
    split = predict(profile, Plan({**plan, "model.blocks.1.mlp.fc": ("full_shard", 4)}))
    (w,) = [u for u in whole.units if u.name == "model.blocks.1.mlp.fc"]
    (s,) = [u for u in split.units if u.name == "model.blocks.1.mlp.fc"]
    assert s.gathered == pytest.approx(w.gathered / 4, rel=0.01)
    assert s.time.communication > w.time.communication  # four calls' latency instead of one
    assert split.peak_bytes <= whole.peak_bytes


def test_tied_holders_form_one_global_unit():
    profile = gpt_profile(depth=1, width=32)
    prediction = predict(profile, Plan({"": "no_shard", "model.wte": "full_shard", "model.lm_head": "full_shard"}))
    (tied,) = [u for u in prediction.units if u.name == "model.wte"]
    assert tied.modules == ("model.wte", "model.lm_head")
    assert tied.param_count == 256 * 32


def test_one_rank_communicates_nothing():
    profile = gpt_profile(depth=2, width=32, world_size=1)
    prediction = predict(profile, Plan({"": "full_shard", "model.blocks.0": "full_shard"}), world_size=1)
    assert prediction.communication_seconds == 0.0


def test_collectives_overlap_compute_on_cuda_only():
    profile = gpt_profile(depth=2, width=64, flops_per_second=1e9)
    plan = Plan({"": "full_shard", "model.blocks.0": "full_shard", "model.blocks.1": "full_shard"})
    cpu = predict(profile, plan)
    assert cpu.exposed_seconds == pytest.approx(cpu.communication_seconds)
    profile.device = "cuda:0"
    gpu = predict(profile, plan)
    assert gpu.exposed_seconds < gpu.communication_seconds
    assert gpu.step_seconds < cpu.step_seconds


def test_prediction_is_printable_and_serialisable():
    profile = gpt_profile(depth=1, width=32)
    prediction = predict(profile, Plan({"": "full_shard", "model.blocks.0": "shard_grad_op"}))
    text = str(prediction)
    assert "Predicted peak" in text and "model.blocks.0" in text and "shard_grad_op" in text
    data = prediction.to_dict()
    assert data["peak_bytes"] == prediction.peak_bytes == sum(v for k, v in data["peak_parts"].items() if k != "total")


def test_plan_naming_an_unknown_module_is_an_error():
    with pytest.raises(ValueError, match="does not have"):
        predict(gpt_profile(depth=1, width=32), Plan({"model.nope": "full_shard"}))


RUNNER = r"""
import json, os, sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path.cwd() / "examples" / "gpt"))
sys.path.insert(0, str(Path.cwd() / "tests"))
from clean_exit import finish
from gpt import GPTModule

from lightning_osdp import OSDPStrategy, Plan
from lightning_osdp.cost_model import predict
from lightning_osdp.profiling import profile

torch.set_num_threads(1)
dist.init_process_group("gloo")
data = torch.randint(0, 256, (64, 33), generator=torch.Generator().manual_seed(0))


def model():
    L.seed_everything(0, verbose=False)
    return GPTModule(width=64, depth=2, heads=4, context_length=32, lr_schedule="constant")


prof = profile(model(), data[:4])
blocks = {"model.blocks.0": "full_shard", "model.blocks.1": "full_shard"}
plans = {
    "no_shard": Plan({"": "no_shard", "model.blocks.0": "no_shard", "model.blocks.1": "no_shard"}),
    "full_shard": Plan({"": "full_shard", **blocks}),
    "mixed": Plan({"": "no_shard", "model.blocks.0": "shard_grad_op", "model.blocks.1": "full_shard",
                   "model.blocks.1.mlp.fc": ("full_shard", 4)}),
}
rows = {}
for name, plan in plans.items():
    strategy = OSDPStrategy(plan=plan, memory_steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model(), DataLoader(data, batch_size=4))
    peak = torch.tensor([strategy.peak_memory_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    rows[name] = {"predicted": predict(prof, plan, 2).peak_bytes, "measured": int(peak)}
if dist.get_rank() == 0:
    Path(os.environ["OUT"]).write_text(json.dumps(rows))
finish()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_predicted_peak_memory_is_within_ten_percent_of_measured(tmp_path):
    """Two ranks train the example GPT under three plans; the strategy's measured peak (max over ranks) against
    ``predict`` of a real profile."""
    from conftest import torchrun

    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    out = tmp_path / "rows.json"
    torchrun(script, env={"OUT": str(out)}, timeout=300)
    import json

    rows = json.loads(out.read_text())
    for name, row in rows.items():
        assert row["predicted"] == pytest.approx(row["measured"], rel=0.10), name


def test_check_against_a_run_flags_a_miss_and_names_the_parts():
    prediction = predict(one_linear(), Plan({"": "no_shard", "a": "full_shard"}), config=CONFIG)
    close = prediction.check(500, prediction.step_seconds * 1.05)
    assert close.ok and close.memory_ratio == pytest.approx(488 / 500)
    miss = prediction.check(1000, prediction.step_seconds * 2)
    assert not miss.ok
    assert "forward a" in miss.message and "activations" in miss.message and "compute" in miss.message


class _Hooked(torch.nn.Module):
    """Blocks with adapters hooked into them (registered beside the blocks, run inside them), and a trainable
    module that never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(2)))
        self.adapters = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.unused = torch.nn.Linear(8, 8)
        for block, adapter in zip(self.blocks, self.adapters, strict=True):
            block.register_forward_hook(lambda _m, _i, out, adapter=adapter: out + adapter(out))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).sum()


def test_modules_that_ran_inside_a_sibling_are_walked_before_it_and_modules_never_run_last() -> None:
    from lightning_osdp import profile
    from lightning_osdp.cost_model.structure import ModelInfo

    prof = profile(_Hooked(), torch.randn(4, 8))
    info = ModelInfo(prof, 1, CostModelConfig().resolve(prof))
    # The adapters' activations are alive through the blocks' backward: walked first (see structure.py's Note).
    assert info.children[""] == ["adapters", "blocks", "head", "unused"]
    assert info.order[-1] == "unused"
