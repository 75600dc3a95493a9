"""An option's value that pytest took for a test path: refused in one line.

pytest fixes its rootdir and config file from the path arguments before it loads plugins
by entry point, so before it knows that ``--spatial-plots`` takes a value: in
``pytest --spatial-plots ../plots`` it reads ``../plots`` as a path, and where that path
lies outside the project, it looks for ``pytest.ini`` above ``../plots``, not above the
tests: the project's ini (its ``golden_dir``, ``spatial_ranks``...) is ignored and goldens
are looked for in the wrong place. Nothing can undo that decision once made, so where the
value changed it the session stops, saying to write ``--spatial-plots=../plots``; where it
changed nothing (a directory inside the project, a number), the space is fine.
"""

from __future__ import annotations

import inspect
import itertools
import os
import shlex
from pathlib import Path

import pytest

#: the option group whose value-taking options are checked: every one of the plugin's
GROUP = "harness"


def value_options(parser: pytest.Parser) -> list[str]:
    """The plugin's long options that take a value (``--spatial-plots``, ``--spatial-ranks``
    ...), read from the parser: an option another part of the plugin adds is checked too."""
    found = []
    for option in parser.getgroup(GROUP).options:
        if _takes_a_value(option.attrs()):
            found += [name for name in option.names() if name.startswith("--")]
    return found


def _takes_a_value(attrs: dict[str, object]) -> bool:
    """pytest 9 gives argparse's attributes (``nargs`` 0: a flag); pytest 8 the ones given."""
    if "nargs" in attrs:
        return attrs["nargs"] != 0
    return attrs.get("action", "store") in ("store", "append")


def taken_as_paths(args: list[str], options: list[str], here: Path) -> list[tuple[str, str]]:
    """``(option, value)`` for each of ``options`` written with a space in ``args`` whose
    value names an existing file or directory: what pytest's first look took for a path."""
    taken = []
    for option, value in itertools.pairwise(args):
        if option in options and not value.startswith("-"):
            if (here / value.split("::")[0]).exists():
                taken.append((option, value))
    return taken


def check_rootdir(early_config: pytest.Config, parser: pytest.Parser) -> None:
    """A ``pytest.UsageError`` when an option's value, written with a space, moved pytest's
    rootdir or config file; nothing otherwise."""
    here = Path(early_config.invocation_params.dir)
    args = shlex.split(os.environ.get("PYTEST_ADDOPTS", "")) + [
        str(a) for a in early_config.invocation_params.args
    ]
    taken = taken_as_paths(args, value_options(parser), here)
    if not taken:
        return
    decided = (Path(early_config.rootpath), early_config.inipath)
    meant = _setup_without_values(parser, args, here)
    if meant == decided:
        return  # the value lies inside the project: the space changed nothing
    written = ", ".join(f"{o} {v}" for o, v in taken)
    fix = ", ".join(f"{o}={v}" for o, v in taken)
    got = f"rootdir {decided[0]} with {_ini(decided[1])}"
    instead = f" instead of {meant[0]} with {_ini(meant[1])}" if meant else ""
    raise pytest.UsageError(
        f"{written}: pytest read {taken[0][1]} as a test path before the harness's options "
        f"were known and took {got}{instead}; write {fix}"
    )


def _ini(path: Path | None) -> str:
    return path.name if path is not None else "no config file"


def _setup_without_values(
    parser: pytest.Parser, args: list[str], here: Path
) -> tuple[Path, Path | None] | None:
    """The rootdir and config file pytest decides for ``args`` now that every option is
    known (their values no longer read as paths); ``None`` where this pytest's rule cannot
    be asked (a private function whose signature changed): then any value taken for a path
    is refused, which never lets a wrong rootdir through."""
    try:
        from _pytest.config.findpaths import determine_setup

        ns = parser.parse_known_args(args)
        given = {
            "inifile": ns.inifilename,
            "override_ini": ns.override_ini,
            "args": ns.file_or_dir,
            "rootdir_cmd_arg": ns.rootdir or None,
            "invocation_dir": here,
        }
        accepted = inspect.signature(determine_setup).parameters
        rootpath, inipath, *_ = determine_setup(**{k: v for k, v in given.items() if k in accepted})
        return Path(rootpath), inipath
    except Exception:  # noqa: BLE001 - any change of pytest's internals: refuse, never guess
        return None
