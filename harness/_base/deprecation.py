"""Old names kept working: one helper forwards a name that moved to its new home, warning once.

A module whose names moved ends with ``__getattr__ = forward(__name__, {name: home, ...})``.
The old import keeps working and says, once per name and process, where the name lives now
and when the old one goes; ``FORWARDS`` lists every forward, which ``CHANGELOG.md`` must list
too (``tests/unit/test_deprecation.py``). The home is imported only when the old name is asked
for: a low module (``harness.compare``) can forward to one above it without importing it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

#: the release that drops the old names
UNTIL = "0.4.0"
#: every forwarded name: (old module, name) -> new home module
FORWARDS: dict[tuple[str, str], str] = {}
_warned: set[tuple[str, str]] = set()


def forward(module: str, moved: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module``: each name of ``moved`` (name -> the module
    that holds it now) is fetched from its home, with one ``DeprecationWarning`` per name."""
    FORWARDS.update({(module, name): home for name, home in moved.items()})

    def __getattr__(name: str) -> object:
        home = moved.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if (module, name) not in _warned:
            _warned.add((module, name))
            warnings.warn(
                f"{module}.{name} moved to {home}.{name}: import it from {home} "
                f"(the old name goes in harness {UNTIL})",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(importlib.import_module(home), name)

    return __getattr__
