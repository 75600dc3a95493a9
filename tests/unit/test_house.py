"""The house rules of ``harness/`` that review alone lets drift (issue #31): no module over
700 lines, no function over 60 lines without a ``# long:`` reason, and ``Any`` kept for the
values that are the user's or an untyped library's own.

Measured from the source with ``ast``: nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "harness"

#: a module longer than this holds more than one idea
MAX_MODULE_LINES = 700
#: a function longer than this says why, in a ``# long:`` comment inside it
MAX_FUNCTION_LINES = 60
#: ``Any`` outside ``contrib/`` (whose adapters take real models' untyped values): the
#: issue's budget, a ceiling, so that a new ``Any`` has to replace an old one
MAX_ANY = 150


def module_lines(root: Path = HARNESS) -> dict[str, int]:
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}


def long_functions(root: Path = HARNESS) -> list[str]:
    """``path:function (lines)`` of every function over the limit with no ``# long:``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                n = node.end_lineno - node.lineno + 1
                body = lines[node.lineno - 1 : node.end_lineno]
                if n > MAX_FUNCTION_LINES and not any("# long:" in line for line in body):
                    found.append(f"{path.relative_to(root)}:{node.name} ({n} lines)")
    return found


def any_count(root: Path = HARNESS) -> int:
    """``Any`` as a name or ``typing.Any`` in code (annotations included; imports, comments
    and strings not), outside ``contrib/``."""
    count = 0
    for path in root.rglob("*.py"):
        if "contrib" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = isinstance(node, ast.Name) and node.id == "Any"
            count += named or (isinstance(node, ast.Attribute) and node.attr == "Any")
    return count


def test_no_module_is_over_700_lines():
    lines = module_lines()
    assert "equivalence/__init__.py" in lines  # the package itself was read
    long = {name: n for name, n in lines.items() if n > MAX_MODULE_LINES}
    assert long == {}, "split each by idea (docs/architecture.md: the wings)"


def test_a_function_over_60_lines_says_why():
    assert long_functions() == [], "split it, or say why it is one piece: # long: ..."


def test_any_stays_within_its_budget_outside_contrib():
    assert any_count() <= MAX_ANY


def test_the_measures_see_what_they_measure(tmp_path):
    """Each rule fires on a module made to break it (so a rule that reads nothing fails)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "big.py").write_text(
        "from typing import Any\nimport typing\n\n"
        f"def f(a: Any) -> typing.Any:\n{body}\n\n"
        f"def g():\n    # long: one table, read as one\n{body}\n" + "\n" * MAX_MODULE_LINES
    )
    (tmp_path / "contrib").mkdir()
    (tmp_path / "contrib" / "m.py").write_text("from typing import Any\nx: Any = 1\n")
    assert module_lines(tmp_path)["big.py"] > MAX_MODULE_LINES
    assert long_functions(tmp_path) == [f"big.py:f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert any_count(tmp_path) == 2


def test_every_file_the_mutation_run_names_exists():
    """A moved module left in ``[tool.mutmut]`` would silently mutate nothing, and a moved
    test module would select nothing."""
    import tomllib

    root = HARNESS.parent
    mutmut = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    named = [*mutmut["only_mutate"], *mutmut["pytest_add_cli_args_test_selection"]]
    assert [p for p in named if not (root / p).is_file()] == []
