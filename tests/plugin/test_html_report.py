"""``--spatial-report PATH``: one self-contained HTML page of the session, checked as text and
opened in a real headless browser (Debian's chromium; .ci/run installs it)."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.plugin.html_report import write_atomically

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
PNG = b"\x89PNG\r\n\x1a\n"

SESSION = """
import torch
from harness import Outputs, Shard, SpatialCase
from harness.collectives import reduce_loss, sync_gradients
from harness.steppers.sfno import SFNOCase


class Scale(SpatialCase):
    dtype = torch.float64

    def __init__(self, synced=True):
        self.synced = synced

    def build(self, topo):
        model = torch.nn.Linear(3, 3)
        if self.synced:
            sync_gradients(model, topo)
        return model

    def batch(self, topo, step):
        x = torch.randn(8, 3)
        n = 8 // topo.spatial_size
        return x[topo.spatial_rank * n:(topo.spatial_rank + 1) * n]

    def forward(self, model, x, topo):
        y = model(x)
        loss = reduce_loss((y ** 2).sum(), topo) / 24
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        n = x.shape[0]
        idx = torch.arange(topo.spatial_rank * n, (topo.spatial_rank + 1) * n)
        return Outputs(loss, {"y": Shard(y, idx, dim=0)})


def test_scale_is_equivalent(spatial):
    spatial.check(Scale())

def test_sfno_per_rank_noise(spatial):
    spatial.check(SFNOCase(nlat=12, nlon=20, h=2, w=2, noise=1, faults=("per-rank-noise",)))

def test_sfno_rollout(spatial):
    spatial.check(SFNOCase(nlat=12, nlon=20, h=2, w=2, faults=("eval-local-mean",)), rollout=3)

def test_scale_unsynced_sweep(spatial):
    spatial.check_layouts(Scale(synced=False), max_ranks=2)
