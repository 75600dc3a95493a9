"""CHANGELOG.md lists every old import path the code keeps working, and every deprecation.

A name a public module re-exports from a module outside its own package is a name that moved
there (a package re-exporting its own submodules, like ``harness`` or ``harness.steppers``,
is a front door, not a move): whoever moves one must say so in the changelog, and whoever
deprecates a name must too.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()


def _public_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(harness.__path__, "harness."):
        parts = info.name.split(".")[1:]
        # private by name; contrib adapters import models that may not be installed
        if not any(p.startswith("_") for p in parts) and parts[0] != "contrib":
            names.append(info.name)
    return names


def _moved_names() -> set[tuple[str, str]]:
    """(public module, name) for each name of its ``__all__`` defined outside its package."""
    moved = set()
    for module_name in _public_modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            home = getattr(getattr(module, name), "__module__", None) or ""
            inside = home == module_name or home.startswith(module_name + ".")
            if home.startswith("harness") and not inside:
                moved.add((module_name, name))
    from harness._base.deprecation import FORWARDS

    assert FORWARDS, "the forwards were not imported"  # harness.compare forwards on import
    return moved | set(FORWARDS)  # through a module __getattr__


def _listed(module: str, name: str) -> bool:
    """A changelog line that names the module and the name (``module.name`` or ``name``)."""
    return any(
        f"`{module}." in line and (f"`{name}`" in line or f"{module}.{name}`" in line)
        for line in CHANGELOG.splitlines()
    )


def test_every_name_a_public_module_keeps_importable_from_its_old_home_is_in_the_changelog():
    moved = _moved_names()
    assert ("harness.equivalence", "SpatialCase") in moved  # the walk finds the known ones
    missing = sorted(f"{m}.{n}" for m, n in moved if not _listed(m, n))
    assert not missing, f"moved names CHANGELOG.md does not list: {missing}"


def test_every_deprecation_warning_of_the_code_names_a_name_the_changelog_lists():
    said = set()
    for path in (ROOT / "harness").rglob("*.py"):
        text = path.read_text()
        if "DeprecationWarning" in text:
            said |= set(re.findall(r"(harness\.[\w.]+) is deprecated", text))
    assert said, "no deprecation found: the pattern no longer reads the code's messages"
    for old in sorted(said):
        module, name = old.rsplit(".", 1)
        assert _listed(module, name), f"{old} warns as deprecated but CHANGELOG.md does not list it"


def test_the_changelog_has_an_unreleased_section_and_the_projects_version():
    assert re.search(r"^## \[Unreleased\]$", CHANGELOG, re.M)
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version and f"## [{version.group(1)}]" in CHANGELOG
