"""What a newcomer meets in the first hour: the README's commands and promises hold, and the
README stays a page that leads to every page of docs/."""

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
DOCS = sorted((ROOT / "docs").rglob("*.md"))  # the tutorial, the how-to pages, the rest
#: pages beside the README that it links, whose links must hold too
BESIDE = [ROOT / "CHANGELOG.md", ROOT / "FAULTS.md", ROOT / "tests" / "README.md"]


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


def test_the_goldens_page_says_where_a_golden_is_written(tmp_path):
    page = (ROOT / "docs" / "goldens.md").read_text()
    store = GoldenStore(tmp_path / "goldens")
    said = re.search(r"(goldens/tests/test_my_model/test_matches\[h2w2\]\.pt)", page)
    assert said, "docs/goldens.md's example of a golden's path"
    path = store.path_for("tests/test_my_model.py::test_matches[h2w2]")
    assert path.relative_to(tmp_path).as_posix() == said.group(1)
    named = store.path_for("tests/test_my_model.py::test_matches", "loss")
    assert named.relative_to(tmp_path).as_posix() in page


def test_the_readme_is_a_page_of_at_most_300_lines():
    # issue 31: what it is, Quick start, a first case, a failure, options, where to read more;
    # everything else has its one home under docs/
    assert len(README.splitlines()) <= 300, len(README.splitlines())


def _links(document: Path) -> list[tuple[str, str]]:
    """(target, anchor) of every relative link of a Markdown page (URLs left out)."""
    return re.findall(r"\]\(([^)#:\s]*)(?:#([^)]*))?\)", document.read_text())


def test_the_readme_leads_to_every_page_of_docs():
    # directly or through pages it links (the how-to pages through their index)
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        for target, _ in _links(page):
            path = (page.parent / target).resolve() if target else page
            if path.suffix == ".md" and path.exists() and path not in reached:
                reached.add(path)
                todo.append(path)
    unreached = sorted(str(p.relative_to(ROOT)) for p in DOCS if p.resolve() not in reached)
    assert DOCS and not unreached, f"pages of docs/ the README does not lead to: {unreached}"


def test_the_readme_links_the_tutorial_the_how_to_index_the_changelog_and_the_tests_readme():
    for page in ("docs/tutorial.md", "docs/how-to/README.md", "CHANGELOG.md", "tests/README.md"):
        assert f"]({page})" in README, page


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a document's headings: lower case, punctuation dropped, spaces -."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"(?ms)^```.*?^```", "", markdown), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_link_of_the_readme_and_docs_names_a_file_and_heading_that_exist():
    for document in [ROOT / "README.md", *DOCS, *BESIDE]:
        for target, anchor in _links(document):
            path = document.parent / target if target else document
            assert path.exists(), (
                f"{document.relative_to(ROOT)} links {target}, which does not exist"
            )
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path.read_text()), (
                    f"{document.relative_to(ROOT)} links #{anchor}"
                )


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
