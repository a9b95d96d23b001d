"""A synthetic, learnable image-classification task, generated deterministically (nothing to download).

Each class has a prototype: a smooth random colour field (a coarse ``grid x grid`` random image, upsampled
bilinearly). A sample of class ``c`` is that prototype cyclically shifted by a random offset, scaled by a random
contrast, plus Gaussian pixel noise. The shift means a model must recognise the pattern wherever it lies, which an
MLP-Mixer does by mixing information across patches (its token-mixing MLPs) and pooling.

Every sample is a pure function of ``(seed, index)``: it is generated on the fly from its own random generator, so
the data set costs no memory, any rank or worker produces the same sample for the same index, and training and
validation (disjoint index ranges) never share a sample.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

__all__ = ["SyntheticImageDataModule", "SyntheticImages", "class_prototypes"]


def class_prototypes(num_classes: int, channels: int, image_size: int, grid: int, seed: int) -> Tensor:
    """``(num_classes, channels, image_size, image_size)`` smooth random fields, each of zero mean and unit std."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, grid, grid, generator=g)
    fields = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    fields = fields - fields.mean(dim=(1, 2, 3), keepdim=True)
    return fields / fields.std(dim=(1, 2, 3), keepdim=True)


class SyntheticImages(Dataset[tuple[Tensor, Tensor]]):
    """``length`` samples with indices ``start .. start + length - 1``; item ``i`` is ``(image, label)``.

    The label of index ``n`` is ``n % num_classes``, so every class is equally frequent and chance accuracy is
    exactly ``1 / num_classes``.
    """

    def __init__(
        self,
        prototypes: Tensor,
        length: int,
        start: int = 0,
        max_shift: int = 4,
        noise: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.prototypes = prototypes
        self.length = length
        self.start = start
        self.max_shift = max_shift
        self.noise = noise
        self.seed = seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        n = self.start + i
        label = n % len(self.prototypes)
        # One generator per sample, seeded from (seed, index): reproducible in any order, on any rank or worker.
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + n)
        shift = torch.randint(-self.max_shift, self.max_shift + 1, (2,), generator=g).tolist()
        contrast = 0.5 + torch.rand((), generator=g)
        image = contrast * torch.roll(self.prototypes[label], shifts=shift, dims=(1, 2))
        image = image + self.noise * torch.randn(image.shape, generator=g)
        return image, torch.tensor(label)


class SyntheticImageDataModule(L.LightningDataModule):
    """Training and validation splits of the synthetic task (see the module docstring).

    Args:
        num_classes: number of classes (and prototypes).
        channels: image channels.
        image_size: height and width in pixels.
        grid: resolution of the random field behind each prototype; lower is smoother.
        train_size: training samples.
        val_size: validation samples.
        max_shift: largest cyclic shift, in pixels, along each axis.
        noise: standard deviation of the pixel noise (prototypes have unit standard deviation).
        batch_size: samples per batch and per process.
        num_workers: DataLoader worker processes.
        seed: seeds the prototypes and every sample.
    """

    def __init__(
        self,
        num_classes: int = 10,
        channels: int = 3,
        image_size: int = 32,
        grid: int = 4,
        train_size: int = 8192,
        val_size: int = 1024,
        max_shift: int = 8,
        noise: float = 2.0,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.channels = channels
        self.image_size = image_size
        self.grid = grid
        self.train_size = train_size
        self.val_size = val_size
        self.max_shift = max_shift
        self.noise = noise
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.train_set: SyntheticImages | None = None
        self.val_set: SyntheticImages | None = None

    def setup(self, stage: str | None = None) -> None:
        """Build the prototypes and the two index ranges (samples are generated when read)."""
        prototypes = class_prototypes(self.num_classes, self.channels, self.image_size, self.grid, self.seed)
        self.train_set = SyntheticImages(prototypes, self.train_size, 0, self.max_shift, self.noise, self.seed)
        # Validation indices follow the training ones: same distribution, no shared sample.
        self.val_set = SyntheticImages(
            prototypes, self.val_size, self.train_size, self.max_shift, self.noise, self.seed
        )

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Shuffled training samples (Lightning swaps in a ``DistributedSampler`` on several processes)."""
        assert self.train_set is not None, "call setup() first"
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, drop_last=True
        )

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Validation samples in index order."""
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
