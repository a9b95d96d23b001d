"""The examples under ``examples/``: their data, their models, their configs, and one real 2-process run.

Model and data tests run in this process on one CPU device (no strategy needed); the configs are instantiated
through each example's LightningCLI without training; one test (``distributed``, ``slow``) trains the GPT example
for a few steps on 2 CPU processes through its own command line, exactly as the README says to.
"""

from __future__ import annotations

import csv
import importlib.util
import itertools
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import pytest
import torch

from lightning_osdp import OSDPStrategy, Plan, parse_memory_budget
from lightning_osdp.apply import plan_units

from conftest import ROOT, run_example

GPT_DIR = ROOT / "examples" / "gpt"
MIXER_DIR = ROOT / "examples" / "mixer"
# The examples import their siblings by plain name (`from gpt import GPTModule`), as `python examples/x/train.py`
# does; their module names are distinct across the two examples except train.py and make_plan.py, loaded by path.
for _path in (GPT_DIR, MIXER_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gpt import GPTModule, cosine_with_warmup  # noqa: E402
from mixer import MixerModule  # noqa: E402
from stdlib_text import ByteTokenizer, StdlibTextDataModule, TokenWindows, path_fraction  # noqa: E402
from synthetic_images import SyntheticImageDataModule  # noqa: E402


def load_example(path: Path, name: str) -> ModuleType:
    """Import an example script under a unique module name (both examples have a train.py and a make_plan.py)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class LossRecorder(L.Callback):
    """Keeps every training loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread while training in this process.

    On a shared or oversubscribed CPU, OpenMP threads waiting for each other made these 30-step runs 5 to 15 times
    slower (measured: 1.2 s with one thread, 18.5 s with two, under load). Lightning gives each process of a
    multi-process CPU run its share of the cores for the same reason.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cpu_trainer(max_steps: int, **kwargs: Any) -> L.Trainer:
    """A quiet single-process CPU trainer that validates once, after the last step."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        val_check_interval=max_steps,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------- GPT: data
def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # naïve, 数学, 🐍\n"
    ids = tok.encode(text)
    assert ids.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < tok.vocab_size == 256
    assert len(ids) == len(text.encode("utf-8")) > len(text)  # multi-byte characters are several tokens
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_stdlib_corpus_is_deterministic_capped_and_split_by_file() -> None:
    a = StdlibTextDataModule(max_bytes=300_000, context_length=32)
    b = StdlibTextDataModule(max_bytes=300_000, context_length=32)
    a.setup("fit")
    b.setup("fit")
    assert a.train_set is not None and a.val_set is not None and b.train_set is not None
    # Same files in the same order, byte for byte: every rank of a job reads the same corpus.
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert torch.equal(a.train_set.tokens, b.train_set.tokens)
    # A file is in exactly one split, and which one depends only on its path.
    assert a.train_files and a.val_files and not set(a.train_files) & set(a.val_files)
    assert all(path_fraction(p, "split") < a.val_fraction for p in a.val_files)
    assert all(path_fraction(p, "split") >= a.val_fraction for p in a.train_files)
    assert not any("site-packages" in p for p in a.train_files + a.val_files)
    # The cap is exact: 90% / 10% of max_bytes, plus one separator byte between consecutive files.
    assert len(a.train_set.tokens) == 270_000 + len(a.train_files) - 1
    assert len(a.val_set.tokens) == 30_000 + len(a.val_files) - 1
    # Real Python source: the text decodes and contains code.
    text = a.tokenizer.decode(a.train_set.tokens[:5000])
    assert "def " in text or "import " in text


def test_stdlib_setup_is_fast_at_the_default_cap() -> None:
    dm = StdlibTextDataModule()
    start = time.perf_counter()
    dm.setup("fit")
    assert time.perf_counter() - start < 2.0
    assert dm.train_set is not None and len(dm.train_set) > 10_000


def test_token_windows_are_inputs_plus_next_token_targets() -> None:
    windows = TokenWindows(torch.arange(100, dtype=torch.uint8), context_length=8)
    assert len(windows) == 12  # (100 - 1) // 8
    first, second = windows[0], windows[1]
    assert first.dtype == torch.long and first.tolist() == list(range(9))
    assert second[0] == first[-1]  # the last target of a window is the first input of the next
    assert windows[11].tolist() == list(range(88, 97))
    with pytest.raises(IndexError):
        windows[12]


# ---------------------------------------------------------------------------------------------- GPT: model
def test_gpt_ties_embedding_and_lm_head() -> None:
    module = GPTModule()
    gpt = module.model
    assert gpt.lm_head.weight is gpt.wte.weight
    # Counted once by parameters() (so AdamW updates it once), present under both names in the state dict.
    params = list(module.parameters())
    assert len({id(p) for p in params}) == len(params)
    assert sum(p is gpt.wte.weight for p in params) == 1
    assert {"model.wte.weight", "model.lm_head.weight"} <= set(module.state_dict())
    # The head's gradient lands on the embedding.
    tokens = torch.randint(0, 256, (2, 17))
    torch.nn.functional.cross_entropy(gpt(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert gpt.wte.weight.grad is not None and gpt.wte.weight.grad.abs().sum() > 0


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    gpt = GPTModule().model.eval()
    tokens = torch.randint(0, 256, (1, 20))
    changed = tokens.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 256
    with torch.no_grad():
        before, after = gpt(tokens), gpt(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12])
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_cosine_schedule_warms_up_then_decays_to_the_floor() -> None:
    factors = [cosine_with_warmup(s, total_steps=100, warmup_steps=10, min_ratio=0.1) for s in range(101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[100] == pytest.approx(0.1)
    assert all(x >= y for x, y in itertools.pairwise(factors[10:]))


@pytest.mark.usefixtures("one_thread")
def test_gpt_learns_python_source_in_30_steps() -> None:
    """From uniform guessing (loss ln 256) to a model of Python bytes; the logged metrics agree with each other."""
    L.seed_everything(0)
    dm = StdlibTextDataModule(max_bytes=300_000, batch_size=16)
    module = GPTModule()
    recorder = LossRecorder()
    trainer = cpu_trainer(30, limit_val_batches=4, callbacks=[recorder])
    trainer.fit(module, dm)
    losses = recorder.losses
    assert len(losses) == 30
    # A fresh model is near chance, ln 256; slightly better because the tied head favours repeating the input byte.
    assert math.log(256) - 0.5 < losses[0] < math.log(256)
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0]
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # Four full validation batches of equal size: the corpus perplexity is exp of the mean cross-entropy.
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-4)
    assert metrics["val_ppl"] < 40
    assert 0.15 < metrics["val_acc"] < 1.0  # chance is 1/256; spaces alone are a large share of source code
    assert metrics["train_ppl"] == pytest.approx(math.exp(metrics["train_loss"]), rel=1e-4)


# ---------------------------------------------------------------------------------------------- mixer
def test_synthetic_images_are_deterministic_balanced_and_disjoint() -> None:
    a, b = SyntheticImageDataModule(), SyntheticImageDataModule()
    a.setup("fit")
    b.setup("fit")
    assert a.train_set is not None and a.val_set is not None and b.train_set is not None
    for i in (0, 7, 8191):
        x_a, y_a = a.train_set[i]
        x_b, y_b = b.train_set[i]
        assert torch.equal(x_a, x_b) and int(y_a) == int(y_b) == i % 10
    # Reading order does not matter: a sample is a function of its index alone.
    assert torch.equal(a.train_set[5][0], a.train_set[5][0])
    assert x_a.shape == (3, 32, 32)
    counts = torch.bincount(torch.stack([a.val_set[i][1] for i in range(len(a.val_set))]), minlength=10)
    assert int(counts.max() - counts.min()) <= 1  # chance accuracy is exactly 1/10
    # Validation index 0 is sample 8192 (label 2): another draw than any training sample of label 2.
    assert int(a.val_set[0][1]) == int(a.train_set[8182][1]) == 2
    assert not torch.equal(a.val_set[0][0], a.train_set[8182][0])
    assert SyntheticImageDataModule(seed=1).num_classes == 10


def test_mixer_layers_differ_in_size_by_role() -> None:
    """The token-mixing MLPs are small and the channel-mixing MLPs big: the shapes a per-module plan is about."""
    module = MixerModule()
    block = module.model.blocks[0]
    token = sum(p.numel() for p in block.token_mixing.parameters())
    channel = sum(p.numel() for p in block.channel_mixing.parameters())
    assert (token, channel) == (2_128, 131_712)
    logits = module(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)


@pytest.mark.usefixtures("one_thread")
def test_mixer_learns_the_synthetic_task_in_30_steps() -> None:
    L.seed_everything(0)
    trainer = cpu_trainer(30, limit_val_batches=8)
    trainer.fit(MixerModule(), SyntheticImageDataModule())
    val_acc = float(trainer.callback_metrics["val_acc"])
    assert val_acc > 0.4  # chance is 0.1


# ---------------------------------------------------------------------------------------------- configs and plans
@pytest.mark.parametrize(
    ("make_plan", "config"),
    [(GPT_DIR / "make_plan.py", "examples/gpt/configs/osdp_plan.yaml"), (MIXER_DIR / "make_plan.py", None)],
    ids=["gpt", "mixer"],
)
def test_committed_plans_match_their_generators(
    make_plan: Path, config: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    script = load_example(make_plan, f"{make_plan.parent.name}_make_plan")
    assert script.main(["--check", *(["--config", config] if config else [])]) == 0, capsys.readouterr().out


def _instantiate(monkeypatch: pytest.MonkeyPatch, example: str, *args: str) -> Any:
    """The example's LightningCLI, parsed and instantiated (model, data, trainer, strategy) but not run."""
    monkeypatch.setattr(sys, "argv", [f"examples/{example}/train.py"])  # pytest's own arguments are not the CLI's
    train = load_example(ROOT / "examples" / example / "train.py", f"{example}_train")
    cli_class = train.GPTCLI if example == "gpt" else train.MixerCLI
    model_class, data_class = (
        (GPTModule, StdlibTextDataModule) if example == "gpt" else (MixerModule, SyntheticImageDataModule)
    )
    return cli_class(model_class, data_class, run=False, args=list(args))


def test_gpt_configs_build_the_documented_strategies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cli = _instantiate(monkeypatch, "gpt", "--config", "examples/gpt/configs/osdp_plan.yaml")
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OSDPStrategy) and strategy.memory_budget is None
    committed = Plan.load(GPT_DIR / "plans" / "tiny_mixed.json")
    assert strategy.plan is not None and strategy.plan.decisions == committed.decisions
    assert len(plan_units(cli.model, committed)) == 4  # the plan is applicable to the configured model
    assert cli.datamodule.context_length == cli.model.hparams.context_length == 64  # linked

    # `strategy: osdp` and the budget config wait for the planner: no plan given, so OSDP must solve one.
    cli = _instantiate(monkeypatch, "gpt", "--config", "examples/gpt/configs/osdp.yaml")
    assert isinstance(cli.trainer.strategy, OSDPStrategy) and cli.trainer.strategy.plan is None
    assert cli.trainer.num_devices == 2
    cli = _instantiate(monkeypatch, "gpt", "--config", "examples/gpt/configs/osdp_budget.yaml")
    assert isinstance(cli.trainer.strategy, OSDPStrategy) and cli.trainer.strategy.plan is None
    assert cli.trainer.strategy.memory_budget == parse_memory_budget("80MiB") == 80 * 2**20

    # The larger setting is a fragment layered over a strategy config.
    cli = _instantiate(
        monkeypatch,
        "gpt",
        "--config",
        "examples/gpt/configs/osdp.yaml",
        "--config",
        "examples/gpt/configs/model_10m.yaml",
    )
    n_params = sum(p.numel() for p in cli.model.parameters())
    assert 10e6 < n_params < 11e6 and cli.datamodule.context_length == 256


