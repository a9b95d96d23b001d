"""A Llama-shaped decoder (Llama 2/3 architecture) and the LightningModule that trains it as a language model.

The architecture of Meta's Llama 3 as torchtitan writes it (``torchtitan/models/llama3/model``), in plain PyTorch:
pre-normalisation with RMSNorm, grouped-query attention (``n_kv_heads`` key/value heads shared by groups of query
heads) with rotary position embeddings, a SwiGLU feed-forward network, and an output head that is not tied to the
token embedding. Module names follow torchtitan's (``tok_embeddings``, ``layers.N.attention.wq``,
``layers.N.feed_forward.w1``, ``norm``, ``output``), so that a plan reads like torchtitan's wrapping.

At the default size it trains on a CPU in seconds (``examples/llama/train.py``); at Llama 3.1 8B's shape
(:data:`LLAMA3_1_8B`) it is what ``osdp plan`` profiles on fake tensors, without weights or a GPU::

    osdp plan --model examples/llama/llama.py:LlamaModule --init-args "$(python -c 'import json, sys;
        sys.path.insert(0, "examples/llama"); from llama import LLAMA3_1_8B; print(json.dumps(LLAMA3_1_8B))')" ...

or ``osdp plan --config examples/llama/configs/llama3_1_8b.yaml``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "LLAMA3_1_8B",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaModule",
    "RMSNorm",
    "TransformerBlock",
    "apply_rotary",
    "ffn_hidden_size",
    "rotary_tables",
]

#: Llama 3.1 8B's shape (Meta's ``params.json``; torchtitan's ``llama3_configs["8B"]``) at torchtitan's training
#: sequence length of 8,192: 8.03B parameters.
LLAMA3_1_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "context_length": 8192,
    "dim": 4096,
    "n_layers": 32,
    "n_heads": 32,
    "n_kv_heads": 8,
    "multiple_of": 1024,
    "ffn_dim_multiplier": 1.3,
    "rope_theta": 500000.0,
}


def ffn_hidden_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's SwiGLU width: two thirds of ``4 * dim`` (SwiGLU has three matrices where a GELU MLP has two), scaled
    by ``ffn_dim_multiplier`` and rounded up to a multiple of ``multiple_of`` (14,336 for Llama 3 8B)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale, computed in float32 whatever the input's dtype.

    Written out rather than ``nn.RMSNorm`` so that its precision is the same under every Lightning precision and
    under autocast (as in Meta's reference code): the mean of squares of a wide bf16 activation loses precision,
    and autocast's rules for normalisation ops differ between devices.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_tables(head_dim: int, length: int, theta: float) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of the rotary angles, ``(length, head_dim // 2)`` each, in float32."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inverse)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each consecutive pair of ``x``'s last dimension (``(batch, time, heads, head_dim)``) by its
    position's angle (the interleaved pairing of Meta's complex-number form, in real arithmetic), in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs.unbind(-1)
    c, s = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.stack((real * c - imag * s, real * s + imag * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings, through ``F.scaled_dot_product_attention``.

    Keys and values have ``n_kv_heads`` heads, each shared by ``n_heads / n_kv_heads`` query heads; they are
    repeated to ``n_heads`` before attention, as torchtitan does (``repeat_kv``).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"dim {dim} must be divisible by n_heads {n_heads}, and n_heads by n_kv_heads {n_kv_heads}"
            )
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """``h = x + attention(attention_norm(x))``, then ``h + feed_forward(ffn_norm(h))``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim, eps)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token embedding, ``n_layers`` blocks, final RMSNorm and an untied output head.

    Args:
        vocab_size: number of token ids.
        context_length: longest sequence (the size of the rotary tables).
        dim: model width.
        n_layers: blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (``None``: ``n_heads``, plain multi-head attention).
        multiple_of, ffn_dim_multiplier: the SwiGLU width (:func:`ffn_hidden_size`).
        norm_eps: RMSNorm's epsilon.
        rope_theta: the rotary embeddings' base.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        context_length: int = 64,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int | None = 2,
        multiple_of: int = 32,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        hidden = ffn_hidden_size(dim, multiple_of, ffn_dim_multiplier)
        self.context_length = context_length
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            [TransformerBlock(dim, n_heads, n_kv_heads, hidden, norm_eps) for _ in range(n_layers)]
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        # Buffers, not parameters: nothing to shard, and not saved in checkpoints (they are a function of the shape).
        cos, sin = rotary_tables(dim // n_heads, context_length, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        # N(0, 0.02) everywhere; the projections that write into the residual stream scaled by 1/sqrt(2 * n_layers),
        # so that the residual's variance does not grow with depth.
        for name, param in self.named_parameters():
            if param.ndim < 2:
                continue
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(param, std=std)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(batch, time, vocab_size)`` for token ids ``(batch, time)``."""
        if tokens.shape[1] > self.context_length:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds context_length {self.context_length}")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


class LlamaModule(L.LightningModule):
    """Trains :class:`Llama` on next-token prediction; logs ``train_loss`` and ``val_loss`` (averaged over ranks).

    A batch is windows of ``context_length + 1`` token ids (inputs and next-token targets, as in ``examples/gpt``),
    which is also what ``osdp plan`` makes from ``context_length`` when it is given no batch.

    Args:
        vocab_size, context_length, dim, n_layers, n_heads, n_kv_heads, multiple_of, ffn_dim_multiplier, norm_eps,
            rope_theta: see :class:`Llama`.
        lr: AdamW's peak learning rate (reached after ``warmup_steps`` of linear warm-up, then constant).
        weight_decay: AdamW's decoupled weight decay on matrices and embeddings (not on RMSNorm scales).
        betas: AdamW's betas.
        warmup_steps: linear warm-up length.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        context_length: int = 64,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int | None = 2,
        multiple_of: int = 32,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 5,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Llama(
            vocab_size,
            context_length,
            dim,
            n_layers,
            n_heads,
            n_kv_heads,
            multiple_of,
            ffn_dim_multiplier,
            norm_eps,
            rope_theta,
        )

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits for token ids ``tokens``."""
        return self.model(tokens)

    def _loss(self, batch: Tensor) -> Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        # float(): the softmax behind the loss runs in float32 under any precision (as torchtitan's loss does).
        logits = self(inputs).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """Next-token cross-entropy of one batch."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        """Next-token cross-entropy of one validation batch."""
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        """AdamW (decay on matrices and embeddings only) with a linear warm-up; needs no Trainer, so a dry run reads
        the optimizer from here."""
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp["lr"],
            betas=tuple(hp["betas"]),
        )
        warmup = max(int(hp["warmup_steps"]), 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
