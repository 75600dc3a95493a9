"""GoldenStore: check, update, refuse what is not ours, never leave a truncated file."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

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


_WRITER = """
import sys, torch
from harness.goldens import GoldenStore
from harness.compare import Bound
store = GoldenStore(sys.argv[1], update=True)
path = store.root / "big.pt"
i = 0
while True:
    i += 1
    store.write(path, {"x": torch.full((2_000_000,), float(i))}, {"i": i})
"""


def test_killing_a_writer_mid_update_never_leaves_a_truncated_golden(tmp_path):
    store = GoldenStore(tmp_path, update=True)
    path = tmp_path / "big.pt"
    store.write(path, {"x": torch.zeros(2_000_000)}, {})
    for delay in (0.4, 0.9, 1.5):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)])
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        x = store.load(path)["tensors"]["x"]  # loads: either the old or a complete new file
        assert x.shape == (2_000_000,) and bool((x == x[0]).all())
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["big.pt"]


def test_golden_names_follow_the_test_node_id():
    assert (
        golden_stem("tests/a/test_b.py::TestC::test_d[x-1]") == "tests/a/test_b/TestC.test_d[x-1]"
    )
    assert golden_stem("test_b.py::test_d[a/b c]") == "test_b/test_d[a_b_c]"
