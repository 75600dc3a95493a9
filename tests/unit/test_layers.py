"""The modules of ``harness`` import each other in one direction: no import cycles.

Read from the source with ``ast``, every ``import`` counts: at module level, inside a
function (a deferred import is still a dependency) and under ``if TYPE_CHECKING:`` (never run,
but a module that names another's types in its annotations depends on it all the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "harness"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``tree`` imports, wherever the import stands."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # ``from harness.steppers import faults``: the submodule
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
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


def test_the_cycle_finder_finds_cycles_through_deferred_and_type_only_imports(tmp_path):
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
    (pkg / "e.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    from harness.f import F\n"
    )
    (pkg / "f.py").write_text("from harness import e\n")
    graph = import_graph(pkg)
    assert graph["harness.d"] == {"harness.c"} and graph["harness.c"] == {"harness.a"}
    assert cycles(graph) == [["harness.a", "harness.sub.b"], ["harness.e", "harness.f"]]


#: cycles known and being removed, each with why it stands; an entry is deleted with its
#: cycle (the test fails on an entry whose cycle is gone, so none outlives it)
#: (none: the last, _intercept <-> _mutate, ended when the mutation wing's injector stopped
#: naming the Tracker)
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def test_no_module_of_harness_imports_one_that_imports_it_back():
    found = [tuple(c) for c in cycles(import_graph())]
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert new == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in new)
    gone = sorted(KNOWN_CYCLES - set(found))
    assert gone == [], f"cycles no longer in harness: {gone}; delete them from KNOWN_CYCLES"


def test_names_moved_out_of_compare_are_still_importable_from_it():
    import harness
    from harness import compare, report
    from harness.report import hints as hints

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


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_contract_reaches_nothing_of_the_pool_the_rank_side_or_the_mutants():
    """``harness.case`` (what a downstream repo writes against), the checks of what a case
    declares and returns (``harness.case.declared``, moved out of it) and all they import,
    deferred and type-only imports included, stay clear of the running machinery: the pool,
    a run's events, the rank side (``harness._rank``: the run of a case, the watchers and the
    rank globals) and the mutation wing."""
    graph = import_graph()
    machinery = {
        "harness.pool",
        "harness.pool._processes",  # the pool's rank processes
        "harness.pool._pickling",  # the pool's calls on their way to the ranks
        "harness.pool._run",
        "harness._rank",
        "harness._mutation",
    }
    contract = {"harness.case", "harness.case.declared"}
    reached = contract.union(*(_reachable(graph, m) for m in contract))
    assert sorted(m for m in reached if m.rsplit(".", 1)[0] in machinery or m in machinery) == []


def test_the_rank_side_reaches_nothing_of_the_parent_side():
    """What runs in a rank process (``harness._rank``, the fork server's preload included)
    imports nothing of the side that drives it, deferred and type-only imports included: not
    the pool, a run's events and verdicts, the launchers, the checks or the plugin (as
    pytest-xdist's worker imports nothing of its controller)."""
    graph = import_graph()
    parent = {"harness.pool", "harness.pool._run", "harness.pool.launcher", "harness.equivalence"}
    found = {
        m: sorted(r for r in _reachable(graph, m) if r in parent or r.startswith("harness.plugin"))
        for m in graph
        if m == "harness._rank" or m.startswith("harness._rank.")
    }
    assert {m: r for m, r in found.items() if r} == {}


#: the wings that must never reach others (docs/architecture.md, "Wings" and "Layers"):
#: (what, its modules, what it must not reach, why); a module name ending in "." is a package
WALLS = [
    (
        "the verdict",
        {"harness.report", "harness._judges.", "harness._records.run", "harness._judges.vacuous",
         "harness._records.rollout", "harness._records.samples"},
        {"harness.equivalence", "harness.rollout", "harness.layouts", "harness.goldens",
         "harness.equivalence._autocast"},
        "judging and the report sit below the checks that produce them",
    ),
    (
        "the mutation wing",
        {"harness._mutation."},
        {"harness.equivalence", "harness.pool", "harness.pool._run", "harness.plugin."},
        "the rank side calls its injector: its callers live with the faces",
    ),
    (
        "the shared protocol",
        {"harness._protocol.deadlock", "harness._protocol.board", "harness._protocol.events"},
        {"harness.pool", "harness.pool._processes", "harness.pool._run", "harness.pool._watch",
        "harness._rank."},
        "parent and ranks both speak it; it belongs to neither",
    ),
    (
        "everything but the plugin",
        {"harness."},
        {"harness.plugin."},
        "nothing imports the pytest face (pytest loads it as an entry point)",
    ),
]  # fmt: skip


def _in(module: str, names: set[str]) -> bool:
    """``module`` is one of ``names``, or of a package there named with a trailing dot."""
    return any(module == n.rstrip(".") or (n.endswith(".") and module.startswith(n)) for n in names)


@pytest.mark.parametrize(("what", "inside", "outside", "why"), WALLS, ids=[w[0] for w in WALLS])
def test_a_wing_reaches_nothing_beyond_its_wall(what, inside, outside, why):
    graph = import_graph()
    members = [m for m in graph if _in(m, inside) and not _in(m, outside)]
    assert members, f"{what}: no module matched {sorted(inside)}"
    found = {m: sorted(r for r in _reachable(graph, m) if _in(r, outside)) for m in members}
    assert {m: r for m, r in found.items() if r} == {}, why


def test_no_module_of_the_rank_side_imports_pytest():
    """Code that runs in a rank process never imports pytest (a rank must run under
    torchrun or srun without it, and pytest's import hooks have no business there)."""
    offenders = []
    for path in sorted((HARNESS / "_rank").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "pytest"]
    assert offenders == []


#: modules a downstream repo imports by name (the guide's examples): public though they
#: define no name that ``harness`` exports
DOCUMENTED = {"adapters", "adopt", "collectives", "partition", "strategies", "steppers", "contrib"}


def test_a_module_without_an_underscore_is_public_api():
    """Every module of ``harness`` that is not ``_``-prefixed is the home of a name the
    package exports, documented for direct import, or the plugin / the CLI; the rest is
    internal and says so by its name, as httpx's modules do behind one ``__init__``."""
    import importlib

    import harness

    homes = {
        getattr(harness, n).__module__.split(".")[1] for n in harness.__all__ if n != "__version__"
    }
    public = homes | DOCUMENTED | {"plugin", "__main__", "__init__"}
    plain = {p.stem for p in HARNESS.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    plain = {m for m in plain if not m.startswith("_") or m in ("__init__", "__main__")}
    assert sorted(plain - public) == [], "internal modules without a leading underscore"
    assert sorted(public - plain - {"__init__", "__main__"}) == []
    for name in DOCUMENTED:
        importlib.import_module(f"harness.{name}")
