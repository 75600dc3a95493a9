"""Every Python block of the README, the docs pages (the tutorial, the how-to pages under
docs/how-to/, and the rest) and the example repository's README runs.

Blocks are found and run with pytest-examples (each as its own ``__main__`` module, from a
file, so rank processes can load the classes it defines). Conventions of these documents:

- a block whose first line is ``# name.py`` is also a file that other blocks import, on its
  page or another (the tutorial's ``my_emulator.py``, which how-to pages import); all such
  files are written first, to a directory on ``sys.path``, so no two pages may write one name;
- ``py test="pytest"``: a test module, run by pytest itself (with the plugin, on 4 ranks);
- ``py test="skip"``: a fragment that cannot run alone (none is used to hide a feature).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from pytest_examples import CodeExample, EvalExample, find_examples

ROOT = Path(__file__).resolve().parents[2]
# every page under docs/ and its folders, so a new page is tested the day it is written
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "examples" / "downstream" / "README.md",
]
EXAMPLES = [e for e in find_examples(*DOCUMENTS) if e.prefix_settings().get("test") != "skip"]

pytestmark = pytest.mark.spatial_pool  # examples start rank pools of their own


def _file_name(example: CodeExample) -> str | None:
    """``my_model.py`` for a block whose first line is ``# my_model.py`` (or a path to it)."""
    first = example.source.lstrip().splitlines()[0]
    if first.startswith("# ") and first.endswith(".py") and " " not in first[2:]:
        return Path(first[2:]).name
    return None


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The blocks that are files other blocks import, written to a directory on sys.path."""
    where = tmp_path_factory.mktemp("doc-modules")
    for example in EXAMPLES:
        name = _file_name(example)
        if name and not name.startswith("test"):
            (where / name).write_text(example.source)
    sys.path.insert(0, str(where))
    yield where
    sys.path.remove(str(where))


def test_every_page_with_a_python_block_has_its_blocks_run():
    # walked here, not read from DOCUMENTS: a page that list misses (a new folder) fails
    pages = {
        p for p in (ROOT / "docs").glob("**/*.md") if re.search(r"^```py", p.read_text(), re.M)
    }
    run = {e.path for e in EXAMPLES}
    assert ROOT / "docs" / "tutorial.md" in pages and ROOT / "README.md" in run
    assert pages <= run, f"pages whose Python blocks are not run: {sorted(pages - run)}"


def test_no_two_blocks_write_the_same_module():
    # the files of every page share one directory: a second my_emulator.py would replace the
    # first, and the pages importing it would run the wrong one
    written: dict[str, CodeExample] = {}
    for example in EXAMPLES:
        name = _file_name(example)
        if name and not name.startswith("test"):
            first = written.setdefault(name, example)
            assert first is example, f"{name} is written by {first} and by {example}"


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_the_example_runs_as_written(
    example: CodeExample, eval_example: EvalExample, modules: Path, pytester: pytest.Pytester
):
    if example.prefix_settings().get("test") == "pytest":
        for module in modules.glob("*.py"):
            pytester.makepyfile(**{module.stem: module.read_text()})
        pytester.makepyfile(**{_file_name(example)[:-3]: example.source})  # type: ignore[index]
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spatial-ranks", "4")
        assert result.ret == 0, result.stdout.str()[-4000:]
        return
    failure = None
    try:
        eval_example.run(example)
    except Exception as error:  # noqa: BLE001 (whatever a block raises is its failure)
        # pytest-examples gives the error a traceback of rewritten frames that Python's own
        # traceback module cannot walk (a failing block was an INTERNALERROR naming no block):
        # say where by hand, and fail outside the handler so nothing formats that traceback
        tb, lines = error.__traceback__, []
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.endswith(example.path.name):
                lines.append(f"{example.path.relative_to(ROOT)}:{tb.tb_lineno}")
            tb = tb.tb_next
        failure = f"{', '.join(lines) or example}: {type(error).__name__}: {error}"
    if failure is not None:
        pytest.fail(failure, pytrace=False)
