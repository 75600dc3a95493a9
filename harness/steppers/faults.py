"""What every built-in stepper's ``faults=`` switch shares: checking the ids it is given.

A leaf: the steppers import it, and it imports none of them nor the catalogue (which
imports the steppers), so the steppers and the catalogue do not import each other.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from harness.errors import ConfigError


def check_faults(
    faults: str | Iterable[str], known: Collection[str], stepper: str
) -> frozenset[str]:
    """``faults`` (one id or several) as a frozenset of ``stepper``'s fault ids, or a
    ``ConfigError`` listing the valid ones.

    >>> sorted(check_faults("a", {"a", "b"}, "toy"))
    ['a']
    >>> check_faults({"c"}, {"a", "b"}, "toy")
    Traceback (most recent call last):
    ...
    harness.errors.ConfigError: unknown toy fault(s) ['c']; valid ids: a, b
    """
    ids = frozenset((faults,) if isinstance(faults, str) else faults)
    unknown = ids - frozenset(known)
    if unknown:
        raise ConfigError(
            f"unknown {stepper} fault(s) {sorted(unknown)}; valid ids: {', '.join(sorted(known))}"
        )
    return ids
