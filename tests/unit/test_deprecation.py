"""Old names keep working through one helper, and each says once where it lives now."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

from harness._base import deprecation
from harness._base.deprecation import FORWARDS, forward

HARNESS = Path(__file__).resolve().parents[2] / "harness"


def _forwarding_modules() -> list[str]:
    """The modules of harness whose ``__getattr__`` is made by ``forward`` (read with ast)."""
    found = []
    for path in sorted(HARNESS.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__getattr__" for t in node.targets)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "forward"
            ):
                parts = path.relative_to(HARNESS.parent).with_suffix("").parts
                found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees every forward warn anew."""
    monkeypatch.setattr(deprecation, "_warned", set())


def test_every_forward_fetches_the_name_from_its_home_and_warns_once(fresh_warnings):
    modules = _forwarding_modules()
    assert "harness.compare" in modules
    for module in modules:
        importlib.import_module(module)
    assert {m for m, _ in FORWARDS} == set(modules)
    for (module, name), home in sorted(FORWARDS.items()):
        old = importlib.import_module(module)
        with pytest.warns(
            DeprecationWarning, match=f"goes in harness {deprecation.UNTIL}"
        ) as caught:
            value = getattr(old, name)
        assert value is getattr(importlib.import_module(home), name)
        assert [str(w.message).split(":")[0] for w in caught] == [
            f"{module}.{name} moved to {home}.{name}"
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(old, name) is value  # once: the second use is silent


def test_the_warning_points_at_the_line_that_used_the_old_name(fresh_warnings):
    import harness.compare

    with pytest.warns(DeprecationWarning, match="import it from harness.report") as caught:
        harness.compare.EquivalenceReport  # noqa: B018
    assert caught[0].filename == __file__


def test_a_name_that_never_moved_is_a_plain_attribute_error(monkeypatch):
    monkeypatch.setattr(deprecation, "FORWARDS", {})  # this made-up forward stays here
    getattr_ = forward("harness.somewhere", {"Old": "harness.report"})
    with pytest.raises(AttributeError, match=r"module 'harness\.somewhere' has no attribute 'New'"):
        getattr_("New")


def test_no_module_forwards_names_by_hand():
    """A module ``__getattr__`` is ``forward``'s (listed, warned, tested here), or the
    steppers' lazy loader, which loads its own submodules on first use (no warning: nothing
    moved, torch-harmonics is just slow to import)."""
    by_hand = []
    for path in sorted(HARNESS.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                by_hand.append(str(path.relative_to(HARNESS)))
    assert by_hand == ["steppers/__init__.py"]
