"""User-style LightningModules: the code OSDP's users write, not models written for OSDP.

Each module is written the way its library's users write one (the Lightning, Hugging Face, litgpt and torchmetrics
tutorials): steps that log ``loss.item()``, branch on values, all-gather for logging, route tokens with ``nonzero``,
take dict batches, pad each batch to its own length, freeze a backbone, accumulate and clip, build their layers in
``configure_model``. Nothing here knows about OSDP. ``CASES`` names each with its data and Trainer arguments;
``tests/distributed/corpus_runner.py`` trains them under ``strategy="osdp"`` and Lightning's DDP.

timm's ResNet and ViT need torchvision, whose PyPI wheels are built against CUDA torch and do not import beside the CPU
build this suite pins (``operator torchvision::nms does not exist``); Hugging Face's ResNet (BatchNorm) and ViT stand
in for them here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 96


def quiet_hf() -> None:
    """Hugging Face's config warnings about token ids outside a tiny vocabulary are not this suite's business."""
    import transformers

    transformers.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------------------- data
class RandomTokens(Dataset[dict[str, Tensor]]):
    """Token sequences, as a tokenized corpus gives them: a dict per sample."""

    def __init__(self, n: int = 32, length: int = 24, lengths: tuple[int, ...] | None = None) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.samples = []
        for i in range(n):
            size = lengths[i % len(lengths)] if lengths else length
            self.samples.append(torch.randint(1, VOCAB, (size,), generator=generator))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.samples[i]}


def pad_collate(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Pads each batch to its own longest sequence (a data collator's ``padding="longest"``)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = sample["input_ids"]
        mask[row, : len(sample["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class RandomImages(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int = 32, size: int = 32, classes: int = 4) -> None:
        generator = torch.Generator().manual_seed(99)
        self.images = torch.randn(n, 3, size, size, generator=generator)
        self.labels = torch.randint(0, classes, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.images[i], self.labels[i]


class RandomFeatures(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int = 64, features: int = 32, classes: int = 5) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, features, generator=generator)
        self.y = torch.randint(0, classes, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


# ---------------------------------------------------------------------------------------------------------- modules
class LossRecorder(L.LightningModule):
    """What the tests read back: every step's loss, as a user's ``self.losses.append(loss.item())`` keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []


class GPT2FineTune(LossRecorder):
    """Hugging Face GPT-2 with ``labels=``; logs ``out.loss.item()`` (the model computes its own loss)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(**batch)
        self.losses.append(out.loss.item())
        self.log("train_loss", out.loss.item(), prog_bar=True)
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=5e-4, weight_decay=0.01)


class LlamaPretrained(LossRecorder):
    """Hugging Face Llama held as ``self.model``, as ``docs/large-models.md`` shows it for ``pretrained=``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(llama_config())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.losses.append(float(loss))
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


class ResNetClassifier(LossRecorder):
    """Hugging Face ResNet (BatchNorm, in for timm's): accuracy logged every step, a validation loop."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=4)
        self.model = ResNetForImageClassification(config)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=4)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self.model(pixel_values=images).logits
        loss = F.cross_entropy(logits, labels)
        self.accuracy(logits, labels)
        self.log("train_acc", self.accuracy, on_step=True)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.log("val_loss", F.cross_entropy(self.model(pixel_values=images).logits, labels))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3)}


class ViTClassifier(LossRecorder):
    """Hugging Face ViT (in for timm's), with label smoothing and a cosine schedule."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        self.model = ViTForImageClassification(config)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(pixel_values=images).logits, labels, label_smoothing=0.1)
        self.losses.append(loss.item())
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)]


