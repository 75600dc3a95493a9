"""``compare_tensors`` has two paths: every entry finite (the usual case, in a third of the
tensor operations) and the general one; on finite values they must agree to the bit. And
``all_finite``, the judges' one-pass scan before they look tensor by tensor; ``pass_many``,
the judges' comparison of many pairs at once, which gives a passing pair the very
``Difference`` ``compare_tensors`` gives it."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.compare import SCAN_TOGETHER, Bound, all_finite, compare_tensors, pass_many

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


BOUNDS = [Bound(0.0, 0.0), Bound(1e-12, 1e-12), Bound(1e-5, 1e-8), Bound(1e-7, 1e-5)]


@st.composite
def pair_lists(draw):  # type: ignore[no-untyped-def]
    """Pairs of a few sizes (so several share a stack), each a copy of its reference with a
    drawn error at drawn entries: most pass, some fail, some hold a NaN or inf."""
    pairs = []
    for _ in range(draw(st.integers(1, 10))):
        size = draw(st.sampled_from([1, 3, 8]))
        e = torch.tensor(draw(st.lists(VALUE, min_size=size, max_size=size)), dtype=torch.float64)
        error = draw(st.sampled_from([0.0, 1e-300, 1e-14, 1e-9, 1e-3, math.inf, math.nan]))
        a = e.clone()
        a[draw(st.integers(0, size - 1))] += error
        dtype = draw(st.sampled_from([torch.float64, torch.float32]))
        pairs.append((a.to(dtype), e.to(dtype), draw(st.sampled_from(BOUNDS))))
    return pairs


@settings(max_examples=300, deadline=None, database=None)
@given(pairs=pair_lists())
def test_many_pairs_at_once_pass_exactly_where_and_as_each_on_its_own_passes(pairs):
    together = pass_many(pairs)
    for (a, e, bound), d in zip(pairs, together, strict=True):
        alone = compare_tensors(a, e, bound, allow_nonfinite=True)
        if d is None:
            # left to the pair's own comparison: it fails, or holds a NaN or inf
            assert not alone.ok or not (torch.isfinite(a).all() and torch.isfinite(e).all())
        else:
            assert d == alone  # every field, worst entry included, to the bit


def test_pairs_of_other_kinds_are_left_to_their_own_comparison():
    f = torch.ones(3, dtype=torch.float64)
    bound = Bound(1e-9, 1e-9)
    pairs = [
        None,
        (torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64), bound),
        (f.to(torch.complex128), f.to(torch.complex128), bound),
        (f.to(torch.float32), f, bound),  # dtypes differ: compare_tensors says so
        (f, torch.ones(1, 3, dtype=torch.float64), bound),  # shapes differ
        (torch.zeros(0), torch.zeros(0), bound),
        (torch.ones(SCAN_TOGETHER + 1), torch.ones(SCAN_TOGETHER + 1), bound),
        (f, f.clone(), bound),
    ]
    assert pass_many(pairs)[:-1] == [None] * (len(pairs) - 1)
    assert pass_many(pairs)[-1] == compare_tensors(f, f.clone(), bound)


def test_a_pair_near_its_bound_is_bounded_by_its_references_magnitude():
    # |a - e| just under rtol * |e|, over rtol * |a|: the bound is the reference's
    e = torch.tensor([1.0, 2.0], dtype=torch.float64)
    a = e - 1e-5 * (1 - 1e-9) * e
    bound = Bound(rtol=1e-5, atol=0.0)
    (d,) = pass_many([(a, e, bound)])
    assert d is not None and d == compare_tensors(a, e, bound) and d.ok
