"""The main job (harness-check) as a person runs it: a table, a verdict, an exit code."""

from __future__ import annotations

import subprocess
import sys


def _main_job(*args: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_main_job_prints_the_equivalence_table_records_goldens_and_passes(tmp_path):
    first = _main_job(
        "--ranks", "2", "--no-faults", "--golden-dir", "g", "--update-goldens", cwd=tmp_path
    )
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "worst relative error per quantity, partitioned vs reference:" in out
    for case in ("coupled-mlp", "sfno", "healpix"):
        assert any(
            line.startswith(case) and line.rstrip().endswith("equivalent")
            for line in out.splitlines()
        ), case
    assert "ALL CHECKS PASSED" in out
    assert sorted(p.name for p in (tmp_path / "g").glob("*.pt")) == [
        "coupled-mlp-r2.pt",
        "healpix-r2.pt",
        "sfno-r2.pt",
    ]

    again = _main_job("--ranks", "2", "--no-faults", "--golden-dir", "g", cwd=tmp_path)
    assert again.returncode == 0
    assert again.stdout.count("  passed  ") == 3  # each golden checked


def test_the_main_job_injects_faults_and_reports_each_as_caught(tmp_path):
    proc = _main_job("--ranks", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "3/3 faults caught" in proc.stdout  # with 2 ranks only the MLP's layouts apply
    assert "no-grad-sync" in proc.stdout and "grad (+" in proc.stdout


def test_a_bad_rank_count_is_a_usage_error(tmp_path):
    proc = _main_job("--ranks", "0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--ranks must be an integer >= 1, got 0" in proc.stderr


def test_a_zero_or_negative_timeout_is_a_usage_error(tmp_path):
    for value in ("0", "-1"):
        proc = _main_job("--timeout", value, "--no-faults", cwd=tmp_path)
        assert proc.returncode == 2
        assert f"--timeout must be a positive number of seconds, got {float(value):g}" in (
            proc.stderr
        )


def test_far_more_ranks_than_cores_is_refused_with_the_way_to_insist(tmp_path):
    proc = _main_job("--ranks", "100000", "--no-faults", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--ranks 100000: 100000 rank processes on a machine with" in proc.stderr
    assert "pass --oversubscribe to insist" in proc.stderr
