"""Where a failing report points in the user's code (``harness.report.sites``), on hand-made
reports: the rule that places CI annotations."""

from __future__ import annotations

import inspect
import os

import torch

import harness.collectives
import harness.pool
from harness import EquivalenceReport, Mismatch, SpatialCase
from harness.divergence import Divergence, Location
from harness.report.sites import case_source, failure_sites, stack_frames, user_code

TORCH_LINEAR = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "linear.py")
MODEL = "/project/model.py"  # outside torch, the standard library and the harness: the user's


class Case(SpatialCase):
    def build(self, topo):  # where the model's gradients are hooked
        raise NotImplementedError

    def forward(self, model, batch, topo):  # calls the model, makes the loss and the fields
        raise NotImplementedError


def _line(method: str) -> int:
    return inspect.getsourcelines(getattr(Case, method))[1]


def _report(
    mismatches: list[Mismatch], found: Divergence | None = None, **sources
) -> EquivalenceReport:
    location = Location(first=found, sources=dict(sources)) if found is not None else None
    return EquivalenceReport(
        "c", 2, 2, "", 2, "float64", None, mismatches, first_divergence=found, location=location
    )


def _divergence(module: str | None, **kw) -> Divergence:
    base = dict(
        direction="forward",
        module=module,
        module_type="T",
        quantity="output",
        step=0,
        rank=1,
        max_abs=1.0,
        max_rel=0.5,
        where="",
        noise=1e-16,
        multiple=1e15,
        dtype="float64",
    )
    return Divergence(**{**base, **kw})  # type: ignore[arg-type]


GRAD = [Mismatch("grad", "w", 0, 1, 1.0, 0.5)]


def test_a_module_that_is_not_the_users_is_named_by_the_nearest_enclosing_module_that_is():
    found = _divergence("blocks.1.proj")
    sources = {"blocks.1.proj": (TORCH_LINEAR, 120), "blocks.1": (MODEL, 40), "": (MODEL, 9)}
    [site] = failure_sites(_report(GRAD, found, **sources), Case())
    assert (site["file"], site["line"]) == (MODEL, 40)
    assert site["title"] == "c: first divergence, forward of 'blocks.1.proj' (T)"
    assert site["message"].startswith("First divergence: forward of 'blocks.1.proj' (T), step 0")
    assert "\nWhat to do: what it consumed matches" in site["message"]


def test_a_users_module_is_named_by_its_own_forward():
    found = _divergence("blocks.1", direction="backward", quantity="grad_input")
    sources = {"blocks.1": (MODEL, 40), "": (MODEL, 9)}
    [site] = failure_sites(_report(GRAD, found, **sources), Case())
    assert (site["file"], site["line"]) == (MODEL, 40)


def test_with_no_users_module_on_the_path_the_cases_forward_is_named():
    found = _divergence("proj")
    [site] = failure_sites(_report(GRAD, found, proj=(TORCH_LINEAR, 120)), Case())
    assert (site["file"], site["line"]) == (__file__, _line("forward"))


def test_a_gradient_synchronisation_is_named_by_the_cases_build_and_the_loss_by_its_forward():
    sync = _divergence("proj", cause="synchronisation", name="proj.weight")
    [site] = failure_sites(_report(GRAD, sync, proj=(MODEL, 3)), Case())
    assert (site["file"], site["line"]) == (__file__, _line("build"))
    loss = _divergence(None, name="the loss")
    [site] = failure_sites(_report(GRAD, loss), Case())
    assert site["line"] == _line("forward")


def test_the_harnesss_own_defaults_of_a_case_name_no_line():
    assert case_source(Case(), "batch") is None  # SpatialCase's, not the user's
    batch = _divergence(None, name="the batch")
    assert failure_sites(_report(GRAD, batch), Case()) == []


def test_a_passing_or_unlocated_report_names_no_line():
    assert failure_sites(_report([]), Case()) == []
    assert failure_sites(_report(GRAD), Case()) == []


def _stack(*frames: tuple[str, int, str]) -> str:
    """A faulthandler dump, innermost frame first."""
    body = "\n".join(f'  File "{path}", line {line} in {name}' for path, line, name in frames)
    return f"Current thread 0x7f (most recent call first):\n{body}"


def test_a_deadlock_is_named_at_the_users_line_that_issued_the_collective():
    c10d = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    stack = _stack(
        (c10d, 4287, "all_gather"),
        (harness.collectives.__file__, 158, "_agree"),  # the harness's library: not the user's
        (MODEL, 194, "gather_latent"),
        (MODEL, 330, "forward"),
        (harness.pool.__file__, 10, "run"),
    )
    waits = "waits in all_gather #1 on group 1; rank 1 never entered it"
    mismatches = [
        Mismatch("deadlock", "c", None, 1, where="returned after 0 collectives"),  # no stack
        Mismatch("deadlock", "c", 0, 0, where=waits, detail=stack),
        Mismatch("deadlock", "c", 0, 2, where=waits, detail=stack),
    ]
    [site] = failure_sites(_report(mismatches), Case())
    assert (site["file"], site["line"]) == (MODEL, 194)
    assert site["title"] == "c: deadlock on ranks 0, 2"
    assert site["message"].splitlines() == [
        f"rank 0: deadlock: {waits}",
        f"rank 2: deadlock: {waits}",
        "rank 1: deadlock: returned after 0 collectives",  # the culprit's evidence, said
    ]


def test_a_raising_rank_is_named_at_the_innermost_frame_of_the_users_code():
    tb = (
        "Traceback (most recent call last):\n"
        f'  File "{harness.pool.__file__}", line 5, in run\n'
        f'  File "{MODEL}", line 12, in forward\n'
        '  File "/project/layers.py", line 30, in halo\n'
        f'  File "{TORCH_LINEAR}", line 125, in forward\n'
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    )
    error = Mismatch("error", "c", 0, 1, where="RuntimeError: mat1", detail=tb)
    [site] = failure_sites(_report([error]), Case())
    assert (site["file"], site["line"]) == ("/project/layers.py", 30)  # the innermost
    assert site["title"] == "c: error on rank 1"


def test_stack_frames_read_tracebacks_and_faulthandler_dumps_innermost_first():
    assert stack_frames(_stack(("b.py", 2, "g"), ("a.py", 1, "f"))) == [
        ("b.py", 2, "g"),
        ("a.py", 1, "f"),
    ]
    assert user_code(MODEL) and not user_code(TORCH_LINEAR)
    assert not user_code(harness.pool.__file__) and not user_code(harness.collectives.__file__)
    assert user_code(os.path.join(os.path.dirname(harness.__file__), "steppers", "sfno.py"))


def test_ranks_stuck_at_different_lines_are_named_at_each_the_skipping_ranks_too():
    # rank 1 skipped the halo's collective and waits in the loss's: its own line is named
    halo, loss = _stack((MODEL, 41, "halo")), _stack(("/project/loss.py", 7, "reduce"))
    mismatches = [
        Mismatch("deadlock", "c", 0, 0, where="waits in all_reduce #2 (8 elements)", detail=halo),
        Mismatch("deadlock", "c", 0, 1, where="waits in all_reduce #2 (1 element)", detail=loss),
    ]
    sites = failure_sites(_report(mismatches), Case())
    assert [(s["file"], s["line"], s["title"]) for s in sites] == [
        (MODEL, 41, "c: deadlock on rank 0"),
        ("/project/loss.py", 7, "c: deadlock on rank 1"),
    ]
