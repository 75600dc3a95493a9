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
    assert "  [1/3] coupled-mlp:no-grad-sync: caught as grad (+" in proc.stdout
    # each caught fault with where its first divergence is (harness.steppers.catalogue.LOCATED)
    assert "first divergence: field 'out'" in proc.stdout
    assert "first divergence: backward of '' (CoupledMLP)" in proc.stdout


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


def test_three_ranks_explain_every_row_and_pass(tmp_path):
    proc = _main_job("--ranks", "3", cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "  [1/3] coupled-mlp (37 positions): equivalent, golden none (" in out
    assert "(no goldens recorded for 3 ranks in" in out and "not a failure)" in out
    assert "3/3 faults caught" in out
    assert "skipped 29 fault(s), its layout is sized for 4 ranks (run --ranks 4): sfno:" in out
    assert "ALL CHECKS PASSED" in out


def test_one_rank_skips_the_faults_it_cannot_have_with_the_reason(tmp_path):
    proc = _main_job("--ranks", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Injected faults (0)" in proc.stdout
    assert (
        "skipped 3 fault(s), one rank has no communication to get wrong: coupled-mlp:no-grad-sync"
    ) in proc.stdout
    assert "MISSED" not in proc.stdout


def test_k_selects_layouts_and_faults_by_label_and_every_table_fits_100_columns(tmp_path):
    proc = _main_job("--ranks", "4", "-k", "sfno", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Layouts (4):" in out and "healpix" not in out.split("Injected faults")[0]
    assert "Injected faults (16):" in out and "16/16 faults caught" in out
    table = out.split("partitioned vs reference:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in table[2:]] == ["sfno"] * 4
    assert max(len(line) for line in table) <= 100
    faults = out.split("verdict\n")[-1].split("\n16/16")[0].splitlines()
    assert max(len(line) for line in faults) <= 100


def test_a_failing_row_says_why_and_the_exit_code_is_1(tmp_path):
    # a golden that no longer matches: recorded, then tampered with
    first = _main_job(
        "--ranks",
        "2",
        "--only",
        "layouts",
        "-k",
        "coupled",
        "--golden-dir",
        "g",
        "--update-goldens",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stdout
    import torch

    path = tmp_path / "g" / "coupled-mlp-r2.pt"
    data = torch.load(path, weights_only=True)
    data["tensors"]["step0/loss"] = data["tensors"]["step0/loss"] + 1
    torch.save(data, path)
    proc = _main_job(
        "--ranks", "2", "--only", "layouts", "-k", "coupled", "--golden-dir", "g", cwd=tmp_path
    )
    assert proc.returncode == 1
    assert "1 CHECK(S) FAILED" in proc.stdout
    assert (
        "  coupled-mlp: its golden differs (g/coupled-mlp-r2.pt); if the change is intended, "
        "run with --update-goldens"
    ) in proc.stdout


def test_a_real_model_that_is_not_installed_is_a_usage_error_naming_the_extra(tmp_path):
    for model, package in (("fme", "fme"), ("anemoi", "anemoi")):
        # sys.modules[name] = None makes `import name` fail, installed or not
        code = (
            f"import sys; sys.modules[{package!r}] = None; from harness.__main__ import main; "
            f"sys.exit(main(['--model', {model!r}]))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        error = proc.stderr.splitlines()[-1]
        assert error.startswith(f"harness-check: error: --model {model}: harness.contrib.{model}")
        assert f'pip install "pytest-spatial-harness[{model}]"' in error


def test_the_built_in_steppers_kill_at_least_nine_in_ten_of_their_mutants(tmp_path):
    proc = _main_job("--ranks", "4", "--mutants", "--mutants-min-score", "90", cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    (score,) = [line for line in out.splitlines() if line.startswith("spatial mutation score:")]
    killed, total = map(int, score.split(": ")[1].split(" ")[0].split("/"))
    assert total >= 40 and killed / total >= 0.9, score
    # every survivor says why it cannot be seen on these layouts
    survivors = [line for line in out.splitlines() if "  SURVIVED" in line]
    assert all("SURVIVED: " in line for line in survivors), survivors
    assert "collectives.py:" in out and "sfno.py:" in out and "healpix.py:" in out


def test_a_mutation_score_below_the_minimum_exits_1(tmp_path):
    proc = _main_job("--ranks", "4", "--mutants", "-k", "healpix", "--mutants-min-score", "100",
                     cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stdout
    assert "is below --mutants-min-score 100%" in proc.stdout
