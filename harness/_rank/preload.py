"""Imported once by the forkserver, so rank processes forked from it start warm.

Only imports: nothing here starts a thread (fork copies no threads, and a thread pool that
existed before fork would be left broken in the child). Threads are limited first, since
OpenMP reads its environment when torch loads.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch._dynamo  # what init_process_group pulls in lazily: ~2 s a rank
import torch.distributed

try:  # cheap once torch._dynamo is loaded (~10 ms), ~7 s per rank otherwise
    import torch_harmonics.distributed  # noqa: F401
except ImportError:
    pass

try:  # the HEALPix stepper's cell positions (astropy under it: ~280 modules, ~1 s here, once)
    # instead of 1-5 s in every rank of every pool that batches a HEALPix case: a layout
    # sweep up to 8 ranks starts 8 pools, 36 ranks; and shared with them, not copied
    import healpy  # noqa: F401
except ImportError:
    pass

# the rank side only: a rank runs the loop and the calls it unpickles, never the pool
import harness._rank.loop
import harness._rank.run  # noqa: F401
from harness._base.compat import exit_fast_at_exit, inside_forkserver_start

# When the session that owns this fork server dies (SIGKILL included), the server gets EOF
# and exits; skip tearing down torch then, which otherwise kept it alive for seconds.
if inside_forkserver_start():
    exit_fast_at_exit()

del torch
