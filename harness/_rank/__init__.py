"""The rank side: what runs inside a rank process, and nothing of pytest.

- ``loop``: a rank's life (rendezvous, its run loop, the events it sends the pool);
- ``run``: one run of a case on a rank or as the reference (``run_case``);
- ``intercept``: the watchers of torch.distributed (the deadlock proof's evidence, the
  mutants' sites, the dtype watch of collectives);
- ``dtypes``: what precision each module's outputs came out in;
- ``state``: the process state a run must leave as it found it;
- ``preload``: what the fork server imports once.

Every frame of this package is the harness's plumbing by its location
(``harness._base.frames``): the boundary is the folder, not a list of files.
"""
