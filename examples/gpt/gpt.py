"""A small GPT-style decoder and the LightningModule that trains it as a byte-level language model.

The model is plain PyTorch with nothing OSDP-specific in it: the strategy shards it from the outside, module by
module, as the plan says. What matters to the planner is its shape: the tied embedding/LM head (one parameter
used by two modules, so they must share one FSDP group), the learned positional embedding, and a stack of
identical blocks whose MLPs hold two thirds of each block's weights.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTModule", "cosine_with_warmup"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``.

    ``qkv`` is one ``Linear`` (one matmul, one parameter to gather) rather than three, as in GPT-2.
    """

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """The position-wise feed-forward network: ``width -> mlp_ratio * width -> width`` with GELU."""

    def __init__(self, width: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm Transformer decoder block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, mlp_ratio * width, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only Transformer: token + learned positional embeddings, ``depth`` blocks, final LayerNorm, and an
    LM head whose weight *is* the token embedding's (weight tying, as in GPT-2).

    Args:
        vocab_size: number of token ids (256 for bytes).
        context_length: longest sequence; the size of the positional embedding table.
        width: model (embedding) dimension.
        depth: number of blocks.
        heads: attention heads per block.
        mlp_ratio: MLP hidden size as a multiple of ``width``.
        dropout: dropout on embeddings, attention weights and MLP outputs.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        context_length: int = 64,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.context_length = context_length
        self.wte = nn.Embedding(vocab_size, width)
        self.wpe = nn.Embedding(context_length, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(width, heads, mlp_ratio, dropout) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights(depth)

    def _init_weights(self, depth: int) -> None:
        # GPT-2's scheme: N(0, 0.02) everywhere, and the projections that write into the residual stream scaled by
        # 1/sqrt(2 * depth) so that the residual's variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * depth))

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(batch, time, vocab_size)`` for token ids ``idx`` of shape ``(batch, time)``."""
        t = idx.shape[1]
        if t > self.context_length:
            raise ValueError(f"sequence length {t} exceeds context_length {self.context_length}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTModule(L.LightningModule):
    """Trains :class:`GPT` on next-token prediction; logs loss, perplexity and next-token accuracy.

    Training metrics are per-step values of this rank's batch, averaged over ranks by ``sync_dist=True``.
    Validation metrics are torchmetrics objects accumulated over the whole validation set; they synchronise their
    states across ranks when computed (sum of log-likelihoods and token counts), so ``val_ppl`` is the exact
    corpus perplexity, not a mean of per-batch perplexities.

    Args:
        vocab_size, context_length, width, depth, heads, mlp_ratio, dropout: see :class:`GPT`.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only (not to biases and norms).
        betas: AdamW betas.
        lr_schedule: ``"cosine"`` (linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step)
            or ``"constant"``.
        warmup_steps: linear warm-up length of the cosine schedule.
        min_lr_ratio: final learning rate of the cosine schedule as a fraction of ``lr``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        context_length: int = 64,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        lr_schedule: Literal["cosine", "constant"] = "cosine",
        warmup_steps: int = 5,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab_size, context_length, width, depth, heads, mlp_ratio, dropout)
        self.train_ppl = Perplexity()
        self.train_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.val_ppl = Perplexity()
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")

    def init_weights(self) -> None:
        """GPT-2's initialization, for a model built on the meta device: OSDP calls it once the model is sharded and
        materialized (``trainer.init_module(empty_init=True)``, see docs/large-models.md)."""
        self.model._init_weights(self.hparams.depth)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits for token ids ``idx``."""
        return self.model(idx)

    def _step(self, batch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # A batch is windows of context_length + 1 tokens: inputs and next-token targets are the same window
        # shifted by one.
        inputs, targets = batch[:, :-1], batch[:, 1:]
        # float(): under bf16 precision the softmax behind the loss and the perplexity must not run in bf16.
        logits = self(inputs).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss, logits, targets

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """Next-token cross-entropy of one batch; logs ``train_loss``, ``train_ppl`` and ``train_acc``."""
        loss, logits, targets = self._step(batch)
        logits = logits.detach()
        # Metric.forward returns this batch's value (and accumulates); the tensor is then averaged over ranks.
        ppl = self.train_ppl(logits, targets)
        acc = self.train_acc(logits.argmax(-1).flatten(), targets.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_ppl", ppl, prog_bar=True, sync_dist=True)
        self.log("train_acc", acc, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.train_ppl.reset()
        self.train_acc.reset()

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        """Accumulates validation perplexity and accuracy; logs them (and ``val_loss``) at the epoch's end."""
        loss, logits, targets = self._step(batch)
        self.val_ppl.update(logits, targets)
        self.val_acc.update(logits.argmax(-1).flatten(), targets.flatten())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        # Metric objects reduce their own states across ranks in compute(); sync_dist only matters for tensors.
        self.log("val_ppl", self.val_ppl, prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        """AdamW with decoupled weight decay on matrices and embeddings, and the optional cosine schedule."""
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        # parameters() yields the tied embedding/head weight once, so AdamW steps it once.
        for param in self.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp["lr"],
            betas=tuple(hp["betas"]),
        )
        if hp["lr_schedule"] == "constant":
            return optimizer
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: cosine_with_warmup(step, total, hp["warmup_steps"], hp["min_lr_ratio"])
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def cosine_with_warmup(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up over ``warmup_steps``, then cosine decay to ``min_ratio`` at
    ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
