"""No import cycle anywhere in `hf_alibi/`: the module graph, lazy (function-level) and type-only imports counted, is
acyclic, and nothing below the CLI imports it.

The graph is read from the source with `ast`, so an import inside a function or under `if TYPE_CHECKING:` is an edge
like any other: a cycle hidden behind a lazy import is still a cycle a maintainer has to keep in mind. `from .pkg import
name` is an edge to `pkg.name` when that is a module, else to the package `pkg` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_alibi"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _target(base: str, name: str, known: dict[str, Path]) -> str | None:
    """The module `from base import name` depends on: `base.name` if that is a module, else `base` (if ours)."""
    if f"{base}.{name}" in known:
        return f"{base}.{name}"
    return base if base in known else None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every hf_alibi module that `name` imports, at any depth of its source (functions and TYPE_CHECKING included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("hf_alibi"):
                continue
            for alias in node.names:
                target = _target(base, alias.name, known)
                if target is not None:
                    edges.add(target)
    edges.discard(name)
    return edges


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in graph.get(node, ()):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles in hf_alibi/ (lazy and type-only imports counted):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_nothing_imports_the_cli():
    graph = import_graph()
    importers = sorted(name for name, edges in graph.items() if "hf_alibi.cli" in edges)
    assert importers == []


def test_the_graph_sees_lazy_and_type_only_imports(tmp_path):
    """The reader itself: an import inside a function and one under TYPE_CHECKING are both edges."""
    known = {"hf_alibi.a": tmp_path / "a.py", "hf_alibi.b": tmp_path / "b.py", "hf_alibi.c": tmp_path / "c.py"}
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
        "def f():\n    from . import c\n    return c\n"
    )
    known["hf_alibi.a"].write_text(source)
    assert imports_of("hf_alibi.a", known["hf_alibi.a"], known) == {"hf_alibi.b", "hf_alibi.c"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
