"""``compare_tensors`` has two paths: every entry finite (the usual case, in a third of the
tensor operations) and the general one; on finite values they must agree to the bit. And
``all_finite``, the judges' one-pass scan before they look tensor by tensor."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.compare import SCAN_TOGETHER, Bound, all_finite, compare_tensors

FINITE = st.floats(allow_nan=False, allow_infinity=False, width=64)
# values of every scale, exact zeros (cancelled entries) and subnormals among them
VALUE = st.one_of(FINITE, st.just(0.0), st.floats(-1e-310, 1e-310, allow_nan=False))


@settings(max_examples=200, deadline=None, database=None)
@given(
    pairs=st.lists(st.tuples(VALUE, VALUE), min_size=1, max_size=12),
    bound=st.sampled_from([Bound(0.0, 0.0), Bound(1e-12, 1e-12), Bound(1e-5, 1e-8)]),
    complex_=st.booleans(),
    spread=st.booleans(),
)
def test_the_finite_path_agrees_with_the_general_one(pairs, bound, complex_, spread):
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    e = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    if complex_:
        a, e = torch.complex(a, e.flip(0)), torch.complex(e, a.flip(0))
    if not math.isfinite(float((a - e).abs().max())):
        return  # the difference overflows: both take the general path
    allowed = e.abs().to(torch.float64) * 0.5 if spread else None
    fast = compare_tensors(a, e, bound, allowed=allowed)
    # the same values with a NaN on both sides appended (equal there: not a failure) take
    # the general path
    nan = torch.tensor([math.nan], dtype=a.dtype)
    more = None if allowed is None else torch.cat([allowed, torch.ones(1, dtype=torch.float64)])
    general = compare_tensors(
        torch.cat([a, nan]), torch.cat([e, nan]), bound, allow_nonfinite=True, allowed=more
    )
    assert (fast.ok, fast.count, fast.total + 1) == (general.ok, general.count, general.total)
    assert (fast.max_abs, fast.max_rel) == (general.max_abs, general.max_rel)
    if fast.count:
        assert fast.worst == general.worst
    assert (fast.of_allowed == general.of_allowed) or (
        math.isnan(fast.of_allowed) and math.isnan(general.of_allowed)
    )


def test_all_finite_scans_every_kind_of_value():
    ints = torch.tensor([2**62], dtype=torch.int64)
    ok = [None, ints, torch.tensor(True), torch.ones(2, dtype=torch.bfloat16), torch.zeros(0)]
    assert all_finite(ok) and all_finite([])
    for bad in (
        torch.tensor([1.0, math.inf], dtype=torch.float16),
        torch.tensor([complex(1.0, math.nan)]),
        torch.tensor(-math.inf, dtype=torch.float64),
    ):
        assert not all_finite([*ok, bad, torch.ones(3)])
    # a float64 value too large for float32 stays finite: the scan narrows nothing
    assert all_finite(
        [torch.ones(1, dtype=torch.float32), torch.tensor([1e300], dtype=torch.float64)]
    )


def test_all_finite_copies_only_small_tensors_together(monkeypatch):
    """A step of a large model holds millions of values: only the small tensors are
    gathered into one (bounded) copy; a large one is scanned where it lies."""
    gathered = []
    real_cat = torch.cat
    monkeypatch.setattr(
        torch, "cat", lambda ts: gathered.append(sum(t.numel() for t in ts)) or real_cat(ts)
    )
    large = torch.zeros(SCAN_TOGETHER + 1)
    assert all_finite([large, torch.ones(3), torch.ones(2, dtype=torch.float64)])
    assert gathered == [5]
    large[-1] = math.nan
    assert not all_finite([torch.ones(3), large])
    small_bad = torch.tensor([math.inf])
    assert not all_finite([large.nan_to_num(), small_bad])
