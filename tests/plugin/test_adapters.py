"""Model adapters are found through the entry-point group ``harness.models``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from harness.adapters import (
    GROUP,
    FaultCheck,
    Layout,
    ModelAdapter,
    ModuleAdapter,
    adapter_names,
    as_adapter,
    find_adapter,
)
from harness.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

TINY = """
from harness.adapters import FaultCheck, Layout, Skipped
from harness.steppers.mlp import CoupledMLPCase


class TinyAdapter:
    name = "tiny"
    preload = ()

    def require(self):
        pass

    def layouts(self, ranks):
        return [Layout("tiny mlp", CoupledMLPCase, {"npos": 7, "batch_size": 2})]

    def faults(self, ranks):
        return [FaultCheck("tiny", CoupledMLPCase, {"npos": 7}, None, "no-grad-sync",
                           frozenset({"grad", "sync"}))]

    def skipped(self, ranks):
        return [Skipped("tiny", "made-up", "no such fault on this count")]


adapter = TinyAdapter()
"""


def _install_tiny(site: Path) -> None:
    """A distribution of its own on ``site``: a module and its ``.dist-info``, whose
    entry_points.txt registers the adapter as pip would (importlib.metadata reads it)."""
    site.mkdir()
    (site / "tiny_adapter.py").write_text(textwrap.dedent(TINY))
    info = site / "tiny_adapter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-adapter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\ntiny = tiny_adapter:adapter\n")


def test_harness_check_finds_a_downstream_adapter_through_its_entry_point(tmp_path):
    _install_tiny(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "--model", "tiny", "--ranks", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "checking tiny on 2 ranks" in out
    assert "[1/1] tiny mlp" in out and ": equivalent" in out
    assert "[1/1] tiny:no-grad-sync: caught as" in out
    assert "skipped 1 fault(s), no such fault on this count: tiny:made-up" in out


BROKEN = {
    # its module raises on import (not an ImportError: a bad config, a missing file...)
    "import": 'raise RuntimeError("no config file at /etc/model.yaml")\n',
    # it loads, but importing the model itself raises
    "require": """
class Adapter:
    name, preload = "broken", ()

    def require(self):
        raise RuntimeError("no config file at /etc/model.yaml")

    def layouts(self, ranks):
        return []

    faults = skipped = layouts


adapter = Adapter()
""",
}


@pytest.mark.parametrize("where", sorted(BROKEN))
def test_an_adapter_that_raises_is_one_clear_line_and_exit_code_2(tmp_path, where):
    site = tmp_path / "site"
    site.mkdir()
    (site / "broken_adapter.py").write_text(BROKEN[where])
    info = site / "broken_adapter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-adapter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nbroken = broken_adapter:adapter\n")
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "--model", "broken"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # no traceback
    assert lines[0].startswith("harness-check: error: --model broken: ")
    assert "RuntimeError: no config file at /etc/model.yaml" in lines[0]  # the problem
    assert "fix" in lines[0]  # and what to do


def test_an_unregistered_model_is_a_usage_error_naming_the_registered_ones(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "--model", "nope"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "invalid choice: 'nope'" in proc.stderr and "'fme'" in proc.stderr


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is new in Python 3.11")
def test_the_harness_registers_its_own_adapters_under_the_group():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    registered = project["entry-points"][GROUP]
    assert set(registered) == {"builtin", "fme", "anemoi", "makani"}
    for name, value in registered.items():
        module, _, attr = value.partition(":")
        adapter = getattr(__import__(module, fromlist=[attr]), attr)
        assert isinstance(adapter, ModelAdapter) and adapter.name == name
    assert {"builtin", "fme", "anemoi"} <= set(adapter_names())


def test_the_built_in_adapter_gives_records_for_the_catalogue():
    adapter = find_adapter("builtin")
    layouts = adapter.layouts(4)
    assert all(isinstance(x, Layout) for x in layouts)
    assert layouts[0].label == "coupled-mlp" and layouts[0].case().name == "coupled-mlp"
    faults = adapter.faults(4)
    assert all(isinstance(f, FaultCheck) and isinstance(f.expected, frozenset) for f in faults)
    assert ("coupled-mlp", "no-grad-sync") in {(f.stepper, f.fault) for f in faults}
    assert adapter.skipped(4) == [] and len(adapter.skipped(2)) == len(faults) - 3


def test_a_module_of_the_older_interface_is_wrapped_and_anything_else_refused():
    module = types.ModuleType("harness.steppers.catalogue")
    module.main_configs = lambda ranks: []  # type: ignore[attr-defined]
    assert as_adapter("old", module) == ModuleAdapter("old", "harness.steppers.catalogue")
    with pytest.raises(ConfigError, match="has no main_configs"):
        as_adapter("bare", types.ModuleType("bare"))
    with pytest.raises(ConfigError, match=r"not a ModelAdapter .*lacks .*layouts"):
        as_adapter("odd", object())
