"""The default ``strategy="osdp"`` trains the code users write as Lightning's DDP does, within its budget.

The corpus (``tests/corpus.py``) is user-style modules: Hugging Face GPT-2 (dict batches, ``labels=``,
``out.loss.item()`` logged), a Hugging Face Llama built on meta and loaded from a ``save_pretrained`` folder, Hugging
Face ResNet (BatchNorm, torchmetrics, a validation loop) and ViT, litgpt's GPT with gradient accumulation and clipping,
a torchmetrics collection computed at epoch end, a GAN under manual optimization, a step that skips non-finite losses
and logs every k batches through ``self.all_gather``, Hugging Face Mixtral and a hand-written mixture of experts (top-k
routing with ``nonzero``), sequence lengths that vary per batch, a frozen backbone with trainable adapters, and
``torch.nn``'s ``TransformerEncoder`` built in ``configure_model`` with a OneCycle schedule over
``trainer.estimated_stepping_batches``. Each trains under OSDP given nothing but a budget, an ample one and a tight one
(the planner must shard and recompute), against Lightning's DDP with the same seed, in one ``torchrun`` launch of 2
ranks (``tests/distributed/corpus_runner.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import ROOT, torchrun

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RTOL = 1e-5
MODELS = (
    "gpt2",
    "llama",
    "resnet",
    "vit",
    "litgpt",
    "metrics",
    "gan",
    "guarded",
    "mixtral",
    "moe",
    "varlen",
    "adapters",
    "lazy",
)
BUDGETS = ("ample", "tight")
RUNS = [f"{model}:{kind}" for model in MODELS for kind in ("ddp", *BUDGETS)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("corpus")
    torchrun(ROOT / "tests" / "distributed" / "corpus_runner.py", str(out), *RUNS, timeout=2400)
    return {
        run: [torch.load(out / f"{run.replace(':', '-')}.rank{r}.pt", weights_only=False) for r in range(2)]
        for run in RUNS
    }


def _flat(value: Any, key: str = "") -> dict[str, float]:
    """A step's extra figures (``skipped``, the metrics computed at each epoch's end) as one flat dict of numbers."""
    if isinstance(value, dict):
        return {k: v for name, item in value.items() for k, v in _flat(item, f"{key}.{name}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{key}[{i}]").items()}
    return {key: float(value)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("kind", BUDGETS)
@pytest.mark.parametrize("model", MODELS)
def test_trains_as_lightnings_ddp_does(results: dict[str, list[dict[str, Any]]], model: str, kind: str) -> None:
    ddp, osdp = results[f"{model}:ddp"], results[f"{model}:{kind}"]
    for rank in range(2):
        got, want = osdp[rank], ddp[rank]
        assert len(got["losses"]) == len(want["losses"]) > 0
        for a, b in zip(got["losses"], want["losses"], strict=True):
            assert a == pytest.approx(b, rel=RTOL, abs=1e-7)
        assert set(got["buffers"]) == set(want["buffers"])
        for name, buffer in want["buffers"].items():
            assert _rel(got["buffers"][name], buffer) <= RTOL, f"rank {rank}'s buffer {name}"
        assert _flat(got["extra"]) == pytest.approx(_flat(want["extra"]), rel=RTOL)
    state, reference = osdp[0]["state"], ddp[0]["state"]
    assert set(state) == set(reference)
    for key, value in reference.items():
        assert _rel(state[key], value) <= RTOL, key


@pytest.mark.parametrize("kind", BUDGETS)
@pytest.mark.parametrize("model", MODELS)
def test_the_measured_peak_is_within_the_budget_from_setup_on(
    results: dict[str, list[dict[str, Any]]], model: str, kind: str
) -> None:
    for rank in range(2):
        result = results[f"{model}:{kind}"][rank]
        assert 0 < result["peak"] <= result["budget"], (rank, result["peak"], result["budget"])
        assert result["setup_peak"] <= result["budget"], (rank, result["setup_peak"], result["budget"])


def test_the_tight_budget_makes_the_planner_shard_and_recompute(results: dict[str, list[dict[str, Any]]]) -> None:
    sharded = recomputed = 0
    for model in MODELS:
        decisions = results[f"{model}:tight"][0]["plan"]["decisions"].values()
        sharded += any(d["mode"] != "no_shard" for d in decisions)
        recomputed += any(d.get("recompute") for d in decisions)
    assert sharded >= len(MODELS) // 2 and recomputed >= len(MODELS) // 2, (sharded, recomputed)


def test_the_users_own_state_is_untouched_by_profiling(results: dict[str, list[dict[str, Any]]]) -> None:
    # Every step appended one loss (no extra entries from the profiled copy), as under DDP.
    for model in MODELS:
        for kind in BUDGETS:
            assert len(results[f"{model}:{kind}"][0]["losses"]) == len(results[f"{model}:ddp"][0]["losses"]), model