"""


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def session_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One session under xdist (the page is the controller's, from what two workers sent):
    one passing check, two failing SFNO checks (error maps; a rollout curve), a failing
    sweep (its layout map). The page, its text and the JUnit XML."""
    pytest.importorskip("torch_harmonics")  # the SFNO stepper's; a test extra
    root = tmp_path_factory.mktemp("report")
    (root / "test_session.py").write_text(SESSION)
    page = root / "reports" / "sub" / "page.html"  # directories that do not exist yet
    run = _pytest(
        root, "-n", "2", "--spatial-ranks=4", f"--spatial-report={page}", "--junitxml=junit.xml"
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"spatial report: {page}" in run.stdout
    return page, page.read_text(), (root / "junit.xml").read_text()


def test_the_page_holds_the_summary_each_failure_its_pictures_and_nothing_from_outside(
    session_page,
):
    pytest.importorskip("matplotlib")
    _, text, junit = session_page
    # the summary: every check's row, the sweep's row; each failure's report
    for test in ("test_scale_is_equivalent", "test_sfno_per_rank_noise", "test_sfno_rollout"):
        assert f'<td class="id">test_session.py::{test}</td>' in text
    sweep = '<td class="id">test_session.py::test_scale_unsynced_sweep</td><td>Scale</td><td>2</td>'
    assert sweep + "<td>1</td>" in text  # 1 passed, then the failing count
    assert text.count('<section id="failure-') == 3
    assert "First divergent step: step 0 of 3" in text
    assert "smallest failing layout" in text.lower()
    # the pictures, each a PNG inside the page: the SFNO's maps, the curve, the layout map
    captions = re.findall(r"<figcaption>([^<]*)</figcaption>", text)
    assert any(".layouts.png" in c for c in captions), captions
    assert any(c.endswith(".rollout.png") for c in captions), captions
    assert any(c.startswith("test_session.test_sfno_per_rank_noise.") for c in captions)
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == len(captions) >= 3
    assert len(set(captions)) == len(captions), captions  # each drawn once, not per phase
    assert all(base64.b64decode(data)[:8] == PNG for data in images)
    # nothing to fetch, nothing to run
    assert not re.search(r'(src|href)="(?!data:|#)', text)
    assert "<script" not in text
    assert "default-src &#x27;none&#x27;" in text or "default-src 'none'" in text
    # JUnit XML keeps its properties, but not the megabytes of pictures
    assert "spatial.verdict" in junit and "harness_report" not in junit


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_page_opens_in_a_headless_browser_with_no_console_error_its_maps_drawn(
    session_page, tmp_path
):
    import matplotlib.image
    import numpy as np

    page, text, _ = session_page
    # as it is: the browser's console says nothing (a refused fetch or any error would)
    shot = tmp_path / "page.png"
    loaded = _chromium(page, "--hide-scrollbars", "--window-size=1200,2400", f"--screenshot={shot}")
    console = [line[:300] for line in loaded.stderr.splitlines() if ":CONSOLE" in line]
    assert loaded.returncode == 0 and not console, console or loaded.stderr[-3000:]
    pixels = matplotlib.image.imread(shot)[..., :3].reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 1  # not blank
    # a copy that says, once loaded, each picture's size and how many colours it drew
    probe = tmp_path / "probe.html"
    probe.write_text(
        text.replace(
            "default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';"
        ).replace("</body>", PROBE + "</body>")
    )
    dom = _chromium(probe, "--dump-dom").stdout
    found = re.search(r'data-images="([^"]*)"', dom)
    assert found, dom[:2000]
    drawn = [tuple(map(int, re.split("[x:]", i))) for i in found.group(1).split()]
    assert len(drawn) == text.count("<img ") >= 3
    # a figure drew its axes, labels and colours: a blank or truncated PNG gives 1 or 2
    assert all(w > 0 and h > 0 and colours > 8 for w, h, colours in drawn), drawn


#: drawn on a canvas after load, each image's width x height : distinct colours (a sample)
PROBE = """<script>
addEventListener('load', () => {
  const out = [];
  for (const img of document.images) {
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const g = c.getContext('2d');
    g.drawImage(img, 0, 0);
    const px = c.width ? g.getImageData(0, 0, c.width, c.height).data : [], seen = new Set();
    for (let i = 0; i < px.length; i += 4 * 101) seen.add(px.slice(i, i + 4).join());
    out.push(img.naturalWidth + 'x' + img.naturalHeight + ':' + seen.size);
  }
  document.body.setAttribute('data-images', out.join(' '));
});
</script>"""


def _chromium(page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",  # as root in CI containers
        "--disable-gpu",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",  # the load event has fired before the dump
        *args,
        page.as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_map_that_cannot_be_drawn_is_a_not_plotted_line_and_the_verdict_stands(pytester):
    """Without matplotlib (the SFNO's lat x lon field), and for a field split along a plain
    dimension (no map to draw): a ``Not plotted:`` line each, the failures reported whole."""
    pytest.importorskip("torch_harmonics")
    pytester.makeconftest("import sys\nsys.modules['matplotlib'] = None  # not installed\n")
    pytester.makepyfile(
        test_maps=SESSION
        + """
def test_scale_unsynced(spatial):
    spatial.check(Scale(synced=False))
"""
    )
    result = pytester.runpytest_subprocess(
        "--spatial-ranks=4",
        "--spatial-report=page.html",
        "-k",
        "test_sfno_per_rank_noise or test_scale_unsynced",
    )
    result.assert_outcomes(failed=3)
    text = (pytester.path / "page.html").read_text()
    assert text.count("mismatch(es) with the reference") >= 2
    assert "Not plotted: field &#x27;prediction&#x27;, step 0 (" in text, text
    assert "error maps need matplotlib" in text
    lines = re.findall(r"Not plotted: [^<]*", text)
    assert any("field &#x27;y&#x27;" in line for line in lines), lines  # a plain 1-D field
    assert "Not plotted: the layout map" in text
    assert "<img" not in text


@pytest.mark.parametrize(
    ("where", "problem"),
    [
        ("a_file/page.html", "a_file is a file, not a directory; choose another path"),
        ("a_dir", "is a directory; name the HTML file, e.g. --spatial-report=out/spatial.html"),
    ],
)
def test_a_report_path_that_cannot_be_written_is_refused_at_startup(pytester, where, problem):
    (pytester.path / "a_file").write_text("")
    (pytester.path / "a_dir").mkdir()
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest(f"--spatial-report={where}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --spatial-report {where}: *{problem}"])


def test_the_page_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    page = tmp_path / "page.html"
    assert write_atomically(page, "<p>new</p>") == len("<p>new</p>")
    assert page.read_text() == "<p>new</p>"

    def refuse(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(page, "<p>newer</p>")
    assert page.read_text() == "<p>new</p>"  # the old page, whole
    assert [p.name for p in tmp_path.iterdir()] == ["page.html"]  # no temporary file left


def test_a_passing_session_writes_a_page_with_no_failures_section(pytester):
    pytester.makepyfile(
        textwrap.dedent(
            """
            def test_plain():
                pass
            """
        )
    )
    result = pytester.runpytest("--spatial-report=page.html")
    result.assert_outcomes(passed=1)
    text = (pytester.path / "page.html").read_text()
    assert "<h2>Failures</h2>" not in text and "1 passed" in text
    assert "No equivalence check ran." in text
