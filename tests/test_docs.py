"""Every snippet in README.md and docs/ runs, so the documentation cannot drift from the code.

Executed: ``python`` blocks (in order, per page, in one namespace, with a prelude that provides a small ``model``
with data, ``plan_path``, ``ModelCheckpoint``, and Trainers capped at 2 steps without logging), ``yaml`` blocks with
a ``trainer:`` section (parsed and instantiated by LightningCLI), and ``bash`` lines that call ``osdp``. Other
``bash`` lines (``pip install``, ``bash scripts/...``) are what CI itself runs; ``text`` blocks are output.
The docs site itself is built with ``mkdocs build --strict`` (warnings are errors).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning
import pytest

from conftest import ROOT, child_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def test_every_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert page.name in nav, f"{page.name} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=lambda p: p.name)
def test_python_snippets_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_osdp import Plan

    from models import TinyGPT, loaders

    class CappedTrainer(lightning.Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False)
            kwargs.setdefault("default_root_dir", str(tmp_path))
            kwargs["devices"] = 1 if kwargs.get("accelerator", "cpu") == "cpu" else kwargs.get("devices")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lightning, "Trainer", CappedTrainer)
    monkeypatch.chdir(tmp_path)
    model = TinyGPT()
    train, _ = loaders()
    model.train_dataloader = lambda: train  # type: ignore[method-assign]
    plan_path = Plan.uniform(model, "full_shard").save(tmp_path / "plan.json")
    namespace: dict[str, Any] = {"model": model, "plan_path": plan_path, "ModelCheckpoint": ModelCheckpoint}
    exec("import lightning as L", namespace)
    for snippet in blocks(page, "python"):
        exec(compile(snippet, f"{page.name} snippet", "exec"), namespace)


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "yaml")], ids=lambda p: p.name)
def test_yaml_configs_build_the_strategy(page: Path, tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_osdp import OSDPStrategy, Plan

    from models import TinyGPT

    plan_file = Plan.uniform(TinyGPT(), "full_shard").save(tmp_path / "plan.json")
    for i, snippet in enumerate(blocks(page, "yaml")):
        if not snippet.startswith("trainer:"):
            continue
        config = tmp_path / f"config{i}.yaml"
        config.write_text(snippet.replace("plan: null", f"plan: {plan_file}"))
        cli = LightningCLI(TinyGPT, run=False, args=["--config", str(config)], save_config_callback=None)
        assert isinstance(cli.trainer.strategy, OSDPStrategy)


def osdp_commands() -> list[str]:
    found = []
    for page in PAGES:
        for snippet in blocks(page, "bash"):
            found += [line for line in snippet.splitlines() if line.startswith("osdp ")]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("command", osdp_commands())
def test_osdp_commands_run(command: str) -> None:
    args = shlex.split(command.split("  #")[0])
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_osdp.cli", *args[1:]],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OSDP" in proc.stdout or "Plan(" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("mkdocs") is None and not (Path(sys.prefix) / "bin" / "mkdocs").exists(),
    reason="docs extra not installed",
)
def test_docs_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()
