"""The command layer's structure: sub-commands never import kvreuse.cli back, and the two bench
commands do not import each other (shared options live in kvreuse.engine_args / bench.options)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvreuse

PACKAGE = Path(kvreuse.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_module_imports_the_command_line_back():
    importers = [
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if path.name != "__main__.py" and path != PACKAGE / "cli.py" and "kvreuse.cli" in imported_modules(path)
    ]
    assert importers == []


def test_bench_commands_do_not_import_each_other():
    assert "kvreuse.bench.cli" not in imported_modules(PACKAGE / "bench" / "compare.py")
    assert "kvreuse.bench.cli" not in imported_modules(PACKAGE / "bench" / "options.py")
