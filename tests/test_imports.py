"""What importing the package costs: the planner and the ``osdp`` parser import no Lightning (the parser no torch),
and ``import lightning_osdp`` still makes ``Trainer(strategy="osdp")`` work, whichever is imported first.

Each case runs in a fresh interpreter: this one has long imported everything.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_osdp

from conftest import ROOT, child_env

HEAVY = ("lightning", "lightning_fabric", "pytorch_lightning", "torch")


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{code}\nfailed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout.strip().splitlines()[-1]


def _loaded_after(code: str) -> set[str]:
    """The top-level packages among HEAVY that are in ``sys.modules`` after ``code`` ran in a fresh interpreter."""
    probe = f"import sys\n{textwrap.dedent(code).strip()}\nprint(sorted({{m.split('.')[0] for m in sys.modules}}))"
    return set(eval(_run(probe))) & set(HEAVY)


def test_the_planner_imports_no_lightning() -> None:
    loaded = _loaded_after(
        "import lightning_osdp.solver, lightning_osdp.cost_model, lightning_osdp.profiling, lightning_osdp.plan"
    )
    assert "torch" in loaded, "the probe sees what is imported"
    assert not loaded - {"torch"}, f"imported {sorted(loaded - {'torch'})}"


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["show", "--help"], ["plan", "--bogus"]])
def test_the_osdp_parser_imports_neither_lightning_nor_torch(argv: list[str]) -> None:
    loaded = _loaded_after(
        f"""
        from lightning_osdp.cli import main
        import contextlib, io
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            status = main({argv!r})
        assert status == (0 if "--help" in {argv!r} else 2), status
        """
    )
    assert loaded == set(), f"osdp {' '.join(argv)} imported {sorted(loaded)}"


_TRAINER = """
    trainer = lightning.Trainer(strategy="osdp", accelerator="cpu", devices=2, logger=False)
    print(type(trainer.strategy).__module__ + "." + type(trainer.strategy).__name__, trainer.strategy.num_processes)
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_osdp\nimport lightning",
        "import lightning\nimport lightning_osdp",
        "import lightning_osdp.solver\nfrom lightning.pytorch.strategies import StrategyRegistry\nimport lightning",
        "from lightning_osdp import OSDPStrategy\nimport lightning",
        "from lightning_osdp.strategy import OSDPStrategy\nimport lightning",
    ],
    ids=["osdp-first", "lightning-first", "registry-module-first", "strategy-class-first", "strategy-module-first"],
)
def test_strategy_name_resolves_whichever_is_imported_first(imports: str) -> None:
    last = _run(imports + "\n" + textwrap.dedent(_TRAINER))
    assert last == "lightning_osdp.strategy.OSDPStrategy 2"


def test_the_registered_name_is_the_strategy_s() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_osdp import OSDPStrategy

    assert lightning_osdp._STRATEGY_NAME == OSDPStrategy.strategy_name == "osdp"
    assert isinstance(StrategyRegistry.get("osdp"), OSDPStrategy)


def test_every_public_name_resolves_to_its_module() -> None:
    assert sorted(lightning_osdp.__all__) == sorted(lightning_osdp._EXPORTS)
    for name, module in lightning_osdp._EXPORTS.items():
        value = getattr(lightning_osdp, name)
        assert value is getattr(sys.modules[module], name)
        assert name in dir(lightning_osdp)
    with pytest.raises(AttributeError, match="no attribute 'Planner'"):
        lightning_osdp.Planner  # noqa: B018


def test_subpackages_are_attributes_of_the_package_as_before() -> None:
    """``import lightning_osdp`` used to import every subpackage, so ``lightning_osdp.checkpoint.consolidate`` worked
    without importing ``lightning_osdp.checkpoint``; it still does, importing it on first use."""
    last = _run(
        """
        import pathlib, sys
        import lightning_osdp
        before = "lightning_osdp.checkpoint" in sys.modules
        consolidate = lightning_osdp.checkpoint.consolidate
        package = pathlib.Path(lightning_osdp.__file__).parent
        names = {p.stem for p in package.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
        reached = all(getattr(lightning_osdp, n).__name__ == "lightning_osdp." + n for n in names if n[0] != "_")
        print(before, callable(consolidate), reached, hasattr(lightning_osdp, "no_such_module"))
        """
    )
    assert last == "False True True False"


def test_the_parser_s_vocabulary_matches_the_package() -> None:
    """``cli/parsers.py`` spells out what it cannot import without torch; these are the originals."""
    import torch

    from lightning_osdp.budget import CUDA_RESERVE_BYTES, format_bytes
    from lightning_osdp.cli import parsers
    from lightning_osdp.cli.plan import _optimizer_factory
    from lightning_osdp.plan import MODES

    assert parsers.MODE_NAMES == MODES
    assert format_bytes(CUDA_RESERVE_BYTES) == parsers._CUDA_RESERVE
    param = torch.nn.Parameter(torch.zeros(2))
    built = {name: _optimizer_factory(name)([param]) for name in parsers.OPTIMIZERS}
    assert [type(o).__name__ for o in built.values()] == ["AdamW", "Adam", "SGD", "SGD"]
    assert built["sgd"].defaults["lr"] == 0.1 and built["sgd"].defaults["momentum"] == 0.0
    assert built["sgd-momentum"].defaults["momentum"] == 0.9


def test_no_two_modules_import_each_other_at_import_time() -> None:
    """Imports between the package's modules, those inside functions included (a lazy import only hides a cycle), but
    not the packages' ``__init__`` re-exports nor imports under ``TYPE_CHECKING`` or in a script's ``__main__`` block,
    form no cycle: a name two stages share lives where both can import it (``lightning_osdp/errors.py``, say)."""
    import ast

    from conftest import ROOT

    modules = {}
    for path in (ROOT / "lightning_osdp").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    packages = {n for n, p in modules.items() if p.name == "__init__.py"}

    def imports(path: Path) -> set[str]:
        found: set[str] = set()

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.If) and any(k in ast.unparse(node.test) for k in ("TYPE_CHECKING", "__main__")):
                return
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(path.read_text()))
        return {m for m in found if m in modules and m not in packages}

    graph = {name: imports(path) for name, path in modules.items() if name not in packages}
    cycles = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in graph.get(node, ()):
            if nxt == start:
                cycles.append(" -> ".join([*path, start]))
            elif nxt not in path and len(path) < 8:
                walk(start, nxt, [*path, nxt])

    for name in graph:
        walk(name, name, [name])
    assert cycles == []
