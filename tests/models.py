"""A small GPT-like LightningModule that exercises what real models have and sharding gets wrong.

Tied embedding/LM-head weights, a positional-embedding ``nn.Parameter`` directly on the LightningModule,
LayerNorms and biases, a frozen (``requires_grad=False``) submodule, and dimensions that the world size does not
divide (vocabulary 37, width 21, MLP 85).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.utils.checkpoint
import torchmetrics
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(width)
        # NOTE: no attention biases. The key bias has an exactly-zero gradient (softmax is shift-invariant), so
        # its computed gradient is pure rounding noise, which Adam normalises into lr-sized random steps: a
        # parameter whose trajectory depends on summation order would make any parity test meaningless.
        self.attn = nn.MultiheadAttention(width, num_heads=3, batch_first=True, bias=False)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln_1(x)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        x = x + self._drop(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
        return x + self._drop(self.proj(torch.nn.functional.gelu(self.fc(self.ln_2(x)))))

    def _drop(self, x: Tensor) -> Tensor:
        # Functional, so that a model without dropout has the same modules as before it existed.
        return torch.nn.functional.dropout(x, self.dropout, self.training) if self.dropout else x


def _by_hand_selective() -> Any:
    from lightning_osdp.apply.recompute import SAVED_OPERATORS

    return torch.utils.checkpoint.create_selective_checkpoint_contexts(sorted(SAVED_OPERATORS, key=str))


class TinyGPT(L.LightningModule):
    """Decoder-only LM; ``training_step`` returns the next-token cross-entropy."""

    def __init__(
        self,
        vocab: int = 37,
        width: int = 21,
        hidden: int = 85,
        layers: int = 3,
        context: int = 16,
        lr: float = 1e-2,
        optimizer: str = "adamw",
        dropout: float = 0.0,
        checkpointed: tuple[int, ...] = (),
        selective: tuple[int, ...] = (),
    ) -> None:
        """``checkpointed``: blocks whose forward the model itself runs under ``torch.utils.checkpoint`` (as a user
        checkpoints by hand): the reference OSDP's recomputation is compared with. ``selective``: blocks it runs under
        selective checkpointing by hand, torch's ``create_selective_checkpoint_contexts`` given the list of operators
        OSDP keeps (the list form of the policy, not OSDP's policy function)."""
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(context, width) * 0.02)
        self.h = nn.ModuleList([Block(width, hidden, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        # A frozen adapter: its parameters never receive gradients.
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.val_loss = torchmetrics.MeanMetric()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab, average="micro")
        self.losses: list[float] = []
        self.seen: list[int] = []

    def reset_parameters(self) -> None:
        """The LightningModule's own parameter, for a model built on the meta device (its submodules have theirs)."""
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.pos[: idx.shape[1]]
        x = x + 0.1 * self.frozen(x)
        for i, block in enumerate(self.h):
            if i in self.hparams.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            elif i in self.hparams.selective:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=_by_hand_selective)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def _loss(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        return loss, logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, tokens = batch
        self.seen.extend(ids.tolist())
        loss, _ = self._loss(tokens)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        _, tokens = batch
        loss, logits = self._loss(tokens)
        self.val_loss.update(loss)
        self.val_acc.update(logits.argmax(-1).flatten(), tokens[:, 1:].flatten())
        self.log("val_loss_sync", loss, sync_dist=True)
        self.log("val_loss", self.val_loss)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        _, tokens = batch
        loss, _ = self._loss(tokens)
        self.log("test_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class TokenDataset(Dataset[tuple[int, Tensor]]):
    """Deterministic random token sequences with a learnable pattern; item ``i`` is ``(i, tokens)``."""

    def __init__(self, n: int = 64, length: int = 17, vocab: int = 37, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + step * torch.arange(length)) % vocab
        noise = torch.rand(n, length, generator=g) < 0.1
        self.data[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[int, Tensor]:
        return i, self.data[i]


def loaders(batch_size: int = 4, n: int = 64) -> tuple[DataLoader, DataLoader]:
    train = DataLoader(TokenDataset(n), batch_size=batch_size, shuffle=True)
    val = DataLoader(TokenDataset(16, seed=99), batch_size=batch_size)
    return train, val


class BackwardBuffer(Callback):
    """Holds ``nbytes`` from just before backward to just after: memory the profiled step never sees."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffer: Tensor | None = None

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.buffer = None


class ConvBlock(nn.Module):
    """Conv, BatchNorm (running statistics updated in every training forward), ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.bn(self.conv(x)))


class BatchNormCNN(L.LightningModule):
    """Three conv-BN-ReLU blocks and a Linear head on 8x8 images: a model whose forward mutates its buffers."""

    def __init__(self, width: int = 16, classes: int = 5, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.blocks = nn.Sequential(ConvBlock(3, width), ConvBlock(width, width), ConvBlock(width, width))
        self.head = nn.Linear(width * 8 * 8, classes)
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x).flatten(1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        # Evaluation reads the running statistics: wrong statistics show here.
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class ImageDataset(Dataset[tuple[Tensor, Tensor]]):
    """Deterministic random 3x8x8 images whose class is set by a per-class offset, different on every item."""

    def __init__(self, n: int = 64, classes: int = 5, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = torch.randn(n, 3, 8, 8, generator=g) + self.y[:, None, None, None] * 0.3

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class ManualGAN(L.LightningModule):
    """A GAN-style module under manual optimization: two optimizers, ``self.optimizers()``, ``manual_backward``,
    ``toggle_optimizer``, ``clip_gradients`` and a scheduler stepped by hand (what GAN and RL modules do)."""

    def __init__(self, noise: int = 8, width: int = 24, features: int = 12, clip: float | None = 0.5) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.save_hyperparameters()
        self.generator = nn.Sequential(nn.Linear(noise, width), nn.Tanh(), nn.Linear(width, features))
        self.discriminator = nn.Sequential(nn.Linear(features, width), nn.Tanh(), nn.Linear(width, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        # Generator: fool the discriminator.
        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = nn.functional.softplus(-self.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        if self.hparams.clip:
            self.clip_gradients(opt_g, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        # Discriminator: tell real from (detached) fake.
        self.toggle_optimizer(opt_d)
        d_loss = (
            nn.functional.softplus(-self.discriminator(real)).mean()
            + nn.functional.softplus(self.discriminator(fake.detach())).mean()
        )
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.lr_schedulers()[1].step()  # type: ignore[index]
        self.losses.extend([g_loss.item(), d_loss.item()])
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.AdamW(self.generator.parameters(), lr=1e-2)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=5e-2, momentum=0.9)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 2), torch.optim.lr_scheduler.StepLR(opt_d, 3)]


class GANDataset(Dataset[tuple[Tensor, Tensor]]):
    """Real samples (a shifted Gaussian) paired with noise, deterministic."""

    def __init__(self, n: int = 64, noise: int = 8, features: int = 12, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.real = torch.randn(n, features, generator=g) * 0.5 + 1.0
        self.z = torch.randn(n, noise, generator=g)

    def __len__(self) -> int:
        return len(self.real)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.real[i], self.z[i]


def quiet_trainer(strategy: Any, *, devices: int = 2, **kwargs: Any) -> L.Trainer:
    """A CPU Trainer for the tests' runs: no logger, checkpoints, progress bar or model summary unless asked."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(strategy=strategy, **{**settings, **kwargs})


def gpt_step(
    root: nn.Module, optimizer: torch.optim.Optimizer, tokens: Tensor, between: Callable[[], None] | None = None
) -> None:
    """One step of TinyGPT's own loss (what its training_step, which a profile runs, computes) through ``root`` (the
    model as a plan applied it); ``between`` runs after the loss and after the backward (a memory window's edges)."""
    loss = nn.functional.cross_entropy(root(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    if between is not None:
        between()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if between is not None:
        between()
    optimizer.step()


def step_over_budget(message: str) -> bool:
    """Whether a warning is the prediction check's that a training step went over the budget (not setup's, which a
    model built whole before sharding gives at budgets below its full size)."""
    return "over the memory budget" in message and "setup's peak" not in message
