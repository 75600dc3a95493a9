"""GoldenStore: check, update, refuse what is not ours, never leave a truncated file."""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys

import pytest
import torch

from harness import GoldenError, GoldenStore
from harness.compare import Bound
from harness.goldens import GoldenChange, diff_tensors, golden_stem

EXACT = Bound(0.0, 0.0)
TIGHT = Bound(1e-12, 0.0)


def tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "loss": torch.tensor(0.5 * scale, dtype=torch.float64),
        "grad/w": torch.arange(6, dtype=torch.float64).reshape(2, 3) * scale,
    }


def test_a_missing_golden_fails_and_says_to_update(tmp_path):
    store = GoldenStore(tmp_path)
    result = store.check(tmp_path / "a.pt", tensors(), bound=EXACT)
    assert result.status == "missing" and not result.ok
    assert "--update-goldens" in str(result)


def test_update_writes_then_reports_unchanged_then_updated(tmp_path):
    path = tmp_path / "sub" / "a.pt"
    updating = GoldenStore(tmp_path, update=True)
    assert updating.check(path, tensors(), bound=EXACT).status == "written"
    assert updating.check(path, tensors(), bound=EXACT).status == "unchanged"
    assert updating.check(path, tensors(2.0), bound=EXACT).status == "updated"
    checking = GoldenStore(tmp_path)
    assert checking.check(path, tensors(2.0), bound=EXACT).status == "passed"
    data = checking.load(path)
    assert data["provenance"]["torch"] == torch.__version__
    assert "created" in data["provenance"]


def test_a_changed_value_fails_with_the_tensor_and_its_error(tmp_path):
    store = GoldenStore(tmp_path, update=True)
    path = tmp_path / "a.pt"
    store.check(path, tensors(), bound=EXACT)
    changed = tensors()
    changed["grad/w"][1, 2] += 1e-9
    result = GoldenStore(tmp_path).check(path, changed, bound=TIGHT)
    assert result.status == "failed"
    text = str(result)
    assert "grad/w: 1/6 over tolerance" in text and "--update-goldens" in text


def test_dtype_shape_and_name_changes_are_differences(tmp_path):
    store = GoldenStore(tmp_path, update=True)
    path = tmp_path / "a.pt"
    store.check(path, tensors(), bound=EXACT)
    other = {
        "loss": torch.tensor(0.5, dtype=torch.float32),
        "grad/w": torch.zeros(3, 2, dtype=torch.float64),
        "new": torch.ones(1),
    }
    text = str(GoldenStore(tmp_path).check(path, other, bound=EXACT))
    assert "loss: dtype torch.float32 where the reference has torch.float64" in text
    assert "grad/w: shape (3, 2)" in text
    assert "new: produced but not in the golden" in text


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\x00not a zip file at all", "cannot be read"),
        (None, "not a harness golden"),
    ],
    ids=["corrupt", "foreign"],
)
def test_a_corrupt_or_foreign_golden_is_a_clear_error_naming_the_file(tmp_path, content, says):
    path = tmp_path / "a.pt"
    if content is None:
        torch.save({"some": torch.ones(1)}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(GoldenError, match=says) as info:
        GoldenStore(tmp_path).check(path, tensors(), bound=EXACT)
    assert str(path) in str(info.value)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_nothing_in_a_golden_is_ever_executed(tmp_path):
    marker = tmp_path / "executed"
    payload = _Payload()
    payload.marker = marker  # type: ignore[attr-defined]
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        torch.save(
            {"format": "harness-golden", "version": 1, "x": payload}, f, pickle_module=pickle
        )
    with pytest.raises(GoldenError, match="cannot be read"):
        GoldenStore(tmp_path).load(path)
    assert not marker.exists()


# The writer writes half of a golden's bytes, says so, then waits to be killed: a kill that
# lands mid-write every time, not by luck of timing.
_WRITER = """
import sys, time, torch
from harness.goldens import GoldenStore

real_save = torch.save

def save_half_then_hang(obj, f, *args, **kwargs):
    import io
    buf = io.BytesIO()
    real_save(obj, buf, *args, **kwargs)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    print("writing started", flush=True)
    time.sleep(60)

torch.save = save_half_then_hang
store = GoldenStore(sys.argv[1], update=True)
store.write(store.root / "big.pt", {"x": torch.full((200_000,), 1.0)}, {"i": 1})
"""


def test_a_writer_killed_mid_write_leaves_the_old_golden_and_the_next_run_cleans_up(tmp_path):
    store = GoldenStore(tmp_path, update=True)
    path = tmp_path / "big.pt"
    store.write(path, {"x": torch.zeros(200_000)}, {})
    before = path.read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "writing started"  # the handshake
    finally:
        proc.kill()
        proc.wait()
    assert path.read_bytes() == before, "the golden itself was never touched"
    assert torch.equal(store.load(path)["tensors"]["x"], torch.zeros(200_000))
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "big.pt")
    assert len(leftovers) == 1 and leftovers[0].startswith(f".big.pt.{proc.pid}.")
    assert [p.name for p in store.sweep()] == leftovers  # the next run removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]


