"""Mutation testing of a model's distributed code: would its checks notice a wrong call?

One wing, below everything that runs a check (the rank side calls its injector), so its
callers live with the faces that drive a campaign:

- ``catalogue``: the mutants (``MutantKind``, which call sites get which), the sites, the
  outcomes and the table; pure data and rules;
- ``mode``: a run's frozen ``MutantMode`` (record the call sites, or inject one mutant), set
  by the campaign in a context variable, carried to the ranks on ``RunCall.mutation``; the
  one place that says a mutant's rerun locates nothing (``MutantMode.verdict_only``);
- ``inject``: the rank side, recording the call sites a run reaches and injecting one mutant
  at its site; it owns that state (``harness._rank.intercept``'s watchers only call it);
- ``campaign``: the one loop over sites and mutants, given a ``rerun`` by its callers:
  ``harness.__main__.run_mutants`` (a set of equivalence checks, without pytest:
  ``harness-check --mutants``) and the pytest hooks, ``harness.plugin.mutants``
  (``pytest --spatial-mutants``).
"""