class LitGPTModule(LossRecorder):
    """litgpt's GPT as its pretraining script drives it: its own loss over shifted targets; gradient accumulation with
    clipping comes from the Trainer."""

    def __init__(self) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT

        self.config = Config(
            block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, bias=False,
            rotary_percentage=1.0, parallel_residual=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
            intermediate_size=64,
        )  # fmt: skip
        self.model = GPT(self.config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        from litgpt.utils import chunked_cross_entropy

        ids = batch["input_ids"]
        logits = self.model(ids[:, :-1])
        loss = chunked_cross_entropy(logits, ids[:, 1:])
        self.losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


class MetricsClassifier(LossRecorder):
    """A torchmetrics-heavy classifier: a MetricCollection updated in the step, computed and reset at epoch end."""

    def __init__(self, features: int = 32, classes: int = 5) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, classes)
        )
        metrics = torchmetrics.MetricCollection(
            {
                "acc": torchmetrics.classification.MulticlassAccuracy(num_classes=classes),
                "f1": torchmetrics.classification.MulticlassF1Score(num_classes=classes, average="macro"),
                "auroc": torchmetrics.classification.MulticlassAUROC(num_classes=classes),
            }
        )
        self.train_metrics = metrics.clone(prefix="train_")
        self.epoch_metrics: list[dict[str, float]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_metrics.update(logits.softmax(-1), y)
        self.losses.append(loss.item())
        return loss

    def on_train_epoch_end(self) -> None:
        computed = self.train_metrics.compute()
        self.epoch_metrics.append({k: float(v) for k, v in computed.items()})
        self.log_dict(computed)
        self.train_metrics.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class GAN(LossRecorder):
    """A GAN under manual optimization, written as Lightning's GAN tutorial writes it."""

    def __init__(self, latent: int = 16, features: int = 32) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.latent = latent
        self.generator = nn.Sequential(nn.Linear(latent, 64), nn.LeakyReLU(0.2), nn.Linear(64, features), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(features, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], self.latent, device=self.device)

        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(real.shape[0], 1))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), torch.ones(real.shape[0], 1))
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), torch.zeros(real.shape[0], 1))
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.losses.append(g_loss.item() + d_loss.item())
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        ]


