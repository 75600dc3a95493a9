"""Where a pool's ranks run (``harness.pool._cpus``): pinned in turn over the CPUs only
where the pool has more ranks than CPUs (``auto``), always (``on``), never (``off``)."""

from __future__ import annotations

import pytest

from harness.errors import ConfigError
from harness.pool import PoolRegistry, RankPool
from harness.pool._cpus import PIN_MODES, check_pin, rank_cpus, worker_offset


@pytest.mark.parametrize(
    ("world", "pin", "allowed", "expected"),
    [
        (4, "auto", [0, 1], [0, 1, 0, 1]),  # oversubscribed: neighbours on different CPUs
        (3, "auto", [5, 2], [2, 5, 2]),  # the CPUs this process may use, in order
        (8, "auto", [0, 1, 2], [0, 1, 2, 0, 1, 2, 0, 1]),
        (2, "auto", [0, 1], [None, None]),  # as many CPUs as ranks: the scheduler does better
        (4, "auto", list(range(16)), [None] * 4),
        (2, "on", [0, 1, 2, 3], [0, 1]),
        (4, "off", [0, 1], [None] * 4),
        (4, "on", [3], [None] * 4),  # one CPU: nothing to choose
        (4, "auto", [], [None] * 4),  # the OS did not say
    ],
)
def test_rank_cpus(world, pin, allowed, expected):
    assert rank_cpus(world, pin, allowed, offset=0) == expected


def test_the_pools_of_several_xdist_workers_share_the_cpus_evenly(monkeypatch):
    load = {0: 0, 1: 0}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        for cpu in rank_cpus(3, "auto", [0, 1]):
            load[cpu] += 1
    assert load == {0: 3, 1: 3}  # not 4 and 2, as with both workers starting on CPU 0


@pytest.mark.parametrize(("name", "offset"), [("gw3", 12), ("", 0), ("master", 0), ("gwx", 0)])
def test_worker_offset(name, offset, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", name)
    assert worker_offset(4) == offset


@pytest.mark.parametrize("bad", ["yes", "", "AUTO", None])
def test_a_bad_pin_mode_is_one_config_error_naming_the_modes(bad):
    with pytest.raises(ConfigError, match="pin_ranks must be one of auto, on, off") as err:
        check_pin(bad)
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(ConfigError, match="pin_ranks must be one of"):
        RankPool(2, pin_ranks=bad)
    with pytest.raises(ConfigError, match="pin_ranks must be one of"):
        PoolRegistry(pin_ranks=bad)


def test_the_registry_hands_its_mode_to_every_pool():
    registry = PoolRegistry(pin_ranks="off")
    try:
        assert {registry.get(n).pin_ranks for n in (1, 2)} == {"off"}
    finally:
        registry.close()
    assert [check_pin(m) for m in PIN_MODES] == list(PIN_MODES)
