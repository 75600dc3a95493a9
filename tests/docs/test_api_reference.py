"""docs/api.md is what the docstrings say, every public name has one, and the reference
files each name under the path a user imports it by.

The page is written by ``python docs/gen_api.py``; these tests regenerate it in memory.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from _pytest.config.argparsing import Parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen_api() -> ModuleType:
    """docs/gen_api.py, loaded from its file (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_api"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gen_api"]


@pytest.fixture(scope="module")
def rendered(gen_api: ModuleType) -> str:
    return gen_api.render()


def test_the_committed_api_reference_is_what_the_docstrings_say(gen_api, rendered):
    committed = gen_api.OUTPUT.read_text()
    if committed != rendered:
        diff = difflib.unified_diff(committed.splitlines(), rendered.splitlines(), n=0)
        first = next((d for d in list(diff)[2:] if d[:1] in "+-"), "")
        pytest.fail(
            f"docs/api.md is out of date with the docstrings ({first.strip()[:80]!r}): run "
            f"`{gen_api.COMMAND}` and commit docs/api.md",
            pytrace=False,
        )


def test_every_public_name_method_property_and_fixture_has_a_docstring(gen_api):
    missing = gen_api.undocumented()
    assert missing == [], (
        f"public names without a docstring (or a #: comment for a constant): {missing}; "
        f"write them in harness/, then run `{gen_api.COMMAND}`"
    )


def test_a_name_moved_to_another_internal_module_leaves_the_reference_as_it_was(
    gen_api, rendered, monkeypatch
):
    # what the layout move does to a name: it is defined in a module of another name (whose
    # file holds its source), and imported by the same public path as before
    import inspect

    import harness
    from harness import partition, steppers

    moved = [harness.SpatialCase, harness.check_equivalence, partition.LatLonPartition]
    for n, obj in enumerate([*moved, steppers.SFNOCase]):
        module = ModuleType(f"harness.wing._moved{n}")
        module.__file__ = inspect.getfile(obj)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setattr(obj, "__module__", module.__name__)
    assert gen_api.render() == rendered


def test_every_name_is_filed_under_a_documented_import_path(gen_api, rendered):
    modules = gen_api.documented_modules()
    headings = [
        line.split("`")[1]
        for line in rendered.splitlines()
        if line.startswith(("## `", "### `harness"))
    ]
    assert headings, "no module or name headings in the reference"
    for path in headings:
        module = path if path in modules else path.rsplit(".", 1)[0]
        assert module in modules, f"{path}: not a documented module's name"
        assert "._" not in module, f"{path}: a private module in an import path"
    assert "harness.SpatialCase" in headings and "harness.partition.LatLonPartition" in headings


def test_the_reference_documents_every_module_documented_for_direct_import(gen_api):
    from tests.unit.test_layers import DOCUMENTED

    assert {*gen_api.DIRECT, "contrib"} == DOCUMENTED
    assert set(gen_api.documented_modules()) >= {f"harness.{m}" for m in DOCUMENTED}


def test_a_default_is_rendered_without_a_memory_address(gen_api, rendered):
    assert gen_api.default_text(object()) == "<object>"
    assert gen_api.default_text(sorted) == "sorted"
    assert " at 0x" not in rendered


def test_the_options_listed_are_every_one_the_plugin_declares(gen_api):
    from harness.plugin.options import pytest_addoption

    parser = Parser(_ispytest=True)  # the one pytest hands the plugin's pytest_addoption
    pytest_addoption(parser)
    declared = [(o.names(), o.default) for o in parser.getgroup("harness").options]
    recorded = gen_api.plugin_options()
    assert [(list(o.names), o.default) for o in recorded.options] == declared
    # pytest keeps ini values in a private dict: the only list of them there is
    ini = {name: (kind, default) for name, (_, kind, default) in parser._inidict.items()}
    assert {o.names[0]: (o.kind, o.default) for o in recorded.ini} == ini


def test_a_doctest_and_a_numpydoc_section_title_keep_their_shape_in_markdown(gen_api):
    doc = "Text.\n\n>>> 1 + 1\n2\n\nParameters\n----------\nn:\n    Size."
    assert gen_api.markdown(doc) == (
        "Text.\n\n    >>> 1 + 1\n    2\n\n**Parameters**\n\nn:\n    Size."
    )
