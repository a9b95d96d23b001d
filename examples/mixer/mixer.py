"""An MLP-Mixer (Tolstikhin et al., 2021) image classifier and its LightningModule.

Why this model next to the GPT example: its layers have very different shapes, which is what a per-module
sharding plan is about. A token-mixing MLP acts across the ``P`` patches (``P x token_hidden`` weights, small), a
channel-mixing MLP across the ``dim`` channels of each patch (``dim x channel_hidden`` weights, large): with the
defaults (16 patches of 8 x 8 pixels, ``dim`` 128) a block's channel-mixing MLP holds 131,712 parameters and its
token-mixing MLP 2,128, 62 times fewer, while their hidden activations are the same size. Sharding the big ones
saves much memory per collective; sharding the small ones saves little and still pays the collective's latency.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["MLPMixer", "MixerBlock", "MixerModule", "MlpBlock"]


class MlpBlock(nn.Module):
    """``Linear -> GELU -> Linear`` over the last dimension: ``dim -> hidden -> dim``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(dim, hidden)
        self.fc_2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_2(F.gelu(self.fc_1(x)))


class MixerBlock(nn.Module):
    """Token mixing across patches, then channel mixing within each patch; pre-LayerNorm, residual."""

    def __init__(self, num_patches: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(dim)
        self.token_mixing = MlpBlock(num_patches, token_hidden)
        self.norm_2 = nn.LayerNorm(dim)
        self.channel_mixing = MlpBlock(dim, channel_hidden)

    def forward(self, x: Tensor) -> Tensor:
        # x: (batch, patches, dim); token mixing runs along the patch axis, hence the transposes.
        x = x + self.token_mixing(self.norm_1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mixing(self.norm_2(x))


class MLPMixer(nn.Module):
    """Patch embedding (a strided convolution), ``depth`` Mixer blocks, LayerNorm, mean over patches, linear head.

    Args:
        image_size: input height and width (a multiple of ``patch_size``).
        in_channels: input channels.
        patch_size: side of the square patches.
        dim: channels per patch inside the blocks.
        depth: number of Mixer blocks.
        token_hidden: hidden size of the token-mixing MLPs.
        channel_hidden: hidden size of the channel-mixing MLPs.
        num_classes: outputs of the head.
    """

    def __init__(
        self,
        image_size: int = 32,
        in_channels: int = 3,
        patch_size: int = 8,
        dim: int = 128,
        depth: int = 4,
        token_hidden: int = 64,
        channel_hidden: int = 512,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
        num_patches = (image_size // patch_size) ** 2
        self.stem = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.blocks = nn.ModuleList([MixerBlock(num_patches, dim, token_hidden, channel_hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        """Class logits ``(batch, num_classes)`` for images ``(batch, in_channels, image_size, image_size)``."""
        x = self.stem(images).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


class MixerModule(L.LightningModule):
    """Trains :class:`MLPMixer` with cross-entropy; logs loss and accuracy.

    ``train_acc`` is this rank's batch accuracy averaged over ranks (``sync_dist=True``); ``val_acc`` is a
    torchmetrics accuracy over the whole validation set, whose counts are summed across ranks when computed.

    Args:
        image_size, in_channels, patch_size, dim, depth, token_hidden, channel_hidden, num_classes: see
            :class:`MLPMixer`.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay (matrices only).
        lr_schedule: ``"cosine"`` (decay to zero at the last step) or ``"constant"``.
    """

    def __init__(
        self,
        image_size: int = 32,
        in_channels: int = 3,
        patch_size: int = 8,
        dim: int = 128,
        depth: int = 4,
        token_hidden: int = 64,
        channel_hidden: int = 512,
        num_classes: int = 10,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        lr_schedule: Literal["cosine", "constant"] = "cosine",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = MLPMixer(
            image_size, in_channels, patch_size, dim, depth, token_hidden, channel_hidden, num_classes
        )
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, images: Tensor) -> Tensor:
        """Class logits."""
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Cross-entropy of one batch; logs ``train_loss`` and ``train_acc``."""
        images, labels = batch
        logits = self(images).float()
        loss = F.cross_entropy(logits, labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_acc", self.train_acc(logits.detach().argmax(-1), labels), prog_bar=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.train_acc.reset()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Accumulates validation accuracy; logs ``val_loss`` and ``val_acc``."""
        images, labels = batch
        logits = self(images).float()
        self.val_acc.update(logits.argmax(-1), labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        # A Metric object reduces its own states across ranks in compute(); sync_dist only matters for tensors.
        self.log("val_acc", self.val_acc, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        """AdamW (no weight decay on biases and norms) and the optional cosine schedule."""
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp["lr"],
        )
        if hp["lr_schedule"] == "constant":
            return optimizer
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
