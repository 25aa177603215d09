"""Every global name the code reads is defined in its module or a builtin. Collecting tests does not run their
bodies, so a helper renamed by a refactor shows up only when the test runs: for GPU tests, on the GPU box."""
from __future__ import annotations

import ast
import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("app", "engine", "kernels", "moedesk", "tests", "training", "bench")
MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__path__",
                "__builtins__", "__annotations__", "__class__"}


def _tables(table: symtable.SymbolTable):
    yield table
    for child in table.get_children():
        yield from _tables(child)


def undefined_globals(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line of the enclosing scope, name) for each global read that nothing in the module binds."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for t in _tables(top) for s in t.get_symbols()
             if (t is top or s.is_declared_global()) and (s.is_assigned() or s.is_imported())}
    if any(isinstance(n, ast.ImportFrom) and n.names[0].name == "*" for n in ast.walk(ast.parse(source))):
        return []  # a star import binds names we cannot see
    missing = []
    for table in _tables(top):
        for s in table.get_symbols():
            name = s.get_name()
            reads_global = s.is_referenced() and (s.is_global() if table is not top else name not in bound)
            if reads_global and name not in bound and not hasattr(builtins, name) and name not in MODULE_NAMES:
                missing.append((table.get_lineno(), name))
    return missing


def test_the_check_finds_a_name_nothing_defines():
    source = "import os\nX = 1\ndef f(a):\n    global Y\n    Y = a\n    return os, X, Y, len, gone\n"
    assert undefined_globals(source) == [(3, "gone")]
    assert undefined_globals("from m import *\ndef f():\n    return anything\n") == []
    assert undefined_globals("class C:\n    k = 1\n    def f(self):\n        return k\n") == [(3, "k")]


@pytest.mark.parametrize("folder", [f for f in FOLDERS if (ROOT / f).is_dir()])
def test_every_global_read_is_defined(folder):
    missing = [f"{path.relative_to(ROOT)}: {name} (scope at line {line})"
               for path in sorted((ROOT / folder).rglob("*.py"))
               for line, name in undefined_globals(path.read_text(), str(path))]
    assert not missing, "undefined names:\n" + "\n".join(missing)
