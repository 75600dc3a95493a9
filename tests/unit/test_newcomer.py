"""What a newcomer meets in the first hour: the README's commands and promises hold."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from harness import Topology
from harness.__main__ import fault_table
from harness.goldens import GoldenStore

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _quick_start() -> str:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return section.split("```bash", 1)[1].split("```", 1)[0]


def test_the_quick_start_commands_each_make_a_virtual_environment_of_their_own():
    venvs = re.findall(r"python3 -m venv (\S+)", _quick_start())
    assert len(venvs) == 2, _quick_start()
    assert len(set(venvs)) == 2, f"both Quick-start commands make {venvs[0]}"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is new in Python 3.11")
def test_installing_the_plugin_gives_pytest_n_auto_its_xdist():
    import tomllib

    assert "pytest -n auto" in README  # what the README advertises as the CI job
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0] for d in project["dependencies"]]
    assert "pytest-xdist" in names


def test_every_field_of_topology_is_documented_in_its_docstring_and_the_readme():
    doc = Topology.__doc__ or ""
    for f in dataclasses.fields(Topology):
        assert f"``{f.name}``" in doc, f.name
        assert f"`{f.name}`" in README, f.name


def test_the_readme_says_where_a_golden_is_written(tmp_path):
    store = GoldenStore(tmp_path / "goldens")
    said = re.search(r"`(goldens/tests/test_my_model/test_matches\[h2w2\]\.pt)`", README)
    assert said, "the README's example of a golden's path"
    path = store.path_for("tests/test_my_model.py::test_matches[h2w2]")
    assert path.relative_to(tmp_path).as_posix() == said.group(1)
    named = store.path_for("tests/test_my_model.py::test_matches", "loss")
    assert f"`{named.relative_to(tmp_path).as_posix()}`" in README


def test_the_fault_table_fits_100_columns_and_keeps_every_verdict_whole():
    long = "deadlock (+" + "x" * 60 + ")"
    rows = [
        ("healpix", "rank-local-nan-check", "deadlock,field,timeout", long, "caught"),
        ("sfno", "buffer-broadcast", "buffer,crash,error,field", "MISSED", "MISSED"),
    ]
    lines = fault_table(rows, width=100)
    assert max(map(len, lines)) <= 100
    assert [line.split()[-1] for line in lines] == ["verdict", "-------", "caught", "MISSED"]
    assert lines[2].split()[-2].endswith("...")  # the long "caught as" cell gave the room
