"""Mutation testing of a model's distributed code: would its checks notice a wrong call?

One wing:

- ``catalogue``: the mutants (kinds, which call sites get which), the sites, the outcomes and
  the table; pure data and rules;
- ``mode``: a run's frozen ``MutantMode`` (record the call sites, or inject one mutant), set
  by the campaign in a context variable, carried to the ranks on ``RunCall.mutation``; the
  one place that says a mutant's rerun locates nothing (``MutantMode.verdict_only``);
- ``inject``: the rank side, recording the call sites a run reaches and injecting one mutant
  at its site; it owns that state (``harness._rank.intercept``'s watchers only call it);
- ``campaign``: the one loop over sites and mutants, given a ``rerun`` by its callers:
  ``equivalence`` (a set of equivalence checks, without pytest: ``harness-check --mutants``)
  and the pytest hooks, ``harness.plugin.mutants`` (``pytest --spatial-mutants``).

``Check`` and ``run_mutants`` (once ``harness._mutation``'s own) are imported from here on
first use, so that the pure rooms load without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Check", "run_mutants"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from harness._mutation import equivalence

        return getattr(equivalence, name)
    raise AttributeError(f"module 'harness._mutation' has no attribute {name!r}")
