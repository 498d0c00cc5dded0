"""The package's layers and the absence of import circles (contracts in pyproject.toml's
``[tool.importlinter]``), checked with import-linter so a new upward import fails here, not in a
reviewer's head."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]


def lint(cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with this interpreter, on the pyproject.toml in ``cwd``."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def test_no_upward_import_and_no_circle() -> None:
    p = lint()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 kept, 0 broken" in p.stdout


def test_the_contracts_catch_an_upward_import(tmp_path: Path) -> None:
    # The same contracts over a copy of the package in which discovery imports services.
    import shutil

    pkg = tmp_path / "kvcompass"
    shutil.copytree(ROOT / "kvcompass", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__", "data", "topologies"))
    (pkg / "discovery" / "belief.py").write_text((pkg / "discovery" / "belief.py").read_text() + "\nfrom kvcompass.services import wire  # noqa: E402\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # ``python -c`` puts its working directory first on sys.path: the copy shadows the package.
    p = lint(cwd=tmp_path)
    assert p.returncode != 0
    assert "kvcompass.discovery.belief -> kvcompass.services.wire" in p.stdout


def test_top_level_exports_load_on_first_use() -> None:
    # A fresh interpreter: importing the package must not pull the simulator or the services in.
    code = (
        "import sys, kvcompass\n"
        "heavy = [m for m in ('kvcompass.sim.engine', 'kvcompass.services.http_door', 'kvcompass.discovery.edge') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from kvcompass import Edge, LocalPlane, MaintenanceUnit, WorkerAgent, simulate\n"
        "from kvcompass.discovery.edge import Edge as E\n"
        "assert Edge is E and callable(simulate)\n"
        "assert set(kvcompass.__all__) >= {'Edge', 'LocalPlane', 'MaintenanceUnit', 'WorkerAgent', 'simulate'}\n"
        "try:\n    kvcompass.Nope\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no AttributeError')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr


def test_the_readme_stays_a_front_page() -> None:
    """Issue 15: the README is what a newcomer reads first (what it is, the two commands, what
    is inside, one results table per area, status); measurements and history live in docs/."""
    from pathlib import Path

    readme = Path(__file__).resolve().parent.parent / "README.md"
    assert readme.stat().st_size <= 20 * 1024, f"README.md is {readme.stat().st_size} bytes: move detail to docs/"
