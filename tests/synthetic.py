"""Hand-made profiles of GPT-shaped models, for the solver's and the cost model's tests and
``benchmarks/solver_speed.py`` (which imports it from here): profiles of any size without a model to run.

The figures are derived from shapes (fp32, AdamW) and simple rates, not measured; a real profile comes from
``lightning_osdp.profiling``. Not part of the package: nothing in it plans from a made-up profile.
"""

from __future__ import annotations

from typing import Any

from lightning_osdp.profiling.model_profile import CollectiveFit, ModelProfile, ModuleProfile

__all__ = ["gloo_like_collectives", "gpt_profile", "one_linear", "one_linear_on"]


def gloo_like_collectives(world_size: int = 2) -> dict[str, CollectiveFit]:
    """Collective fits of the order measured with gloo on loopback (2 ranks): all-gather slower than reduce-scatter,
    all-reduce fastest per byte, ~0.4 ms latency."""
    return {
        "all_gather": CollectiveFit("all_gather", world_size, 4e-4, 2.0e8),
        "reduce_scatter": CollectiveFit("reduce_scatter", world_size, 6e-4, 1.8e8),
        "all_reduce": CollectiveFit("all_reduce", world_size, 4e-4, 3.0e8),
    }


def gpt_profile(
    depth: int = 4,
    width: int = 64,
    *,
    vocab: int = 256,
    tokens: int = 512,
    mlp_ratio: int = 4,
    world_size: int = 2,
    flops_per_second: float = 5e10,
    tied: bool = True,
    selective: bool = True,
) -> ModelProfile:
    """A profile of ``examples/gpt``'s GPT (tied embedding and LM head, ``depth`` blocks of attention + MLP).

    Args:
        depth: blocks.
        width: model width.
        vocab: vocabulary size.
        tokens: tokens per rank per step (batch x sequence length); activations scale with it.
        mlp_ratio: MLP hidden size over width.
        world_size: ranks the collective fits are for.
        flops_per_second: compute rate turning FLOPs into seconds (backward costs twice the forward).
        tied: tie the LM head to the embedding (else the head is its own Linear).
        selective: give the blocks figures under selective recomputation (what a version-4 profile measures): they
            keep their matrix products' and attention's outputs, and their replay runs the norms, GELU and residual
            adds (else ``None``, a profile from before).
    """
    f = 4  # fp32
    modules: dict[str, ModuleProfile] = {}

    def add(
        name: str,
        type_: str,
        shapes: list[list[int]] | None = None,
        *,
        act: int = 0,
        out: int = 0,
        flops: int = 0,
    ) -> ModuleProfile:
        parent = name.rpartition(".")[0] if name else None
        shapes = shapes or []
        count = sum(_numel(s) for s in shapes)
        mp = ModuleProfile(
            name=name,
            type=type_,
            parent=parent,
            param_count=count,
            param_bytes=count * f,
            param_shapes=shapes,
            trainable_param_bytes=count * f,
            grad_bytes=count * f,
            optim_state_bytes=2 * count * f,
            activation_bytes=act,
            output_bytes=out,
            fwd_seconds=flops / flops_per_second,
            bwd_seconds=2 * flops / flops_per_second,
            fwd_flops=flops,
        )
        modules[name] = mp
        if parent is not None:
            modules[parent].children.append(name)
        return mp

    hidden = mlp_ratio * width
    x = tokens * width * f
    add("", "GPTModule", act=tokens * vocab * f, out=4)
    add("model", "GPT", act=x, out=tokens * vocab * f)
    add("model.wte", "Embedding", [[vocab, width]], act=tokens * 8, out=x)
    add("model.wpe", "Embedding", [[tokens, width]], act=tokens * 8, out=x)
    add("model.blocks", "ModuleList")
    for i in range(depth):
        b = f"model.blocks.{i}"
        block = add(b, "Block", act=2 * x, out=x)
        if selective:
            # qkv (3x), attention (x), its projection (x), fc (the hidden width), the MLP's projection (x).
            block.selective_kept_bytes = 6 * x + tokens * hidden * f
            block.selective_replay_seconds = (2 * 5 * tokens * width + 8 * tokens * hidden) / flops_per_second
        add(f"{b}.ln_1", "LayerNorm", [[width], [width]], act=x + tokens * 8, out=x, flops=5 * tokens * width)
        add(f"{b}.attn", "CausalSelfAttention", act=4 * x, out=x, flops=4 * tokens * tokens * width // 8)
        add(
            f"{b}.attn.qkv",
            "Linear",
            [[3 * width, width], [3 * width]],
            act=x,
            out=3 * x,
            flops=2 * tokens * width * 3 * width,
        )
        add(f"{b}.attn.proj", "Linear", [[width, width], [width]], act=x, out=x, flops=2 * tokens * width * width)
        add(f"{b}.ln_2", "LayerNorm", [[width], [width]], act=x + tokens * 8, out=x, flops=5 * tokens * width)
        add(f"{b}.mlp", "MLP", act=tokens * hidden * f, out=x)
        add(
            f"{b}.mlp.fc",
            "Linear",
            [[hidden, width], [hidden]],
            act=x,
            out=tokens * hidden * f,
            flops=2 * tokens * width * hidden,
        )
        add(
            f"{b}.mlp.proj",
            "Linear",
            [[width, hidden], [width]],
            act=tokens * hidden * f,
            out=x,
            flops=2 * tokens * width * hidden,
        )
        add(f"{b}.mlp.dropout", "Dropout", out=x)
    add("model.ln_f", "LayerNorm", [[width], [width]], act=x + tokens * 8, out=x, flops=5 * tokens * width)
    head = add(
        "model.lm_head",
        "Linear",
        None if tied else [[vocab, width]],
        act=x,
        out=tokens * vocab * f,
        flops=2 * tokens * width * vocab,
    )
    if tied:
        head.grad_bytes = 0
    for mp in modules.values():
        mp.optim_state_bytes = 2 * mp.trainable_param_bytes
    return ModelProfile(
        modules=modules,
        collectives=gloo_like_collectives(world_size),
        world_size=world_size,
        device="cpu",
        mode="estimated",
        optimizer="AdamW",
        optim_state_factor=2.0,
        tied=[["model.wte", "model.lm_head"]] if tied else [],
        batch={"description": f"synthetic, {tokens} tokens per rank"},
        step_overhead_seconds=0.0,
        extra_activation_bytes=tokens * vocab * f,
        info={"source": "tests/synthetic.py:gpt_profile"},
    )


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def one_linear(
    *,
    world_size: int = 2,
    fwd: float = 1e-3,
    bwd: float = 2e-3,
    root_output_bytes: int = 4,
    collectives: dict[str, CollectiveFit] | None = None,
    **fields: Any,
) -> ModelProfile:
    """A root holding one Linear(4 -> 3): weight (3, 4) and bias (3,), fp32 (60 bytes), AdamW; its figures set by
    hand. ``collectives`` default to round figures (all-gather 1 ms + 1 MB/s, reduce-scatter 2 ms + 0.5 MB/s,
    all-reduce 0.5 ms + 2 MB/s); ``fields`` are the rest of the ``ModelProfile``'s."""
    root = ModuleProfile(name="", type="Net", parent=None, children=["a"], output_bytes=root_output_bytes)
    a = ModuleProfile(
        name="a",
        type="Linear",
        parent="",
        param_count=15,
        param_bytes=60,
        param_shapes=[[3, 4], [3]],
        trainable_param_bytes=60,
        grad_bytes=60,
        optim_state_bytes=120,
        optim_scalar_bytes=8,
        activation_bytes=100,
        output_bytes=60,
        fwd_seconds=fwd,
        bwd_seconds=bwd,
    )
    if collectives is None:
        collectives = {
            "all_gather": CollectiveFit("all_gather", world_size, 1e-3, 1e6),
            "reduce_scatter": CollectiveFit("reduce_scatter", world_size, 2e-3, 5e5),
            "all_reduce": CollectiveFit("all_reduce", world_size, 5e-4, 2e6),
        }
    return ModelProfile(
        modules={"": root, "a": a},
        collectives=collectives,
        world_size=world_size,
        optimizer="AdamW",
        optim_state_factor=2.0,
        **fields,
    )


def one_linear_on(device: str, *, fwd: float = 3e-3, bwd: float = 6e-3) -> ModelProfile:
    """:func:`one_linear` on ``device``, with a copy bandwidth of 100 kB/s (so that copies of tens of bytes take a
    visible fraction of a millisecond)."""
    return one_linear(
        fwd=fwd,
        bwd=bwd,
        device=device,
        step_overhead_seconds=10e-3,
        optimizer_step_seconds=6e-3,
        copy_bytes_per_second=1e5,
    )