class GuardedLM(LossRecorder):
    """A step that skips a non-finite loss, logs every k batches with ``loss.item()`` and an all-gathered mean, and
    prints a progress line: what long pretraining scripts do."""

    def __init__(self, log_every: int = 2) -> None:
        super().__init__()
        self.log_every = log_every
        self.embed = nn.Embedding(VOCAB, 32)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True), num_layers=2
        )
        self.lm_head = nn.Linear(32, VOCAB)
        self.skipped = 0

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        ids = batch["input_ids"]
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1] - 1)
        logits = self.lm_head(self.encoder(self.embed(ids[:, :-1]), mask=mask, is_causal=True))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            self.skipped += 1
            return None
        if batch_idx % self.log_every == 0:
            mean = self.all_gather(loss.detach()).mean()
            self.print(f"batch {batch_idx}: loss {loss.item():.4f} (mean over ranks {float(mean):.4f})")
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class MixtralMoE(LossRecorder):
    """Hugging Face Mixtral: a sparse mixture of experts with top-2 routing (per-expert token lists, ``index_add_``),
    with its router's load-balancing loss."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            output_router_logits=True, router_aux_loss_coef=0.01,
        )  # fmt: skip
        self.model = MixtralForCausalLM(config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        self.losses.append(out.loss.item())
        self.log_dict({"loss": out.loss, "aux_loss": out.aux_loss})
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class HandMoE(LossRecorder):
    """A mixture-of-experts layer as a user writes one: top-k gate, ``nonzero`` per expert, ``index_select`` and
    ``index_add_`` (the shapes of every expert's batch depend on the routing)."""

    def __init__(self, width: int = 32, experts: int = 4, k: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.k = k
        self.inp = nn.Linear(32, width)
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(experts)
        )
        self.out = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        weights, chosen = self.gate(h).softmax(-1).topk(self.k, dim=-1)
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            routed = expert(h.index_select(0, rows)) * weights[rows, slot].unsqueeze(-1)
            mixed = mixed.index_add(0, rows, routed)
        return self.out(h + mixed)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class FrozenBackboneAdapters(LossRecorder):
    """A frozen pretrained-style backbone (GPT-2) with small trainable bottleneck adapters after each block."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        self.backbone = GPT2Model(config)
        self.backbone.requires_grad_(False)
        self.adapters = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 32)) for _ in range(config.n_layer)
        )
        for block, adapter in zip(self.backbone.h, self.adapters, strict=True):
            block.register_forward_hook(lambda _m, _i, out, adapter=adapter: _adapt(out, adapter))
        self.head = nn.Linear(32, VOCAB)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        hidden = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        logits = self.head(hidden[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class LazyEncoder(LossRecorder):
    """Layers built in ``configure_model`` (Lightning's hook for sharded strategies) from ``torch.nn``'s own
    ``TransformerEncoder``; a metric object logged, a OneCycle schedule over ``trainer.estimated_stepping_batches``
    stepped every batch, ``self.print`` of the loss every few steps, a validation loop logging with ``sync_dist``."""

    def __init__(self, tokens: int = 4, width: int = 32, depth: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder: nn.Module | None = None
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=classes)

    def configure_model(self) -> None:
        if self.encoder is not None:
            return
        h = self.hparams
        self.embed = nn.Linear(32 // h.tokens, h.width)
        layer = nn.TransformerEncoderLayer(h.width, 2, 2 * h.width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, h.depth, enable_nested_tensor=False)
        self.head = nn.Linear(h.width, h.classes)

    def forward(self, x: Tensor) -> Tensor:
        assert self.encoder is not None
        tokens = self.embed(x.view(x.shape[0], self.hparams.tokens, -1))
        return self.head(self.encoder(tokens).mean(1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.losses.append(loss.item())
        if self.global_step % 3 == 0:
            self.print(f"step {self.global_step}: loss {loss.item():.4f}")
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _adapt(out: Any, adapter: nn.Module) -> Any:
    hidden = out[0] if isinstance(out, tuple) else out
    hidden = hidden + adapter(hidden)
    return (hidden, *out[1:]) if isinstance(out, tuple) else hidden


# ---------------------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """A corpus case: the module, its data, the Trainer's arguments, and whether it is also built on meta (with
    pretrained weights, so that DDP starts from the same ones)."""

    build: Callable[[], L.LightningModule]
    loader: Callable[[], DataLoader[Any]]
    trainer: dict[str, Any] = field(default_factory=dict)
    meta: bool = False
    #: DDP's ``find_unused_parameters`` (manual optimization that toggles optimizers, routing that skips experts)
    unused_parameters: bool = False
    #: The optimizer class the budgets are computed with, for a module whose ``configure_optimizers`` reads its
    #: Trainer (``estimated_stepping_batches``): the budgets are profiled outside one (``None``: the module's own)
    optimizer: type[torch.optim.Optimizer] | None = None


def _tokens(batch_size: int = 4, **kwargs: Any) -> Callable[[], DataLoader[Any]]:
    return lambda: DataLoader(RandomTokens(**kwargs), batch_size=batch_size, shuffle=True, collate_fn=pad_collate)


CASES: dict[str, Case] = {
    "gpt2": Case(GPT2FineTune, _tokens()),
    "llama": Case(LlamaPretrained, _tokens(), meta=True),
    "resnet": Case(
        ResNetClassifier, lambda: DataLoader(RandomImages(), batch_size=8, shuffle=True), {"limit_val_batches": 2}
    ),
    "vit": Case(ViTClassifier, lambda: DataLoader(RandomImages(), batch_size=8, shuffle=True)),
    "litgpt": Case(LitGPTModule, _tokens(), {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}),
    "metrics": Case(MetricsClassifier, lambda: DataLoader(RandomFeatures(), batch_size=16, shuffle=True)),
    "gan": Case(GAN, lambda: DataLoader(RandomFeatures(), batch_size=16, shuffle=True), unused_parameters=True),
    "guarded": Case(GuardedLM, _tokens()),
    "mixtral": Case(MixtralMoE, _tokens(), unused_parameters=True),
    "moe": Case(HandMoE, lambda: DataLoader(RandomFeatures(), batch_size=16, shuffle=True), unused_parameters=True),
    # Sequence lengths vary per batch (padded to each batch's longest); the first batch is not the longest.
    "varlen": Case(GPT2FineTune, _tokens(lengths=(8, 12, 10, 9, 30, 11, 7, 14))),
    "adapters": Case(FrozenBackboneAdapters, _tokens(lengths=(20, 24, 16, 24))),
    "lazy": Case(
        LazyEncoder,
        lambda: DataLoader(RandomFeatures(), batch_size=16, shuffle=True),
        {"limit_val_batches": 2},
        optimizer=torch.optim.AdamW,
    ),
}