def test_sweep_leaves_a_write_in_progress_alone(tmp_path):
    # another worker's write in progress: its writer is alive, and must not be disturbed
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".a.pt.{writer.pid}.abcd1234.tmp"
        live.write_bytes(b"half")
        other = tmp_path / "sub" / ".b.pt.999999999.zz.tmp"  # no such pid
        other.parent.mkdir()
        other.write_bytes(b"half")
        assert GoldenStore(tmp_path).sweep() == [other]
        assert live.exists() and not other.exists()
        assert writer.poll() is None  # not killed (nor hung up on) by the sweep
    finally:
        writer.kill()
        writer.wait()


# ---------------------------------------------------------------- non-finite values


def _nan_tensors() -> dict[str, torch.Tensor]:
    out = tensors()
    out["grad/w"][1, 0] = float("nan")
    return out


def test_a_golden_holding_nan_accepts_nothing(tmp_path):
    path = tmp_path / "a.pt"
    GoldenStore(tmp_path).write(path, _nan_tensors(), {})  # e.g. from an older harness
    for checked in (tensors(), _nan_tensors()):
        result = GoldenStore(tmp_path).check(path, checked, bound=Bound(1e-5, 1e-5))
        assert result.status == "failed"
        assert "grad/w: the golden holds 1 NaN of 6 (first at (1, 0))" in str(result)


def test_updating_over_a_golden_holding_nan_is_not_unchanged(tmp_path):
    path = tmp_path / "a.pt"
    GoldenStore(tmp_path).write(path, _nan_tensors(), {})
    assert GoldenStore(tmp_path, update=True).check(path, tensors(), bound=EXACT).status == (
        "updated"
    )


def test_a_run_producing_nan_fails_against_a_finite_golden(tmp_path):
    path = tmp_path / "a.pt"
    GoldenStore(tmp_path, update=True).check(path, tensors(), bound=EXACT)
    result = GoldenStore(tmp_path).check(path, _nan_tensors(), bound=Bound(1.0, 1.0))
    assert result.status == "failed"
    assert "grad/w: this run produced 1 NaN of 6 (first at (1, 0))" in str(result)


def test_update_refuses_to_write_a_nonfinite_golden(tmp_path):
    path = tmp_path / "a.pt"
    result = GoldenStore(tmp_path, update=True).check(path, _nan_tensors(), bound=EXACT)
    assert result.status == "refused" and not result.ok
    assert "a golden vouches only for finite values" in str(result)
    assert not path.exists()
    inf = {"loss": torch.tensor(float("inf"))}
    assert GoldenStore(tmp_path, update=True).check(path, inf, bound=EXACT).status == "refused"


def test_declared_nonfinite_values_are_written_and_must_then_match(tmp_path):
    path = tmp_path / "a.pt"
    updating = GoldenStore(tmp_path, update=True)
    result = updating.check(path, _nan_tensors(), bound=EXACT, allow_nonfinite=True)
    assert result.status == "written"
    checking = GoldenStore(tmp_path)
    assert checking.check(path, _nan_tensors(), bound=EXACT, allow_nonfinite=True).ok
    assert not checking.check(path, tensors(), bound=Bound(1.0, 1.0), allow_nonfinite=True).ok


def test_a_golden_not_updated_says_why(tmp_path):
    result = GoldenStore(tmp_path, update=True).not_updated(tmp_path / "a.pt", "it failed")
    assert result.status == "not updated" and not result.ok
    assert "not updated: it failed; a golden is only written from a passing check" in str(result)


