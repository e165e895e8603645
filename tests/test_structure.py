"""The shape of the package: no import circles, no feature asking which backend it runs on.

Read from the sources (no module is imported), so they cost milliseconds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "optirs"


def _modules() -> Dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """Every optirs module ``name`` imports, at the top or inside functions (lazy imports count)."""
    found: Set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    """Each layer imports only the layers below it, and no two modules import each other, even lazily
    (a package's __init__ composes its modules; they import what they need from their siblings)."""
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_feature_compares_backend_names():
    """A feature asks the bound backend for a capability; only backends know their own names. (A torch
    device's ``.type`` is not a backend's name: CPUOffload pins host memory for ``"cuda"`` tensors.)"""
    pattern = re.compile(r'(?<!\.type )[!=]= "(cpu|cuda|opencl)"')
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in PACKAGE.rglob("*.py")
                 if "backends" not in p.relative_to(PACKAGE).parts
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_comments_say_why_not_who():
    """No process banners in the code, tests and benchmarks: no section 'owned by' a work item, no issue numbers."""
    pattern = re.compile(r"owned by|\(issue \d+\)|\bissue \d+\b", re.IGNORECASE)
    root = PACKAGE.parent
    files = [p for d in (PACKAGE, root / "benchmarks", root / "tests", root / "examples") if d.is_dir()
             for p in d.rglob("*") if p.suffix in (".py", ".h", ".cl") and p != Path(__file__).resolve()]
    offenders = [f"{p.relative_to(root)}:{i}" for p in files
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
