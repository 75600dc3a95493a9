"""Two test ids that map to one golden file ("a b" and "a_b": a file name holds no space)
are one clear error naming both tests, the golden and the fix; in one process before the
second test reads or writes it, and on xdist's controller when the two ran on different
workers (each worker sees only its own tests)."""

from __future__ import annotations

import pytest

from harness.goldens import GoldenStore
from harness.plugin._keys import _GOLDEN_PROP
from harness.plugin.session import HarnessSession

SHARED = """
import pytest, torch

@pytest.mark.parametrize("value", [pytest.param(1.0, id="a b"), pytest.param(2.0, id="a_b")])
def test_pair(golden, value):
    golden.check({"x": torch.full((2,), value)})
"""

ERROR = (
    "*golden *goldens/test_shared/test_pair[[]a_b[]].pt is the golden of more than one test: "
    "'test_shared.py::test_pair[[]a b[]]', 'test_shared.py::test_pair[[]a_b[]]' (their ids "
    "differ only in characters a golden's file name replaces with '_'), so each checks "
    "against, and --update-goldens writes over, the other's. Rename one id*"
)


def test_the_second_test_of_a_shared_golden_fails_naming_both_before_writing(pytester):
    pytester.makepyfile(test_shared=SHARED)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--update-goldens")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([ERROR, "*1 golden: 1 written.*"])
    # the first test's golden, not overwritten by the second's
    plain = pytester.runpytest_subprocess("-p", "no:randomly", "-k", "a and not a_b")
    plain.assert_outcomes(passed=1)


def test_under_xdist_a_shared_golden_fails_the_session_whichever_workers_ran_them(pytester):
    pytester.makepyfile(test_shared=SHARED)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-n", "2", "--update-goldens")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([ERROR])


def _report(nodeid: str, path: str) -> pytest.TestReport:
    props = [(_GOLDEN_PROP, (path, "written", None))]  # as a worker's report carries it
    return pytest.TestReport(
        nodeid, ("t.py", 0, ""), {}, "passed", None, "call", user_properties=props
    )


def test_the_controller_finds_a_golden_two_workers_wrote_and_fails_the_session(tmp_path):
    session = HarnessSession(GoldenStore(tmp_path, update=True))
    path = str(tmp_path / "t" / "test_pair[a_b].pt")
    session.pytest_runtest_logreport(_report("t.py::test_pair[a b]", path))
    session.pytest_runtest_logreport(_report("t.py::test_pair[a_b]", path))
    session.pytest_runtest_logreport(_report("t.py::test_other", str(tmp_path / "other.pt")))
    assert session.shared_goldens() == {path: {"t.py::test_pair[a b]", "t.py::test_pair[a_b]"}}

    class Finished:
        exitstatus = pytest.ExitCode.OK

    finished = Finished()
    session.pytest_sessionfinish(finished)  # type: ignore[arg-type]
    assert finished.exitstatus == pytest.ExitCode.TESTS_FAILED
