"""The modules of ``harness`` import each other in one direction: no import cycles.

Read from the source with ``ast``, every ``import`` counts, at module level or inside a
function (a deferred import is still a dependency), except those under ``if TYPE_CHECKING:``
(annotations only: never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "harness"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``tree`` imports (outside ``if TYPE_CHECKING:``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # ``from harness.steppers import faults``: the submodule
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & modules


def import_graph(root: Path = HARNESS) -> dict[str, set[str]]:
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(paths)
    return {m: _imports(ast.parse(p.read_text()), modules) - {m} for m, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_cycle_finder_finds_a_cycle_through_a_deferred_import(tmp_path):
    pkg = tmp_path / "harness"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from harness.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from harness import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness import a\n"
    )
    (pkg / "d.py").write_text("import harness.c\n")
    graph = import_graph(pkg)
    assert graph["harness.d"] == {"harness.c"} and graph["harness.c"] == set()
    assert cycles(graph) == [["harness.a", "harness.sub.b"]]


def test_no_module_of_harness_imports_one_that_imports_it_back():
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_names_moved_out_of_compare_are_still_importable_from_it():
    import harness
    from harness import compare, hints, report

    for name, home in [
        ("EquivalenceReport", report),
        ("REMEDIES", report),
        ("FieldError", report),
        ("format_table", report),
        ("mismatch_table", report),
        ("equivalence_table", report),
        ("scale_hint", hints),
    ]:
        assert getattr(compare, name) is getattr(home, name), name
    assert harness.EquivalenceReport is report.EquivalenceReport
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        compare.nothing  # noqa: B018