def test_golden_names_follow_the_test_node_id():
    assert (
        golden_stem("tests/a/test_b.py::TestC::test_d[x-1]") == "tests/a/test_b/TestC.test_d[x-1]"
    )
    assert golden_stem("test_b.py::test_d[a/b c]") == "test_b/test_d[a_b_c]"


# ---------------------------------------------------------------- names and texts


@pytest.mark.parametrize(
    ("nodeid", "stem"),
    [
        ("tests/test_a.py", "tests/test_a"),
        ("docs/guide.md::guide", "docs/guide.md/guide"),
    ],
    ids=["module-only", "not-a-py-file"],
)
def test_golden_stems_of_other_node_ids(nodeid, stem):
    assert golden_stem(nodeid) == stem


def test_a_named_golden_sits_next_to_the_tests_own(tmp_path):
    store = GoldenStore(tmp_path)
    nodeid = "tests/a/test_b.py::test_c[x]"
    assert store.path_for(nodeid) == tmp_path / "tests/a/test_b/test_c[x].pt"
    assert store.path_for(nodeid, "Field T2m/1") == (
        tmp_path / "tests/a/test_b/test_c[x].Field_T2m_1.pt"
    )


def test_every_outcome_names_its_golden_in_full(tmp_path):
    path = tmp_path / "a.pt"
    hint = "run pytest with --update-goldens, review the diff and commit the goldens"
    checking, updating = GoldenStore(tmp_path), GoldenStore(tmp_path, update=True)
    missing = checking.check(path, tensors(), bound=EXACT)
    written = updating.check(path, tensors(), bound=EXACT)
    passed = checking.check(path, tensors(), bound=EXACT)
    unchanged = updating.check(path, tensors(), bound=EXACT)
    failed = checking.check(path, {"loss": tensors()["loss"]}, bound=EXACT)
    updated = updating.check(path, {"loss": tensors()["loss"]}, bound=EXACT)
    refused = updating.check(path, {"loss": torch.tensor(float("inf"))}, bound=EXACT)
    not_updated = updating.not_updated(path, "grad mismatch")
    assert [str(r).splitlines() for r in (missing, written, passed, unchanged)] == [
        [f"golden {path}: missing", f"no golden at {path}: {hint} (then commit the new file)."],
        [f"golden {path}: written"],
        [f"golden {path}: passed"],
        [f"golden {path}: unchanged"],
    ]
    assert str(failed).splitlines() == [
        f"golden {path}: failed",
        "  grad/w: in the golden but not produced any more",
        f"If the change is intended, {hint}.",
    ]
    assert str(updated).splitlines() == [
        f"golden {path}: updated",
        "  grad/w: in the golden but not produced any more",
    ]
    assert str(refused).splitlines() == [
        f"golden {path}: refused",
        f"not writing {path}: a golden vouches only for finite values, and this run produced "
        "NaN or inf:",
        "  loss: this run produced 1 inf of 1 (first at ())",
        "Make the run finite (or declare non-finite values expected), then update.",
    ]
    assert str(not_updated).splitlines() == [
        f"golden {path}: not updated",
        "not updated: grad mismatch; a golden is only written from a passing check. Fix the "
        "check, then run --update-goldens again.",
    ]
    results = (missing, written, passed, unchanged, failed, updated, refused, not_updated)
    assert all(r.path == path for r in results)


def test_updating_over_a_corrupt_golden_replaces_it(tmp_path):
    path = tmp_path / "a.pt"
    path.write_bytes(b"\x00not a zip file at all")
    result = GoldenStore(tmp_path, update=True).check(path, tensors(), bound=EXACT)
    assert (result.status, result.lines) == ("updated", [])
    assert GoldenStore(tmp_path).check(path, tensors(), bound=EXACT).status == "passed"


def test_diff_lines_name_every_difference():
    golden = {"a": torch.zeros(2, 2), "gone": torch.zeros(1), "loss": torch.tensor(1.0)}
    actual = {
        "a": torch.tensor([[0.0, float("nan")], [float("inf"), -float("inf")]]),
        "loss": torch.tensor(float("nan")),
        "new": torch.zeros(1),
    }
    assert diff_tensors(actual, golden, Bound(0.0, 0.0)) == [
        "  gone: in the golden but not produced any more",
        "  new: produced but not in the golden",
        "  a: this run produced 1 NaN, 2 inf of 4 (first at (0, 1))",
        "  loss: this run produced 1 NaN of 1 (first at ())",
        "  a: 3/4 over tolerance (rtol 0, atol 0); max abs inf, max rel inf",
        "  loss: 1/1 over tolerance (rtol 0, atol 0); max abs inf, max rel inf",
    ]


