"""The layer contracts of pyproject.toml are live: ``lint-imports`` (import-linter) passes on the package as it
is, and reports a deliberate violation of each contract planted in a copy of it: an upward import at module
level, a circle closed by an import under TYPE_CHECKING, and torch imported inside a function of the cache
core. (The README's test command runs ``lint-imports`` on the real tree before the suite.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports over the copy in ``tree`` (first on the path, so grimp reads it, not the installed package)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "kvreuse", tmp_path / "kvreuse", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def broken(result: subprocess.CompletedProcess[str]) -> str:
    """The 'Broken contracts' part of lint-imports' report."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, f"lint-imports exited {result.returncode}:\n{output[-4000:]}"
    return " ".join(output.split("Broken contracts", 1)[1].split())  # joined: the report wraps long lines


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (pip install -e '.[test]')")
def test_contracts_pass_and_each_planted_violation_is_reported(tree: Path) -> None:
    clean = lint(tree)
    assert clean.returncode == 0 and "3 kept, 0 broken" in clean.stdout, clean.stdout + clean.stderr

    # An upward import: the cache core reaching for the engine.
    (tree / "kvreuse/cache/_upward.py").write_text("import kvreuse.engine\n")
    report = broken(lint(tree))
    assert "kvreuse.cache is not allowed to import kvreuse.engine" in report
    assert "kvreuse.cache._upward -> kvreuse.engine" in report
    (tree / "kvreuse/cache/_upward.py").unlink()

    # A circle inside the leaf layer (where siblings may import each other), closed under TYPE_CHECKING.
    messages = tree / "kvreuse/messages.py"
    messages.write_text(messages.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                        "    from kvreuse.inputs import InputProcessor\n")
    report = broken(lint(tree))
    assert "No import circles" in report and ".messages -> .inputs" in report
    assert "Layers import downward only" not in report  # the layers allow it; only the cycle contract catches it
    shutil.copy(REPO / "kvreuse/messages.py", messages)

    # torch in the cache core, imported lazily inside a function.
    prefix = tree / "kvreuse/cache/prefix.py"
    prefix.write_text(prefix.read_text() + "\n\ndef _tensor():\n    import torch\n\n    return torch.zeros(1)\n")
    report = broken(lint(tree))
    assert "import no torch" in report and "kvreuse.cache.prefix -> torch" in report
