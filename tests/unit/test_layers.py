"""The modules of ``harness`` import each other in one direction: no import cycles.

Read from the source with ``ast``, every ``import`` counts: at module level, inside a
function (a deferred import is still a dependency) and under ``if TYPE_CHECKING:`` (never run,
but a module that names another's types in its annotations depends on it all the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

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


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def wing(module: str) -> str:
    """The entry of ``harness/`` a module lives in: ``harness.pool._run`` -> ``pool``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


#: the wings of ``harness/``, bottom up: each imports only wings listed before it
#: (docs/architecture.md, "Where things live", draws the same stack)
WINGS = [
    "_base",  # value kinds, frames, process ids, other libraries' internals: nothing of harness
    "compare",  # tolerances and the measures every verdict speaks in
    "_records",  # what a run records and a check found
    "errors",  # what the harness raises, and how a failed run is summarised
    "_mutation",  # the mutants the rank side injects
    "_protocol",  # what the pool and its ranks both speak: events, board, deadlock rule
    "topology",  # who is who in a partitioned run
    "partition",  # which rank owns which part of the globe
    "adopt",  # a model's own groups handed over and taken back
    "collectives",  # autograd-aware collectives over a topology
    "divergence",  # where a run departs from its reference: the pure rule and its measures
    "case",  # the downstream contract and the checks of what a case declares
    "report",  # what a check found, as a person reads it: hints, plots, sites, HTML
    "_judges",  # one judge per quantity: records in, mismatches out
    "goldens",  # the .pt store, its diff, changes and step bounds
    "adapters",  # harness-check's models, found by entry point
    "_rank",  # what runs inside a rank process
    "pool",  # the parent's side of the ranks: warm pools, launchers, runs
    "rollout",  # the inference check
    "equivalence",  # the training check, its modes (calibrated, autocast) and locating
    "layouts",  # one case on every layout
    "__init__",  # the package's face
    "strategies",  # Hypothesis strategies
    "steppers",  # the built-in test subjects
    "contrib",  # real models' own code paths
    "__main__",  # harness-check
    "plugin",  # the pytest face: nothing imports it
]


def test_every_entry_of_harness_is_a_wing_on_the_stack():
    entries = {p.stem for p in HARNESS.glob("*.py")} | {
        p.name for p in HARNESS.iterdir() if (p / "__init__.py").exists()
    }
    assert sorted(entries - set(WINGS)) == [], "place the new entry in WINGS, where it stands"
    assert sorted(set(WINGS) - entries) == [], "WINGS names an entry harness/ no longer has"


def wing_arrows(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Every import between two wings, with the modules that make it."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for m, targets in graph.items():
        for t in targets:
            if wing(m) != wing(t):
                arrows.setdefault((wing(m), wing(t)), []).append(f"{m} -> {t}")
    return arrows


def test_a_wing_imports_only_wings_below_it():
    order = {w: i for i, w in enumerate(WINGS)}
    up = {
        f"{a} -> {b}": sorted(why)
        for (a, b), why in wing_arrows(import_graph()).items()
        if order[b] >= order[a]
    }
    assert up == {}, "an import runs up the stack: move the name down, or the importer up"


def test_the_stack_check_sees_an_import_that_runs_up(tmp_path):
    pkg = tmp_path / "harness"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "_inner.py").write_text("def f():\n    from harness import high\n")
    (pkg / "high.py").write_text("from harness.low import _inner\n")
    arrows = wing_arrows(import_graph(pkg))
    assert set(arrows) == {("low", "high"), ("high", "low")}
    assert arrows[("low", "high")] == ["harness.low._inner -> harness.high"]


