"""GoldenStore: check, update, refuse what is not ours, never leave a truncated file."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from harness import GoldenError, GoldenStore
from harness.compare import Bound
from harness.goldens import golden_stem

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
    live = tmp_path / f".a.pt.{os.getpid()}.abcd1234.tmp"  # this process: alive
    live.write_bytes(b"half")
    other = tmp_path / "sub" / ".b.pt.999999999.zz.tmp"  # no such pid
    other.parent.mkdir()
    other.write_bytes(b"half")
    assert GoldenStore(tmp_path).sweep() == [other]
    assert live.exists() and not other.exists()


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
