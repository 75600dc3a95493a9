"""Locating through the plugin: a failing check's text, ``--spatial-locate`` and its ini."""

from __future__ import annotations

from tests.plugin.test_plugin import downstream

LOCATED = """

def test_a_passing_check_is_located_only_on_request(spatial):
    report = spatial.check(Scale())
    assert report.location is not None, "not located"
    assert report.first_divergence is None
"""


def test_a_failing_check_names_its_first_divergence_in_the_failure(pytester):
    pytester.makepyfile(test_down=downstream(broken=True))
    result = pytester.runpytest_subprocess("--spatial-ranks=2", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    # the model is one Linear without gradient sync, and declares no partition: its only
    # activation gradient (at its output) cannot be placed, but the ranks' gradients before
    # the (missing) synchronisation add up to the reference's: the evidence blames the sync
    result.stdout.fnmatch_lines(
        [
            "*First: rank 0: grad 'weight' at step 0*",
            "*First divergence: gradient synchronisation of 'weight' (backward, owner '' "
            "(Linear)), step 0: the gradient of 'weight' departs after its synchronisation*",
            "*Not compared (no layout the case declares fits*'' grad_output*",
        ]
    )
    result.stdout.no_fnmatch_line("*backward of '' (Linear)*")  # its backward made it right


def test_spatial_locate_and_its_ini_locate_passing_checks(pytester):
    correct = downstream(broken=False).replace("golden=True", "")  # no golden here
    pytester.makepyfile(test_down=correct + LOCATED)
    plain = pytester.runpytest_subprocess("--spatial-ranks=2", "-p", "no:cacheprovider")
    plain.assert_outcomes(passed=1, failed=1)
    plain.stdout.fnmatch_lines(["*not located*"])
    flag = pytester.runpytest_subprocess(
        "--spatial-ranks=2", "--spatial-locate", "-p", "no:cacheprovider"
    )
    flag.assert_outcomes(passed=2)
    pytester.makeini("[pytest]\nspatial_locate = true\n")
    ini = pytester.runpytest_subprocess("--spatial-ranks=2", "-p", "no:cacheprovider")
    ini.assert_outcomes(passed=2)


def test_spatial_calibrate_prints_each_quantitys_noise_error_and_supported_rtol(pytester):
    correct = downstream(broken=False).replace("golden=True", "")
    pytester.makepyfile(test_down=correct)
    result = pytester.runpytest_subprocess(
        "--spatial-ranks=2", "--spatial-calibrate", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*spatial calibration (--spatial-calibrate)*",
            "*test_down.py::test_scale_is_equivalent (Scale, float64):",
            "  loss: rounding noise *, partitioned run * -> supports rtol *e-1* (now 1e-10)",
            "  grad: rounding noise *, partitioned run * -> supports rtol *e-1* (now 1e-10)",
            "  field: rounding noise *",
        ]
    )