def test_mixer_configs_build_the_documented_strategies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cli = _instantiate(monkeypatch, "mixer", "--config", "examples/mixer/configs/osdp_plan.yaml")
    plan = cli.trainer.strategy.plan
    assert plan is not None and plan.decisions == Plan.load(MIXER_DIR / "plans" / "shape_plan.json").decisions
    assert plan.mode_of("model.blocks.0.channel_mixing.fc_1") == "full_shard"
    assert plan.mode_of("model.blocks.0.token_mixing.fc_1") == "no_shard"
    cli = _instantiate(
        monkeypatch, "mixer", "--config", "examples/mixer/configs/osdp_budget.yaml", "--data.num_classes", "20"
    )
    assert cli.trainer.strategy.plan is None and cli.trainer.strategy.memory_budget == 72 * 2**20
    assert cli.model.hparams.num_classes == 20  # linked from the data


# ---------------------------------------------------------------------------------------------- a real run
@pytest.mark.distributed
@pytest.mark.slow
def test_gpt_example_trains_on_two_processes_from_its_command_line(tmp_path: Path) -> None:
    """The README's command, shortened to 5 steps: two gloo ranks, the committed plan, finite synced metrics."""
    proc = run_example("gpt", "osdp_plan.yaml", 5, tmp_path, timeout=180)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stdout + proc.stderr
    summary = [line for line in proc.stdout.splitlines() if line.startswith("GPT example: step 5:")]
    assert len(summary) == 1, proc.stdout[-4000:]  # printed by rank 0 only
    assert "Plan(4 decisions: 1 no_shard, 1 shard_grad_op, 2 full_shard, 1 split)" in summary[0]

    (run_dir,) = (tmp_path / "gpt_osdp_plan").iterdir()
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(train) == 5 and all(math.isfinite(x) for x in train)
    assert math.log(256) - 0.5 < train[0] < math.log(256)
    (val,) = [r for r in rows if r.get("val_ppl")]
    assert math.isfinite(float(val["val_ppl"])) and 0.0 <= float(val["val_acc"]) <= 1.0
    assert float(val["val_ppl"]) == pytest.approx(math.exp(float(val["val_loss"])), rel=1e-4)
    peaks = [float(r["osdp/peak_memory_bytes"]) for r in rows if r.get("osdp/peak_memory_bytes")]
    assert peaks and all(p > 0 for p in peaks)
    # The config saved beside the logs names the plan file, so `--config that/config.yaml` reruns the same plan.
    assert "plan: examples/gpt/plans/tiny_mixed.json" in (run_dir / "config.yaml").read_text()
