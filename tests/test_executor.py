"""The executor: which FSDP2 groups a plan makes, operator splitting, and state-dict keys."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_osdp import Plan, PlanError, SplitLinear, apply_plan
from lightning_osdp.apply import OSDPModule, ReplicatedModule, plan_units
from lightning_osdp.apply.state_dict import SliceAlias, SliceMap

from conftest import ROOT, torchrun
from models import TinyGPT


def test_tied_holders_in_different_units_form_one_group() -> None:
    units = plan_units(
        TinyGPT(), Plan({"": "no_shard", "wte": "full_shard", "lm_head": "full_shard", "h.0": "no_shard"})
    )
    assert [u.names for u in units] == [("h.0",), ("lm_head", "wte")]
    assert units[1].mode == "full_shard"


def test_tied_holders_with_different_modes_are_an_error() -> None:
    with pytest.raises(PlanError, match=r"tied parameter 'wte.weight'.*'lm_head'=no_shard, 'wte'=full_shard"):
        plan_units(TinyGPT(), Plan({"wte": "full_shard", "lm_head": "no_shard"}))


def test_tie_with_an_ancestor_unit_is_an_error_naming_both_holders() -> None:
    with pytest.raises(PlanError, match=r"tied parameter 'wte.weight' is used by 'wte'.*by 'lm_head' \(decision ''"):
        plan_units(TinyGPT(), Plan({"": "no_shard", "wte": "full_shard"}))


def test_split_of_a_tied_module_is_an_error() -> None:
    with pytest.raises(PlanError, match="cannot split a module whose parameter 'wte.weight' is shared"):
        plan_units(TinyGPT(), Plan({"wte": "full_shard", "lm_head": ("full_shard", 2)}))


def test_units_are_applied_bottom_up_and_splits_expand() -> None:
    plan = Plan({"": "no_shard", "h.0": "shard_grad_op", "h.0.fc": ("full_shard", 3), "h.1": "full_shard"})
    names = [u.names[0] for u in plan_units(TinyGPT(), plan)]
    assert names.index("h.0.fc.slices.0") < names.index("h.0")
    assert [n for n in names if n.startswith("h.0.fc")] == ["h.0.fc.slices.0", "h.0.fc.slices.1", "h.0.fc.slices.2"]


def test_split_linear_equals_the_linear_with_the_bias_added_once() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(13, 85)
    with torch.no_grad():
        linear.bias.fill_(1.0)  # a bias added k times would show up at once
    split = SplitLinear(copy.deepcopy(linear), 4)
    assert [p.out_features for p in split.slices] == [22, 21, 21, 21]
    x = torch.randn(5, 7, 13, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = linear(x), split(x2)
    torch.testing.assert_close(y2, y, rtol=0, atol=1e-6)
    y.square().sum().backward()
    y2.square().sum().backward()
    # The input gradient sums over output features: slice by slice, in another order.
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    merged = torch.cat([p.weight.grad for p in split.slices])
    torch.testing.assert_close(merged, linear.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(split.merged().weight, linear.weight, rtol=0, atol=0)
    torch.testing.assert_close(split.merged().bias, linear.bias, rtol=0, atol=0)


def test_split_state_dicts_use_the_models_own_keys() -> None:
    model = TinyGPT()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    from lightning_osdp.apply import split_linear

    split_linear(model, "h.0.fc", 4)
    slices = SliceMap.of(model)
    assert slices.slices_of["h.0.fc.weight"] == [f"h.0.fc.slices.{i}.weight" for i in range(4)]
    assert {alias.canonical for alias in slices.aliases.values()} == {"h.0.fc.weight", "h.0.fc.bias"}
    merged = slices.merge_state(model.state_dict())
    assert list(merged) == list(reference)
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=0)
    model.load_state_dict(slices.unmerge_state(merged))

    opt = {
        "state": {
            f"h.0.fc.slices.{i}.weight": {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 5), float(i))}
            for i in range(2)
        },
        "param_groups": [{"lr": 0.1, "params": ["wte.weight", "h.0.fc.slices.0.weight", "h.0.fc.slices.1.weight"]}],
    }
    # Two slices of 2 rows each of a 4-row parameter.
    two = SliceMap({f"h.0.fc.slices.{i}.weight": SliceAlias("h.0.fc.weight", i, 2 * i, 2, 4) for i in range(2)})
    merged_opt = two.merge_optimizer_state(opt)
    assert merged_opt["param_groups"][0]["params"] == ["wte.weight", "h.0.fc.weight"]
    assert merged_opt["state"]["h.0.fc.weight"]["exp_avg"].shape == (4, 5)
    back = two.unmerge_optimizer_state(merged_opt)
    torch.testing.assert_close(back["state"]["h.0.fc.slices.1.weight"]["exp_avg"], torch.ones(2, 5))
    assert back["param_groups"][0]["params"] == opt["param_groups"][0]["params"]


def test_invalid_plan_leaves_the_model_untouched(world1: object) -> None:
    model = TinyGPT()
    before = dict(model.named_modules())
    with pytest.raises(PlanError):
        apply_plan(model, Plan({"h.0.fc": ("full_shard", 2), "h.7": "full_shard"}), mesh=world1)  # type: ignore[arg-type]
    assert dict(model.named_modules()).keys() == before.keys()
    assert not isinstance(model.h[0].fc, SplitLinear)


def test_one_rank_training_equals_plain_training(world1: object) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    plan = Plan({"": "no_shard", "h.0": "full_shard", "h.1": "shard_grad_op", "h.1.fc": ("full_shard", 2)})
    root = apply_plan(model, plan, mesh=world1)  # type: ignore[arg-type]
    # The root's leftovers are no_shard: plain tensors under DDP, around the FSDP2 root of the sharded units.
    assert isinstance(root, ReplicatedModule) and isinstance(root.sharded, OSDPModule)
    assert root.sharded.module is model
    assert not isinstance(model.wte.weight, DTensor) and isinstance(model.h[0].fc.weight, DTensor)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    tokens = torch.randint(0, 37, (4, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for opt, call in ((opts[0], root), (opts[1], reference)):
            loss = nn.functional.cross_entropy(call(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = SliceMap.of(model).merge_state(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clipping_a_mix_of_plain_and_sharded_gradients_equals_torch(world1: object, norm_type: float) -> None:
    from torch.distributed.fsdp import fully_shard

    from lightning_osdp.apply.clip import clip_grad_norm_

    torch.manual_seed(0)
    mixed = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    reference = copy.deepcopy(mixed)
    fully_shard(mixed[1], mesh=world1)  # type: ignore[arg-type]
    x = torch.randn(4, 6)
    for model in (mixed, reference):
        model(x).pow(2).sum().backward()
    assert isinstance(mixed[1].weight.grad, DTensor) and not isinstance(mixed[0].weight.grad, DTensor)
    got = clip_grad_norm_(mixed.parameters(), 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type)
    torch.testing.assert_close(got, want)
    assert got > 0.5  # the gradients were clipped
    for a, b in zip(mixed.parameters(), reference.parameters(), strict=True):
        grad = a.grad.full_tensor() if isinstance(a.grad, DTensor) else a.grad
        torch.testing.assert_close(grad, b.grad)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_when_every_gradient_is_sharded_equals_torch(world1: object, algorithm: str) -> None:
    # A plan that shards every unit has no plain gradients at all (this was a KeyError).
    from torch.distributed.fsdp import fully_shard

    from lightning_osdp.apply.clip import clip_grad_norm_, clip_grad_value_

    torch.manual_seed(0)
    sharded = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    reference = copy.deepcopy(sharded)
    fully_shard(sharded[0], mesh=world1)  # type: ignore[arg-type]
    fully_shard(sharded, mesh=world1)  # type: ignore[arg-type]
    x = torch.randn(4, 6)
    for model in (sharded, reference):
        model(x).pow(2).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in sharded.parameters())
    if algorithm == "norm":
        torch.testing.assert_close(
            clip_grad_norm_(sharded.parameters(), 0.5), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        )
    else:
        clip_grad_value_(sharded.parameters(), 0.05)
        torch.nn.utils.clip_grad_value_(reference.parameters(), 0.05)
    for a, b in zip(sharded.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad)


def test_the_releasing_all_gather_frees_only_a_live_buffer() -> None:
    from lightning_osdp.comm import ReleasingAllGather

    comm = ReleasingAllGather()
    buffer = comm.allocate((64,), dtype=torch.float32, device=torch.device("cpu"))
    comm.release()
    assert buffer.untyped_storage().nbytes() == 0
    dropped = comm.allocate((64,), dtype=torch.float32, device=torch.device("cpu"))
    del dropped
    comm.release()  # FSDP2 dropped it (backward): nothing to free, nothing was kept alive


@pytest.mark.distributed
@pytest.mark.slow
def test_on_two_cpu_ranks_a_units_all_gather_buffer_is_freed_when_its_forward_ends(tmp_path: Path) -> None:
    torchrun(ROOT / "tests" / "distributed" / "release_runner.py", str(tmp_path), nproc=2, timeout=300)
    for rank in range(2):
        result = json.loads((tmp_path / f"release.rank{rank}.json").read_text())
        # FSDP2 alone keeps h.0's flat all-gather buffer (2 ranks x its padded shard) until the root's post-forward,
        # through h.1 (no_shard) and the rest of the forward; OSDP's all-gather frees it when h.0's forward ends.
        assert result["kept"] - result["released"] == result["flat_bytes"] > 0


def test_splitting_draws_nothing_from_the_global_rng() -> None:
    # A split made after seeding must not shift the random stream (dropout masks, data order) of the run.
    linear = nn.Linear(13, 85)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    SplitLinear(linear, 4)
    assert torch.equal(torch.rand(4), expected)
