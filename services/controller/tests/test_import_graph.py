"""No import circle in the controller: each module's imports (the AST, TYPE_CHECKING ones too,
since a type-only import back is the same dependency) form a graph without a cycle.

A part that needs something of the module that builds it takes a Protocol instead (see
`jobs/host.py`). `from package import submodule` counts as importing the submodule: a package
is always imported before its children, which is no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "lorafleet_controller"


def module_sources(src: Path = SRC, package: str = PACKAGE) -> dict[str, tuple[str, bool]]:
    """module name -> (source, is a package's __init__)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        out[name] = (path.read_text(), is_package)
    return out


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of `sources` it imports."""
    graph: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = here[: len(here) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    edges.add(submodule if submodule in sources else base)
        graph[name] = {e for e in edges if e in sources and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that ends where it starts) per circle found by a depth-first walk."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_controller_has_no_import_circle() -> None:
    sources = module_sources()
    assert len(sources) > 30 and f"{PACKAGE}.controller" in sources  # the walk found the tree
    found = cycles(import_graph(sources))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_walk_finds_a_circle_of_any_import_shape() -> None:
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
    sources = {
        "pkg": ("", True),
        "pkg.a": ("from pkg.b import thing\n", False),
        "pkg.b": (type_only, False),
        "pkg.c": ("import pkg.a\n", False),
        # a package re-exporting its children, one of which imports a sibling through it
        "pkg.sub": ("from pkg.sub.leaf import x\nfrom pkg.sub.other import y\n", True),
        "pkg.sub.leaf": ("from pkg.sub import other\n", False),
        "pkg.sub.other": ("", False),
    }
    found = cycles(import_graph(sources))
    assert found == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]], found