def test_provenance_is_stored_as_plain_values(tmp_path):
    import harness

    path = tmp_path / "a.pt"
    provenance = {
        "none": None,
        "flag": True,
        "n": 3,
        "x": 1.5,
        "s": "text",
        "seq": (1, "a", (2.5, None)),
        "path": tmp_path,
        7: torch.__version__,
    }
    GoldenStore(tmp_path, update=True).check(path, tensors(), bound=EXACT, provenance=provenance)
    stored = GoldenStore(tmp_path).load(path)["provenance"]
    assert {k: stored[k] for k in ("none", "flag", "n", "x", "s", "seq", "path", "7")} == {
        "none": None,
        "flag": True,
        "n": 3,
        "x": 1.5,
        "s": "text",
        "seq": [1, "a", [2.5, None]],
        "path": str(tmp_path),
        "7": str(torch.__version__),
    }
    assert [type(stored[k]) for k in ("flag", "n", "7")] == [bool, int, str]
    assert stored["harness"] == harness.__version__ and stored["torch"] == torch.__version__
    created = datetime.datetime.fromisoformat(stored["created"])
    assert created.utcoffset() == datetime.timedelta(0)  # UTC, and says so
    assert abs(datetime.datetime.now(datetime.timezone.utc) - created).total_seconds() < 600


@pytest.mark.parametrize("update", [False, True], ids=["check", "update"])
def test_a_directory_where_the_golden_belongs_is_one_clear_error(tmp_path, update):
    path = tmp_path / "a.pt"
    path.mkdir()
    with pytest.raises(GoldenError) as info:
        GoldenStore(tmp_path, update=update).check(path, tensors(), bound=EXACT)
    assert str(info.value) == (
        f"golden {path} is a directory, where this test's golden file belongs; remove or "
        "rename the directory (or give the golden another name), then run pytest with "
        "--update-goldens, review the diff and commit the goldens."
    )


def test_a_full_disk_leaves_the_old_golden_and_says_so(tmp_path, monkeypatch):
    path = tmp_path / "a.pt"
    store = GoldenStore(tmp_path, update=True)
    store.check(path, tensors(), bound=EXACT)
    before = path.read_bytes()

    def full(data, f):  # what torch.save raises when the disk fills mid-write
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 960 vs 854")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(GoldenError) as info:
        store.check(path, tensors(2.0), bound=EXACT)
    assert str(info.value) == (
        f"golden {path} could not be written: torch.save failed (RuntimeError: [enforce fail "
        "at inline_container.cc:672] . unexpected pos 960 vs 854), most likely a full disk; "
        f"the old one, if any, is unchanged. Free space on {tmp_path}, then run pytest with "
        "--update-goldens, review the diff and commit the goldens."
    )
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temporary file left