def private_crossings(root: Path = HARNESS) -> list[str]:
    """Imports of a ``_``-name (a module or a name under a wing's folder) from another wing.

    A wing whose own name starts with ``_`` (``_rank``, ``_base``) is private to ``harness``
    and open to every wing; what lies under it with a ``_`` is its own. Module attributes
    read through an imported module (``plots._figure``) count as imports.
    """
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    found = []

    def private(module: str, name: str | None) -> bool:
        under = module.split(".")[2:] + ([name] if name else [])
        return any(c.startswith("_") and not c.startswith("__") for c in under)

    for m, path in sorted(paths.items()):
        aliases: dict[str, str] = {}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if not node.module.startswith("harness"):
                    continue
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    target, name = (sub, None) if sub in paths else (node.module, a.name)
                    if sub in paths:
                        aliases[a.asname or a.name] = sub
                    if wing(target) != wing(m) and private(target, name):
                        found.append(
                            f"{path.name}:{node.lineno} from {node.module} import {a.name}"
                        )
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in paths and a.asname:
                        aliases[a.asname] = a.name
                    if a.name in paths and wing(a.name) != wing(m) and private(a.name, None):
                        found.append(f"{path.name}:{node.lineno} import {a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target and wing(target) != wing(m) and private(target, node.attr):
                    found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_wing_imports_another_wings_private_name():
    assert private_crossings() == [], "give the name a public one in its wing, or move it"


def test_the_privacy_check_sees_each_way_of_reaching_in(tmp_path):
    pkg = tmp_path / "harness"
    for d in ("a", "_b"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("_hidden = 1\nshown = 2\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "_inner.py").write_text("_x = 1\n")
    (pkg / "a" / "face.py").write_text("_y = 1\n")
    (pkg / "a" / "own.py").write_text("from harness.a._inner import _x\n")  # its own wing
    (pkg / "c.py").write_text(
        "from harness.a import _inner\n"
        "from harness.a import _hidden, shown\n"
        "from harness.a import face\n"
        "import harness.a._inner as inner\n"
        "from harness._b import shown as ok\n"  # a private wing is open to harness
        "face._y\n"
        "face.ok\n"
    )
    assert private_crossings(pkg) == [
        "c.py:1 from harness.a import _inner",
        "c.py:2 from harness.a import _hidden",
        "c.py:4 import harness.a._inner",
        "c.py:6 face._y",
    ]


def shadowed_submodules(root: Path = HARNESS) -> list[str]:
    """A package's ``__init__`` that binds, at module level, the name of one of its submodules:
    importing the submodule rebinds that name to the module, under the code that uses it."""
    found = []
    for init in sorted(root.rglob("__init__.py")):
        subs = {p.stem for p in init.parent.glob("*.py")} | {
            p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()
        }
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound = {node.name}
            elif isinstance(node, ast.Assign):
                bound = {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith(
                _module_name(init, root)
            ):
                bound = {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):  # from the package itself: the submodule
                bound = {a.asname for a in node.names if a.asname and a.asname != a.name}
            else:
                continue
            found += [f"{init.relative_to(root)}: {n}" for n in sorted(bound & subs)]
    return found


def test_no_package_binds_the_name_of_its_own_submodule():
    assert shadowed_submodules() == [], "rename the submodule or the name"


def test_the_shadow_check_sees_a_function_named_as_a_submodule(tmp_path):
    pkg = tmp_path / "harness" / "w"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "_locate.py").write_text("")
    (pkg / "_place.py").write_text("")
    (pkg / "__init__.py").write_text(
        "from harness.w._place import thing\nfrom harness.other import _place\ndef _locate(): ...\n"
    )
    assert shadowed_submodules(tmp_path / "harness") == [
        "w/__init__.py: _place",
        "w/__init__.py: _locate",
    ]


def test_the_contract_reaches_nothing_of_the_pool_the_rank_side_or_the_mutants():
    """``harness.case`` (what a downstream repo writes against, with the checks of what a
    case declares) and all it imports, deferred and type-only imports included, stay clear of
    the running machinery: the pool, the rank side and the mutation wing."""
    graph = import_graph()
    reached = {wing(m) for m in _reachable(graph, "harness.case")}
    assert sorted(reached & {"pool", "_rank", "_mutation", "_protocol"}) == []


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
