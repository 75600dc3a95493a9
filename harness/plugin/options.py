"""The plugin's options: declared (``pytest_addoption``) and parsed once, into ``Settings``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.errors import ConfigError
from harness.plugin._rootdir import check_rootdir
from harness.pool import (
    DEADLOCK_WINDOW,
    DEFAULT_TIMEOUT,
    MIN_TIMEOUT,
    OVERSUBSCRIBE_LIMIT,
    PIN_MODES,
    START_METHODS,
    check_oversubscription,
)

DEFAULT_RANKS = 4


def pytest_addoption(parser: pytest.Parser) -> None:
    # Declarations only, in the order --help shows them: runs, mutants, diagnosis, goldens, ini.
    group = parser.getgroup("harness", "spatial equivalence (harness)")
    _add_run_options(group)
    _add_mutant_options(group)
    _add_diagnosis_options(group)
    _add_golden_options(group)
    _add_ini(parser)
    _add_github_options(group, parser)


#: the values ``--spatial-github`` and the ini ``spatial_github`` take (``plugin.github``)
GITHUB_MODES = ("auto", "on", "off")


def _add_github_options(group: pytest.OptionGroup, parser: pytest.Parser) -> None:
    group.addoption(
        "--spatial-github",
        dest="spatial_github",
        default=None,
        choices=GITHUB_MODES,
        help="GitHub Actions annotations at the failing line of the model and a job summary "
        "in $GITHUB_STEP_SUMMARY: auto (when GITHUB_ACTIONS=true), on or off (default: ini "
        "spatial_github or auto)",
    )
    parser.addini("spatial_github", "default for --spatial-github (auto, on, off)", default="auto")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser) -> None:
    # the first moment the plugin's options are known: was a value read as a test path?
    check_rootdir(early_config, parser)


def _add_run_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--spatial-ranks",
        dest="spatial_ranks",
        default=None,
        metavar="N",
        help=f"ranks per partitioned run (integer >= 1; default: ini spatial_ranks or "
        f"{DEFAULT_RANKS})",
    )
    group.addoption(
        "--spatial-timeout",
        dest="spatial_timeout",
        default=None,
        metavar="SECONDS",
        help=f"per-run timeout before every rank's stack is dumped (default {DEFAULT_TIMEOUT:g})",
    )
    group.addoption(
        "--update-goldens",
        action="store_true",
        dest="update_goldens",
        help="write golden files (atomically) instead of comparing with them",
    )
    group.addoption(
        "--spatial-plots",
        dest="spatial_plots",
        default=None,
        metavar="DIR",
        help="write a PNG error map of each failing field to DIR (needs matplotlib)",
    )
    group.addoption(
        "--spatial-report",
        dest="spatial_report",
        default=None,
        metavar="PATH",
        help="at session end, write one self-contained HTML page to PATH: the summary, and "
        "each failure's report with its error maps, rollout curve and layout map",
    )
    group.addoption(
        "--spatial-deadlock-window",
        dest="spatial_deadlock_window",
        default=None,
        metavar="SECONDS",
        help=f"fail a run as a deadlock once every running rank has waited this long inside "
        f"torch.distributed with nothing completing (default {DEADLOCK_WINDOW:g}; 0: off, "
        "wait for the timeout)",
    )
    group.addoption(
        "--spatial-preload",
        dest="spatial_preload",
        default=None,
        metavar="MODULES",
        help="comma-separated modules the rank processes import once, before any test "
        "(your model package and its heavy dependencies)",
    )
    group.addoption(
        "--spatial-oversubscribe",
        action="store_true",
        dest="spatial_oversubscribe",
        help=f"allow more than {OVERSUBSCRIBE_LIMIT} rank processes per CPU core",
    )


def _add_mutant_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--spatial-mutants",
        action="store_true",
        dest="spatial_mutants",
        help="after the tests pass, rerun them with bugs injected at each torch.distributed "
        "call site they reach in your code; print which tests kill which mutant, and the score",
    )
    group.addoption(
        "--spatial-mutants-min-score",
        dest="spatial_mutants_min_score",
        default=None,
        metavar="PERCENT",
        help="with --spatial-mutants: fail the session when fewer than PERCENT %% of the "
        "mutants are killed",
    )


def _add_diagnosis_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--spatial-locate",
        action="store_true",
        dest="spatial_locate",
        help="locate the first diverging module of every check, passing ones too (failing "
        "checks are always located; ini spatial_locate = true)",
    )
    group.addoption(
        "--spatial-calibrate",
        action="store_true",
        dest="spatial_calibrate",
        help="locate every check and print, per quantity, the rounding noise measured, the "
        "partitioned run's error and the rtol they support",
    )
    group.addoption(
        "--spatial-layouts",
        dest="spatial_layouts",
        default=None,
        metavar="N",
        help="turn every spatial.check into a sweep of the layouts up to N ranks (world "
        "sizes, spatial x data splits, process grids): their covering set, the smallest layout "
        "with each feature level, world sizes side by side; a failure names the smallest "
        "failing layout",
    )
    group.addoption(
        "--spatial-layouts-all",
        action="store_true",
        dest="spatial_layouts_all",
        help="sweeps (--spatial-layouts, spatial.check_layouts) run every layout, not the "
        "covering set: a nightly job",
    )


def _add_golden_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--goldens-unused",
        action="store_true",
        dest="goldens_unused",
        help="list golden files that no test of this run used (only after a run in which "
        "every test ran and passed)",
    )
    group.addoption(
        "--goldens-prune",
        action="store_true",
        dest="goldens_prune",
        help="remove the golden files no test of this run used, only after a run in which "
        "every test ran and passed (never after -k, -m, node ids, -x or a failure)",
    )


def _add_ini(parser: pytest.Parser) -> None:
    parser.addini(
        "golden_dir", "directory of .pt golden files (default: goldens)", default="goldens"
    )
    parser.addini("spatial_ranks", f"default for --spatial-ranks ({DEFAULT_RANKS})", default=None)
    parser.addini("spatial_timeout", "default for --spatial-timeout", default=None)
    parser.addini("spatial_locate", "default for --spatial-locate", type="bool", default=False)
    parser.addini("spatial_deadlock_window", "default for --spatial-deadlock-window", default=None)
    parser.addini(
        "spatial_preload",
        "modules the rank processes import once, before any test (one per line or "
        "comma-separated): default for --spatial-preload",
        type="linelist",
        default=[],
    )
    parser.addini(
        "spatial_start_method",
        f"how rank processes start: one of {', '.join(START_METHODS)} (default forkserver: "
        "torch is imported once and each rank forks from it, ~0.1 s instead of ~6 s)",
        default="forkserver",
    )
    parser.addini(
        "spatial_pin_ranks",
        f"where rank processes run: one of {', '.join(PIN_MODES)} (default auto: each rank "
        "pinned to a CPU, in turn, where a pool has more ranks than CPUs; collectives then "
        "cost half as much on a small machine)",
        default="auto",
    )


def _setting(config: pytest.Config, name: str) -> str | None:
    value: str | None = config.getoption(name)
    if value is None:
        value = config.getini(name) or None
    return value


def _parse_ranks(raw: object) -> int:
    if raw is None:
        return DEFAULT_RANKS
    text = str(raw).strip()
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise pytest.UsageError(
        f"--spatial-ranks must be an integer >= 1, got {raw!r}; e.g. --spatial-ranks 4"
    )


#: option -> (default, least value, whether 0 means off)
_SECONDS = {
    "--spatial-timeout": (DEFAULT_TIMEOUT, MIN_TIMEOUT, False),
    "--spatial-deadlock-window": (DEADLOCK_WINDOW, 0.05, True),
}


def parse_seconds(raw: str | float | None, option: str) -> float:
    """``--spatial-timeout`` and ``--spatial-deadlock-window``: finite seconds, one clear
    line otherwise."""
    default, low, allow_zero = _SECONDS[option]
    if raw is None:
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if allow_zero and value == 0:
        return 0.0
    if math.isfinite(value) and value >= low:
        return value
    zero = " or 0 (off)" if allow_zero else ""
    raise pytest.UsageError(
        f"{option} must be a finite number of seconds >= {low:g}{zero}, got {raw!r}; "
        f"e.g. {option} {default:g}"
    )


def _parse_preload(config: pytest.Config) -> list[str]:
    """The modules to preload, each checked to exist now (the fork server would silently
    skip one it cannot import)."""
    import importlib.util

    raw = config.getoption("spatial_preload")
    names = raw.split(",") if raw is not None else config.getini("spatial_preload")
    modules = [n.strip() for item in names for n in str(item).split(",") if n.strip()]
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise pytest.UsageError(
                f"--spatial-preload: no module named {name!r} in this environment; install "
                "it, or check the name (a dotted module path, e.g. my_model.networks)"
            )
    return modules


@dataclass(frozen=True)
class Settings:
    """Every option of the plugin, parsed and checked once (``Settings.parse``)."""

    ranks: int
    timeout: float
    deadlock_window: float
    start_method: str
    preload: tuple[str, ...]
    oversubscribe: bool
    plots: str | None
    update_goldens: bool
    goldens_unused: bool
    golden_dir: Path
    mutants: bool
    mutants_min_score: float | None
    #: locate every check's first divergence, passing ones too (failing ones always are)
    locate: bool = False
    #: print each check's measured rounding noise and the tolerance it supports
    calibrate: bool = False
    #: sweep the layouts up to this many ranks before each spatial.check (None: off)
    layouts: int | None = None
    #: sweeps run every layout, not the covering set (--spatial-layouts-all)
    layouts_all: bool = False
    #: remove unused goldens after a whole, passing run
    goldens_prune: bool = False
    #: --spatial-report: the HTML page to write at session end (None: none)
    report: Path | None = None
    #: ini spatial_pin_ranks: ``auto``, ``on`` or ``off`` (``harness.pool._cpus``)
    pin_ranks: str = "auto"

    @classmethod
    def parse(cls, config: pytest.Config) -> Settings:
        """The settings of this session, or a ``pytest.UsageError`` naming the bad one."""
        ranks = _parse_ranks(_setting(config, "spatial_ranks"))
        oversubscribe = bool(config.getoption("spatial_oversubscribe"))
        try:
            check_oversubscription(ranks, allow=oversubscribe, how="pass --spatial-oversubscribe")
        except ConfigError as exc:
            raise pytest.UsageError(f"--spatial-ranks {ranks}: {exc}") from None
        plots = config.getoption("spatial_plots")
        if plots:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise pytest.UsageError(
                    "--spatial-plots needs matplotlib, which is not installed; "
                    'pip install "pytest-spatial-harness[plots]" (or matplotlib), or drop '
                    "--spatial-plots"
                ) from None
        start_method = config.getini("spatial_start_method") or "forkserver"
        if start_method not in START_METHODS:
            raise pytest.UsageError(
                f"spatial_start_method must be one of {START_METHODS}, got {start_method!r}"
            )
        pin_ranks = config.getini("spatial_pin_ranks") or "auto"
        if pin_ranks not in PIN_MODES:
            raise pytest.UsageError(
                f"spatial_pin_ranks must be one of {', '.join(PIN_MODES)}, got {pin_ranks!r}"
            )
        mutants = bool(config.getoption("spatial_mutants"))
        min_score = _parse_min_score(config.getoption("spatial_mutants_min_score"), mutants)
        root = config.inipath.parent if config.inipath else config.rootpath
        return cls(
            ranks=ranks,
            timeout=parse_seconds(_setting(config, "spatial_timeout"), "--spatial-timeout"),
            deadlock_window=parse_seconds(
                _setting(config, "spatial_deadlock_window"), "--spatial-deadlock-window"
            ),
            start_method=start_method,
            preload=tuple(_parse_preload(config)),
            oversubscribe=oversubscribe,
            plots=plots,
            update_goldens=bool(config.getoption("update_goldens")),
            goldens_unused=bool(config.getoption("goldens_unused")),
            golden_dir=root / config.getini("golden_dir"),
            mutants=mutants,
            mutants_min_score=min_score,
            locate=bool(config.getoption("spatial_locate") or config.getini("spatial_locate")),
            calibrate=bool(config.getoption("spatial_calibrate")),
            layouts=_parse_layouts(config.getoption("spatial_layouts"), oversubscribe),
            layouts_all=bool(config.getoption("spatial_layouts_all")),
            goldens_prune=bool(config.getoption("goldens_prune")),
            report=_parse_report(config),
            pin_ranks=pin_ranks,
        )


def _parse_layouts(raw: object, oversubscribe: bool) -> int | None:
    """``--spatial-layouts N``: an integer >= 1 that the machine can run, or one clear line."""
    if raw is None:
        return None
    text = str(raw).strip()
    if not (text.isdigit() and int(text) >= 1):
        raise pytest.UsageError(
            f"--spatial-layouts must be an integer >= 1 (the most ranks a layout may use), "
            f"got {raw!r}; e.g. --spatial-layouts 8"
        )
    try:
        check_oversubscription(int(text), allow=oversubscribe, how="pass --spatial-oversubscribe")
    except ConfigError as exc:
        raise pytest.UsageError(f"--spatial-layouts {text}: {exc}") from None
    return int(text)


def _parse_report(config: pytest.Config) -> Path | None:
    """``--spatial-report PATH``: a file whose directory exists or can be made, checked now
    rather than after the whole session has run."""
    raw = config.getoption("spatial_report")
    if raw is None:
        return None
    path = Path(config.invocation_params.dir) / str(raw)
    problem = ""
    if not str(raw).strip() or path.is_dir():
        problem = "is a directory; name the HTML file, e.g. --spatial-report=out/spatial.html"
    else:
        existing = next(p for p in path.parents if p.exists())  # the root at least
        if not existing.is_dir():
            problem = (
                f"cannot be written: {existing} is a file, not a directory; choose another path"
            )
        elif not os.access(existing, os.W_OK | os.X_OK):
            problem = f"cannot be written: {existing} is not writable; choose another path"
    if problem:
        raise pytest.UsageError(f"--spatial-report {raw}: {problem}")
    return path


def _parse_min_score(raw: str | float | None, mutants: bool) -> float | None:
    if raw is None:
        return None
    if not mutants:
        raise pytest.UsageError(
            "--spatial-mutants-min-score needs --spatial-mutants; add it, or drop the score"
        )
    try:
        score = float(raw)
    except ValueError:
        score = math.nan
    if not 0 <= score <= 100:
        raise pytest.UsageError(
            f"--spatial-mutants-min-score must be a percentage from 0 to 100, got {raw!r}; "
            "e.g. --spatial-mutants-min-score 90"
        )
    return score