def test_a_golden_that_cannot_be_written_names_the_path(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", denied)
    path = tmp_path / "b.pt"
    with pytest.raises(GoldenError, match=r"could not be written \(PermissionError: \[Errno 13\]"):
        GoldenStore(tmp_path, update=True).check(path, tensors(), bound=EXACT)
    assert list(tmp_path.iterdir()) == []


def _report(ok: bool, scale: float = 1.0, ranks: int = 2, spatial_size: int = 2):
    """What the golden policy reads of an EquivalenceReport."""
    from types import SimpleNamespace

    return SimpleNamespace(
        ok=ok,
        reference=tensors(scale),
        case="toy",
        ranks=ranks,
        spatial_size=spatial_size,
        partition="halves",
        dtype="torch.float64",
        steps=1,
    )


def test_the_golden_policy_writes_only_after_a_passing_check_with_its_provenance(tmp_path):
    from harness.goldens import GoldenStatus, check_report

    path = tmp_path / "g.pt"
    store = GoldenStore(tmp_path, update=True)
    kept = check_report(store, path, _report(ok=False))
    assert kept.status is GoldenStatus.NOT_UPDATED and not path.exists()
    written = check_report(store, path, _report(ok=True), provenance={"seed": 3})
    assert written.status == "written"  # a str enum: its text compares equal
    provenance = store.load(path)["provenance"]
    assert (provenance["case"], provenance["partition"], provenance["seed"]) == ("toy", "halves", 3)
    # compared with the field tolerance of the reference's dtype (float64: rtol 1e-10)
    reader = GoldenStore(tmp_path)
    assert check_report(reader, path, _report(ok=True, scale=1 + 1e-13)).status == "passed"
    assert check_report(reader, path, _report(ok=True, scale=1 + 1e-8)).status == "failed"


def test_the_tally_counts_each_status_and_says_what_to_do(tmp_path):
    from harness.goldens import GoldenTally, unused_goldens

    tally = GoldenTally.of(["written", "unchanged", "not updated", "written"])
    assert (tally.written, tally.updated, tally.unchanged) == (2, 0, 1)
    assert tally.lines(tmp_path) == [
        "4 goldens: 2 written, 1 unchanged, 1 not updated (check failed).",
        "Goldens are only written from passing, finite checks: fix the failing tests, then "
        "run --update-goldens again.",
        f"Review and commit the changes under {tmp_path}.",
    ]
    assert GoldenTally.of([]).lines(tmp_path) == []
    store = GoldenStore(tmp_path, update=True)
    for nodeid, name in [("t/test_a.py::test_x", None), ("t/test_a.py::test_x", "loss"),
                         ("t/test_a.py::test_gone", None)]:  # fmt: skip
        store.check(store.path_for(nodeid, name), tensors(), bound=Bound(0, 0))
    assert unused_goldens(tmp_path, ["t/test_a.py::test_x"]) == [
        str(tmp_path / "t/test_a/test_gone.pt")
    ]


# ---------------------------------------------------------------- a reviewer's goldens


def test_an_update_says_which_tensors_changed_were_added_and_removed_and_the_largest_change(
    tmp_path,
):
    path = tmp_path / "a.pt"
    store = GoldenStore(tmp_path, update=True)
    old = {"loss": torch.tensor(0.5, dtype=torch.float64), "w": torch.ones(4, dtype=torch.float64),
           "kept": torch.zeros(2, dtype=torch.float64), "gone": torch.ones(1)}  # fmt: skip
    written = store.check(path, old, bound=EXACT)
    assert written.change.lines(str(path), written.status) == [
        f"written {path}: new golden, 4 tensors"
    ]
    new = {"loss": torch.tensor(0.75, dtype=torch.float64), "w": torch.ones(4, dtype=torch.float64),
           "kept": torch.zeros(2, dtype=torch.float64), "extra": torch.ones(3)}  # fmt: skip
    new["w"][2] = 3.0  # abs 2, rel 2: larger than the loss's abs 0.25, rel 0.5
    updated = store.check(path, new, bound=EXACT)
    assert updated.status == "updated"
    assert updated.change.lines(str(path), updated.status) == [
        f"updated {path}: 2 changed, 1 added, 1 removed, 1 unchanged; largest change w: "
        "max abs 2, max rel 2",
        "  changed: loss, w",
        "  added: extra",
        "  removed: gone",
    ]


def test_a_changed_shape_is_named_in_the_update_summary_and_long_lists_are_cut(tmp_path):
    from harness.goldens import GoldenChange

    old = {f"t{i:02d}": torch.zeros(2) for i in range(10)}
    new = {**{f"t{i:02d}": torch.ones(2) for i in range(9)}, "t09": torch.zeros(3)}
    change = GoldenChange.between(new, old, EXACT)
    lines = change.lines("g.pt", "updated")
    assert lines[1] == ("  changed: t00, t01, t02, t03, t04, t05, t06, t07, and 2 more")
    assert change.kinds == (("t09", "shape (3,) where the golden has (2,)"),)
    assert GoldenChange.from_plain(change.plain()) == change  # it travels to xdist's controller
    unreadable = GoldenChange.between(new, None, EXACT, unreadable=True)
    assert unreadable.lines("g.pt", "updated") == [
        "updated g.pt: the old golden could not be read; rewritten with 10 tensors",
        "  added: t00, t01, t02, t03, t04, t05, t06, t07, and 2 more",
    ]


def test_a_golden_records_the_versions_and_the_layout_it_was_recorded_on(tmp_path):
    from importlib.metadata import version

    from harness.goldens import VERSION, check_report

    path = tmp_path / "g.pt"
    store = GoldenStore(tmp_path, update=True)
    check_report(store, path, _report(ok=True, ranks=4, spatial_size=2))
    data = store.load(path)
    assert data["version"] == VERSION == 2
    provenance = data["provenance"]
    assert provenance["torch"] == torch.__version__
    assert provenance["torch_harmonics"] == version("torch-harmonics")
    layout = {k: provenance[k] for k in ("ranks", "spatial_size", "data_size", "partition")}
    assert layout == {"ranks": 4, "spatial_size": 2, "data_size": 2, "partition": "halves"}


def test_a_failing_golden_of_other_versions_says_they_are_a_likely_cause(tmp_path):
    from importlib.metadata import version

    path = tmp_path / "a.pt"
    then = {"torch": "1.0.0", "torch_harmonics": "0.1.0", "ranks": 4, "partition": "h2w2"}
    GoldenStore(tmp_path, update=True).check(path, tensors(), bound=EXACT, provenance=then)
    reader = GoldenStore(tmp_path)
    now = {"ranks": 2, "partition": "h1w2"}
    assert reader.check(path, tensors(), bound=EXACT, provenance=now).status == "passed"
    failed = reader.check(path, tensors(2.0), bound=EXACT, provenance=now)
    assert failed.lines[-3:] == [
        f"Recorded with torch 1.0.0, torch-harmonics 0.1.0, this run has torch "
        f"{torch.__version__}, torch-harmonics {version('torch-harmonics')}: a likely cause of "
        "the difference (kernels round differently across versions); if only rounding moved, "
        "review and update.",
        "Recorded on a different layout (ranks 4, partition h2w2); this run: ranks 2, "
        "partition h1w2.",
        "If the change is intended, run pytest with --update-goldens, review the diff and "
        "commit the goldens.",
    ]
    same = GoldenStore(tmp_path, update=True)
    same.check(path, tensors(3.0), bound=EXACT)  # rewritten with this run's versions
    assert not any(
        "Recorded" in line for line in reader.check(path, tensors(2.0), bound=EXACT).lines
    )


def _format_1(path, values):
    """A golden as harness wrote it before format 2: no torch-harmonics, no layout."""
    torch.save(
        {
            "format": "harness-golden",
            "version": 1,
            "provenance": {"harness": "0.1.0", "torch": str(torch.__version__), "case": "toy"},
            "tensors": values,
        },
        path,
    )


def test_a_format_1_golden_still_loads_checks_and_says_what_it_does_not_record(tmp_path):
    path = tmp_path / "old.pt"
    _format_1(path, tensors())
    reader = GoldenStore(tmp_path)
    assert reader.load(path)["version"] == 1
    assert reader.check(path, tensors(), bound=EXACT).status == "passed"
    failed = reader.check(path, tensors(2.0), bound=EXACT)
    assert failed.status == "failed"
    assert failed.lines[-2] == (
        "The golden does not record its torch-harmonics version (format 1, written before "
        "versions were stored): a version change cannot be ruled out."
    )
    # updating leaves an unchanged format-1 golden as it is, and rewrites a changed one as 2
    before = path.read_bytes()
    assert GoldenStore(tmp_path, update=True).check(path, tensors(), bound=EXACT).status == (
        "unchanged"
    )
    assert path.read_bytes() == before
    GoldenStore(tmp_path, update=True).check(path, tensors(2.0), bound=EXACT)
    assert reader.load(path)["version"] == 2


@pytest.mark.parametrize(
    ("version", "says"),
    [
        (
            3,
            "format version 3, this harness reads versions 1, 2; it was written by a newer "
            "harness: upgrade this one",
        ),
        (True, "format version True, this harness reads versions 1, 2; delete it and run"),
        ("1", "format version '1', this harness reads versions 1, 2; delete it and run"),
    ],
)
def test_a_golden_of_an_unknown_format_version_is_one_clear_error(tmp_path, version, says):
    path = tmp_path / "g.pt"
    torch.save({"format": "harness-golden", "version": version, "tensors": tensors()}, path)
    with pytest.raises(GoldenError) as info:
        GoldenStore(tmp_path).load(path)
    assert says in str(info.value)


def test_unused_goldens_are_judged_only_below_the_paths_a_run_was_given(tmp_path):
    from harness.goldens import unused_goldens

    store = GoldenStore(tmp_path, update=True)
    for nodeid in ("a/test_x.py::test_1", "a/test_x.py::test_gone", "b/test_y.py::test_2"):
        store.check(store.path_for(nodeid), tensors(), bound=EXACT)
    ran = ["a/test_x.py::test_1"]
    gone, other = str(tmp_path / "a/test_x/test_gone.pt"), str(tmp_path / "b/test_y/test_2.pt")
    assert unused_goldens(tmp_path, ran) == [gone, other]
    assert unused_goldens(tmp_path, ran, ["a/test_x.py"]) == [gone]
    assert unused_goldens(tmp_path, ran, ["a"]) == [gone]
    assert unused_goldens(tmp_path, ran, [""]) == [gone, other]
    assert unused_goldens(tmp_path, ran, ["b/test_y.py"]) == [other]
    assert unused_goldens(tmp_path, ran, [""], ignored=["b"]) == [gone]  # --ignore b


def test_pruning_removes_each_file_and_the_directories_it_empties_and_lists_them(tmp_path):
    from harness.goldens import prune_goldens

    gone = tmp_path / "t" / "test_old" / "test_a.pt"
    kept = tmp_path / "t" / "test_new" / "test_b.pt"
    for path in (gone, kept):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
    missing = tmp_path / "t" / "never.pt"
    assert prune_goldens([gone, missing], tmp_path) == [
        f"  removed {gone}",
        f"  {missing}: already gone",
    ]
    assert not gone.parent.exists() and kept.exists()
    assert (tmp_path / "t").is_dir()  # still holds test_new


def test_pruning_the_only_golden_of_nested_directories_removes_them_all_but_the_root(tmp_path):
    from harness.goldens import prune_goldens

    root = tmp_path / "goldens"
    only = root / "tests" / "unit" / "test_old" / "test_a.pt"
    only.parent.mkdir(parents=True)
    only.write_bytes(b"x")
    assert prune_goldens([only], root) == [f"  removed {only}"]
    assert root.is_dir() and list(root.iterdir()) == []  # the root is the store's: it stays


# ---------------------------------------------------------------- change summaries, closer


def test_a_list_of_changes_is_cut_only_when_longer_than_shown():
    from harness.goldens._changes import _SHOWN

    def added(n):
        change = GoldenChange.between({f"t{i:02}": torch.zeros(1) for i in range(n)}, {}, EXACT)
        return change.lines("g.pt", "updated")[-1]

    assert added(_SHOWN) == "  added: " + ", ".join(f"t{i:02}" for i in range(_SHOWN))
    assert added(_SHOWN + 1).endswith(f"t{_SHOWN - 1:02}, and 1 more")
    assert added(_SHOWN + 5).endswith(f"t{_SHOWN - 1:02}, and 5 more")


def test_the_largest_change_is_the_largest_relative_one_of_several():
    old = {n: torch.ones(3, dtype=torch.float64) for n in ("a", "b", "c", "d")}
    new = {
        "a": torch.tensor([1.0, 1.0, 1.1], dtype=torch.float64),  # rel 0.1
        "b": torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64),  # unchanged
        "c": torch.tensor([1.0, 1.5, 1.0], dtype=torch.float64),  # rel 0.5: the largest
        "d": torch.tensor([1.0, 1.0, 1.2], dtype=torch.float64),  # rel 0.2
    }
    old["a"] = old["a"] * 100  # a: abs 10 but rel 0.1, the largest abs, not rel
    new["a"] = new["a"] * 100
    change = GoldenChange.between(new, old, EXACT)
    assert change.changed == ("a", "c", "d") and change.unchanged == 1
    assert change.largest[0] == "c" and change.largest[2] == pytest.approx(0.5)


def test_a_new_golden_of_one_or_no_tensor_is_counted_in_words():
    assert GoldenChange(added=("w",)).lines("g.pt", "written") == [
        "written g.pt: new golden, 1 tensor"
    ]
    assert GoldenChange().lines("g.pt", "written") == ["written g.pt: new golden, 0 tensors"]


def test_a_failed_or_missing_golden_is_told_to_update_if_the_change_is_intended(tmp_path):
    from harness.goldens import GoldenTally

    for status in ("failed", "missing"):
        assert GoldenTally.of(["passed", status]).lines(tmp_path) == [
            f"2 goldens: 1 passed, 1 {status}.",
            "Run with --update-goldens if the change is intended.",
        ]
    assert GoldenTally.of(["passed"]).lines(tmp_path) == ["1 golden: 1 passed."]
