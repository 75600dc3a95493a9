"""The harness as a user installs it: a wheel, in a fresh environment, under its own name.

The wheel is built from this checkout and installed into a new virtual environment that
borrows torch and the other dependencies from this one (a .pth file: installing torch again
would cost a minute and a gigabyte), so what runs there is the wheel's harness, not the
checkout's: its entry points, its package data (the main job's goldens), its scripts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.spatial_pool  # builds, installs and starts its own rank pools


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    env = tmp_path_factory.mktemp("fresh") / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # borrow the dependencies (torch, healpy, pytest...) from this environment
    Path(site, "_borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return env


def _run(env: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    return subprocess.run(
        list(args), cwd=cwd, env=clean, capture_output=True, text=True, timeout=600
    )


def test_the_wheel_is_named_pytest_spatial_harness_and_carries_the_main_goldens(wheel):
    assert wheel.name.startswith("pytest_spatial_harness-0.2.0-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "harness/main_goldens/sfno-r4.pt" in names
    assert "harness/py.typed" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "[pytest11]\nharness = harness.plugin" in text
    assert "harness-check = harness.__main__:main" in text


def test_the_installed_harness_check_finds_its_goldens(fresh, tmp_path):
    proc = _run(
        fresh,
        str(fresh / "bin" / "harness-check"),
        "--ranks",
        "4",
        "-k",
        "coupled-mlp",
        "--only",
        "layouts",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(", golden passed (") == 2  # both layouts against their goldens
    assert "ALL CHECKS PASSED" in proc.stdout
    where = _run(
        fresh,
        str(fresh / "bin" / "python"),
        "-c",
        "from harness.__main__ import MAIN_GOLDENS; print(MAIN_GOLDENS)",
        cwd=tmp_path,
    )
    assert where.stdout.startswith(str(fresh)), where  # the wheel's own goldens


def test_the_installed_plugin_loads_and_runs_a_check(fresh, tmp_path):
    (tmp_path / "test_down.py").write_text(
        "from harness.steppers.mlp import CoupledMLPCase\n\n"
        "def test_mlp(spatial):\n"
        "    spatial.check(CoupledMLPCase(npos=9), ranks=2)\n"
    )
    proc = _run(
        fresh,
        str(fresh / "bin" / "python"),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "--spatial-ranks",
        "2",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    where = _run(
        fresh,
        str(fresh / "bin" / "python"),
        "-c",
        "import harness; print(harness.__file__)",
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(fresh)), where  # the wheel's copy, not this checkout
