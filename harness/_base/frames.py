"""Which frames of a stack are the harness's own plumbing, and which are the code under test.

One definition, read from the package's layout, for everything that walks a stack: the
interceptor's call sites and dtype watch (``harness._rank.intercept``), a rank's traceback
(``harness.errors.user_traceback``) and the stacks of a hang (``harness.pool._processes``).

- **model code**: every file outside the package, and the package's subpackages of models
  (``MODEL_PACKAGES``: the built-in steppers, the contributed adapters of real models), which
  are code under test like a user's own;
- **the library a model calls** (``LIBRARY``: halo exchanges, gathers, partitions, groups):
  the harness's, but on the model's side of a call, so a call site and kept in tracebacks;
- **plumbing**: every other module of the package (the pool, the rank's loop, the watchers,
  ``run_case``, the checks). User code runs *inside* plumbing: walking a stack outwards, the
  first plumbing frame after a frame of user code is where the harness started that code
  (``run_case``, a rank's run of a function), and nothing beyond it is the user's.

The standard library (``multiprocessing``'s start of a rank, ``contextlib``'s wrappers) is
nobody's call site. A new module of the package is plumbing unless it is a model package or
added to ``LIBRARY``: the boundary cannot drift with a file list kept elsewhere.

Imports nothing of the harness (the bottom layer).
"""

from __future__ import annotations

import os
import sysconfig
from types import FrameType

#: the harness package's directory, with a trailing separator
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: subpackages that hold models: code under test, never plumbing
MODEL_PACKAGES = ("steppers", "contrib")
#: modules whose functions a model calls (never plumbing, but the harness's)
LIBRARY = ("collectives", "adopt", "adapters", "partition", "topology")

_MODELS = tuple(PACKAGE + name + os.sep for name in MODEL_PACKAGES)
_LIBRARY = frozenset(PACKAGE + name + ".py" for name in LIBRARY)
_STDLIB = tuple(
    {os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")}
)


def plumbing(path: str) -> bool:
    """Is ``path`` (a code object's file name) one of the harness's own internals?"""
    return path.startswith(PACKAGE) and not path.startswith(_MODELS) and path not in _LIBRARY


def harness_library(path: str) -> bool:
    """Is ``path`` the harness's library that models call (``LIBRARY``)?"""
    return path in _LIBRARY


def standard_library(path: str) -> bool:
    """Is ``path`` Python's own library (not a package installed beside it), or a wrapper
    that stands between a caller and torch (``typing_extensions.deprecated``, which torch
    2.13 puts around the functions it deprecates)?"""
    return (
        (path.startswith(_STDLIB) and "site-packages" not in path and "dist-packages" not in path)
        or path.startswith("<frozen ")
        or os.path.basename(path) == "typing_extensions.py"
    )


def user_site(frame: FrameType | None, skip: tuple[str, ...] = ()) -> tuple[str, str]:
    """Walk ``frame`` outwards: (the innermost frame of model code, else of the harness's
    library), each as ``"model.py:42"`` (``""`` where none). Frames whose file starts with
    one of ``skip`` (torch's directory) are passed over, and so are the standard library's
    and plumbing frames met before any user code; the first plumbing frame after user code
    ends the walk, and so does the standard library after plumbing alone (an operation the
    harness issued itself, on a rank that multiprocessing started)."""
    library = ""
    entered = False  # a frame of user code (model or library) was passed
    inside = False  # a plumbing frame was passed
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(skip):
            pass
        elif standard_library(path):
            if inside and not entered:
                break  # past the harness's own operation: a rank's start, nobody's code
        elif plumbing(path):
            inside = True
            if entered:
                break  # where the harness started the user's code: none of it lies beyond
        else:
            entered = True
            here = f"{os.path.basename(path)}:{frame.f_lineno}"
            if not harness_library(path):
                return here, library
            library = library or here
        frame = frame.f_back
    return "", library
