"""The main job: verify the built-in steppers on N ranks and print the equivalence summary.

    harness-check                      # or: python -m harness
    harness-check --ranks 4 -k sfno    # only the layouts and faults whose label has "sfno"
    harness-check --only faults        # only the fault matrix
    harness-check --update-goldens     # (re)record the goldens of the passing checks
    harness-check --model fme          # verify an installed real model instead (fme, anemoi)

Each built-in stepper runs as the single-process reference and partitioned on a warm pool
of gloo ranks; a line per check as it goes, then a table of the worst relative error per
quantity, golden status and verdict. Then every fault of the catalogue (FAULTS.md) is
injected in turn, to show that each is caught.

With ``--model NAME`` the layouts come from the model adapter registered as NAME under the
entry-point group ``harness.models`` (``harness.adapters``): ``fme`` and ``anemoi`` are the
harness's own (``harness.contrib``), the installed model's own distributed code path against
its own single-process path; a downstream package can register its own.

Exit codes: 0 every check passed (goldens that were never recorded for this rank count are
said, not failed); 1 a layout mismatched, a golden differs, or a fault went uncaught;
2 bad arguments.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness._mutation.catalogue import Outcome
from harness.adapters import ModelAdapter, adapter_names, find_adapter
from harness.case import SpatialCase
from harness.equivalence import check_equivalence
from harness.errors import ConfigError
from harness.goldens import GoldenResult, GoldenStatus, GoldenStore, GoldenTally, check_report
from harness.pool import PoolRegistry, RankPool, check_oversubscription, keep_limits
from harness.report import EquivalenceReport, equivalence_table, format_table

#: The goldens recorded for the main job, shipped inside the package.
MAIN_GOLDENS = Path(__file__).resolve().parent / "main_goldens"
WIDTH = 100  # every table fits a 100-column terminal


@dataclass
class Config:
    """One equivalence check of the main job."""

    label: str
    make: Callable[..., SpatialCase]
    kwargs: dict[str, object]
    spatial_size: int | None = None  # None: all ranks one spatial group

    def case(self, **extra: object) -> SpatialCase:
        return self.make(**{**self.kwargs, **extra})


@functools.cache
def _source(model: str) -> ModelAdapter:
    """The adapter registered as ``model`` (entry-point group ``harness.models``), its model
    imported; a clear error when the model is missing."""
    adapter = find_adapter(model)
    try:
        adapter.require()  # imports the model itself
    except ConfigError:
        raise  # the adapter's own message names the extra
    except ImportError as exc:
        raise ConfigError(
            f"the {model} model is not installed here ({exc}); install it first, then the "
            f"harness beside it: pip install 'pytest-spatial-harness[{model}]'"
        ) from exc
    except Exception as exc:  # the model's own import raised
        raise ConfigError(
            f"the {model} model's adapter failed to import it: {type(exc).__name__}: {exc}; "
            "fix the model's installation (importing it alone shows the traceback)"
        ) from exc
    return adapter


def configs(ranks: int, model: str = "builtin") -> list[Config]:
    """The checks the main job runs on ``ranks`` ranks."""
    return [
        Config(layout.label, layout.make, dict(layout.kwargs), layout.spatial_size)
        for layout in _source(model).layouts(ranks)
    ]


def fault_configs(
    ranks: int, model: str = "builtin"
) -> Iterator[tuple[str, Config, str, set[str]]]:
    """(stepper, config, fault id, quantities FAULTS.md says catch it)."""
    for f in _source(model).faults(ranks):
        yield (
            f.stepper,
            Config(f.stepper, f.make, dict(f.kwargs), f.spatial_size),
            f.fault,
            set(f.expected),
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness-check",
        description="Verify the built-in spatially parallel steppers against their "
        "single-process references, then show that every fault of the catalogue is caught.",
        epilog="Exit codes: 0 all passed; 1 a check failed; 2 bad arguments.",
    )
    _add_what_arguments(parser)
    _add_mode_arguments(parser)
    return parser


def _add_what_arguments(parser: argparse.ArgumentParser) -> None:
    """What to check and how: ranks, model, selection, goldens."""
    parser.add_argument("--ranks", type=int, default=4, help="rank processes (default 4)")
    parser.add_argument(
        "--model",
        choices=adapter_names(),
        default="builtin",
        help="what to verify: the built-in steppers (default), or an installed real model "
        "through its adapter, registered under the entry-point group harness.models "
        "(fme and anemoi need pip install 'pytest-spatial-harness[fme]' or [anemoi])",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="per-run timeout, s")
    parser.add_argument(
        "-k",
        dest="select",
        default="",
        metavar="TEXT",
        help="only layouts and faults whose label contains TEXT (comma-separated: any of them)",
    )
    parser.add_argument(
        "--only",
        choices=("layouts", "faults"),
        help="run only the layouts or only the fault matrix",
    )
    parser.add_argument("--no-faults", action="store_true", help="same as --only layouts")
    parser.add_argument(
        "--golden-dir",
        default=str(MAIN_GOLDENS),
        help="goldens of the main job (default: the ones shipped with the package)",
    )
    parser.add_argument(
        "--update-goldens",
        action="store_true",
        help="(re)record the goldens of the checks that pass",
    )
    parser.add_argument(
        "--oversubscribe", action="store_true", help="allow many more ranks than CPU cores"
    )


def _add_mode_arguments(parser: argparse.ArgumentParser) -> None:
    """The other modes: the layout sweep and the mutants."""
    parser.add_argument(
        "--layouts",
        type=int,
        default=None,
        metavar="N",
        help="instead: check the covering set of the layouts up to N ranks of each stepper "
        "(world sizes, spatial x data splits, process grids) and name the smallest failing one",
    )
    parser.add_argument(
        "--layouts-all",
        action="store_true",
        help="with --layouts N: every layout, not the covering set (a nightly job)",
    )
    parser.add_argument(
        "--mutants",
        action="store_true",
        help="instead: inject a bug at each torch.distributed call site the layouts reach "
        "(the harness's and the model's code) and say which check kills it; prints the score",
    )
    parser.add_argument(
        "--mutants-min-score",
        type=float,
        default=None,
        metavar="PERCENT",
        help="with --mutants: exit 1 when fewer than PERCENT %% of the mutants are killed",
    )


def _selected(label: str, select: str) -> bool:
    words = [w.strip() for w in select.split(",") if w.strip()]
    return not words or any(w in label for w in words)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    try:
        source = _source(args.model)
    except ConfigError as exc:
        # one line, the problem and its fix (the usage would only push it out of sight)
        print(f"{parser.prog}: error: --model {args.model}: {exc}", file=sys.stderr)
        return 2
    registry = PoolRegistry(
        default_ranks=args.ranks,
        timeout=args.timeout,
        start_method="forkserver",
        # a real model's imports (seconds) happen once in the fork server, not in every run
        preload=source.preload,
        **keep_limits(),  # --layouts: every world size's pool stays warm across steppers
    )
    t0 = time.perf_counter()
    try:
        failures = _run(args, registry, source)
    finally:
        registry.close()
    took = time.perf_counter() - t0
    if failures:
        print(f"\n{len(failures)} CHECK(S) FAILED in {took:.0f}s:")
        for reason in failures:
            print(f"  {reason}")
        return 1
    print(f"\nALL CHECKS PASSED in {took:.0f}s")
    return 0


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``parser.error`` (code 2) on the first bad argument, naming it."""
    if args.ranks < 1:
        parser.error(f"--ranks must be an integer >= 1, got {args.ranks}")
    if not args.timeout > 0:  # also NaN
        parser.error(
            f"--timeout must be a positive number of seconds, got {args.timeout:g}; "
            "e.g. --timeout 120"
        )
    try:
        check_oversubscription(args.ranks, allow=args.oversubscribe, how="pass --oversubscribe")
    except ConfigError as exc:
        parser.error(f"--ranks {args.ranks}: {exc}")
    if args.mutants_min_score is not None and not (
        args.mutants and 0 <= args.mutants_min_score <= 100
    ):
        parser.error(
            "--mutants-min-score needs --mutants and a percentage from 0 to 100, got "
            f"{args.mutants_min_score:g}"
        )
    if args.layouts is not None:
        try:
            if args.layouts < 1:
                raise ConfigError(f"N must be an integer >= 1, got {args.layouts}; e.g. 8")
            check_oversubscription(
                args.layouts, allow=args.oversubscribe, how="pass --oversubscribe"
            )
        except ConfigError as exc:
            parser.error(f"--layouts {args.layouts}: {exc}")


def _run(args: argparse.Namespace, registry: PoolRegistry, source: ModelAdapter) -> list[str]:
    """The chosen mode's failures: the layout sweep, the mutants, or layouts then faults."""
    only = "layouts" if args.no_faults else args.only
    failures: list[str] = []
    what = "the built-in steppers" if args.model == "builtin" else f"{args.model}"
    print(
        f"harness: checking {what} on {args.ranks} ranks (gloo, CPU) "
        "against the single-process reference",
        flush=True,
    )
    if args.layouts:
        from harness.layouts import sweep_cases

        firsts: dict[Callable[..., SpatialCase], Config] = {}  # each stepper's first layout
        for c in configs(args.ranks, args.model):
            firsts.setdefault(c.make, c)
        cases = [(c.label, c.case()) for c in firsts.values() if _selected(c.label, args.select)]
        failures += sweep_cases(
            cases, args.layouts, registry.get, timeout=args.timeout, exhaustive=args.layouts_all
        )
    elif args.mutants:
        failures += _mutants(args, registry, source)
    else:
        if only != "faults":
            failures += _layouts(args, registry)
        if only != "layouts":
            failures += _fault_matrix(args, registry)
    return failures


# ---------------------------------------------------------------------- layouts


def _layouts(args: argparse.Namespace, registry: PoolRegistry) -> list[str]:
    chosen = [c for c in configs(args.ranks, args.model) if _selected(c.label, args.select)]
    if not chosen:
        print(f"\nno layout matches -k {args.select!r}")
        return []
    # goldens pin the built-in steppers; a real model's numbers belong to its own repository
    goldens = args.model == "builtin"
    store = GoldenStore(Path(args.golden_dir), update=args.update_goldens)
    for path in store.sweep():
        print(f"removed {path}: the temporary file of an interrupted golden write")
    print(
        f"\nLayouts ({len(chosen)}): the reference against the partitioned run on "
        f"{args.ranks} ranks",
        flush=True,
    )
    rows, failures = [], []
    statuses: list[GoldenStatus] = []
    for i, cfg in enumerate(chosen, 1):
        report = check_equivalence(
            cfg.case(),
            ranks=args.ranks,
            spatial_size=cfg.spatial_size,
            pool=registry.get(args.ranks),
            timeout=args.timeout,
        )
        row = report.summary_row()
        row["case"] = cfg.label
        golden = _golden(store, cfg, report, args.ranks) if report.reference and goldens else None
        row["golden"] = _golden_word(golden)
        if golden is not None and golden.status != GoldenStatus.MISSING:
            statuses.append(golden.status)  # a missing one is said below, not tallied
        verdict = "equivalent" if report.ok else "MISMATCH: " + ",".join(row["problems"])
        print(
            f"  [{i}/{len(chosen)}] {cfg.label} ({report.partition}): {verdict}, golden "
            f"{row['golden']} ({report.seconds:.1f}s)",
            flush=True,
        )
        if not report.ok:
            print(_indent(str(report)))
            failures.append(f"{cfg.label}: {_first_reason(report)}")
        elif golden is not None and golden.status == "failed":
            print(_indent(str(golden)))
            failures.append(
                f"{cfg.label}: its golden differs ({golden.path}); if the change "
                "is intended, run with --update-goldens"
            )
        rows.append(row)
    print()
    for line in equivalence_table(rows, width=WIDTH, show_ranks=False):
        print(line)
    missing = [r["case"] for r in rows if r["golden"] == "none"]
    if missing:
        print(
            f"(no goldens recorded for {args.ranks} ranks in {args.golden_dir} for: "
            f"{', '.join(missing)}; --update-goldens records them; not a failure)"
        )
    tally = GoldenTally.of(statuses).lines(store.root)
    if tally:
        print("\n" + "\n".join(tally))
    return failures


def _golden(store: GoldenStore, cfg: Config, report: EquivalenceReport, ranks: int) -> GoldenResult:
    path = store.root / f"{_slug(cfg.label)}-r{ranks}.pt"
    if not store.update and not path.exists():
        return GoldenResult(path, GoldenStatus.MISSING)  # said below the table, not a failure
    # the one policy: only after a passing check, the field tolerance, provenance
    return check_report(store, path, report, provenance={"case": cfg.label})


def _golden_word(result: GoldenResult | None) -> str:
    if result is None:
        return "-"
    return {"missing": "none", "not updated": "kept"}.get(result.status, str(result.status))


def _first_reason(report: EquivalenceReport) -> str:
    first = report.mismatches[0].headline()
    return f"{first} ({report.likely})" if report.likely else first


# ---------------------------------------------------------------------- mutants


def _mutants(args: argparse.Namespace, registry: PoolRegistry, source: ModelAdapter) -> list[str]:
    """The layouts' mutants: a bug at each call site they reach in the harness's code and
    the model's package (``source.preload``), each rerun until a layout's check fails."""
    import harness
    from harness._mutation.catalogue import score, score_line, table_rows

    chosen = [c for c in configs(args.ranks, args.model) if _selected(c.label, args.select)]
    include = [os.path.dirname(harness.__file__)]
    for module in source.preload:
        spec = importlib.util.find_spec(module.split(".")[0])
        if spec is not None and spec.origin:
            include.append(os.path.dirname(spec.origin))
    print(
        f"\nMutants of the code {len(chosen)} layout(s) reach ({', '.join(include)}): "
        "each must make a check fail",
        flush=True,
    )
    outcomes = run_mutants(chosen, registry.get(args.ranks), include=include, timeout=args.timeout)
    print()
    for line in format_table(("mutant", "call site", "verdict"), table_rows(outcomes)):
        print(line)
    print(score_line(outcomes))
    killed, total = score(outcomes)
    low = args.mutants_min_score
    if low is not None and total and 100 * killed / total < low:
        return [f"mutation score {killed}/{total} is below --mutants-min-score {low:g}%"]
    return []


#: a mutant's rerun of a check gets at most this many seconds (or the whole timeout, if less)
RERUN_LIMIT = 30.0


def run_mutants(
    checks: Sequence[Config],
    pool: RankPool,
    *,
    include: Sequence[str],
    timeout: float = 120.0,
    say: Callable[[str], None] = print,
) -> list[Outcome]:
    """Every mutant of every site the ``checks`` reach under the ``include`` directories,
    killed by the first check that fails with it, or survived: the campaign of
    ``harness._mutation.campaign`` over equivalence checks, without pytest (``pytest
    --spatial-mutants`` runs the same campaign over a test suite, ``harness.plugin.mutants``).
    Each check runs once as it is, its ranks recording the call sites they reach; then each
    mutant of each site reruns the checks that reached it, fastest first, until one fails.
    Same warm pool throughout: no pool start per mutant, unless a mutant's hang or crash
    ended the processes."""
    from harness._mutation.campaign import Killed, Reached, campaign, verdict
    from harness._mutation.mode import RECORD, MutantMode, running

    roots = tuple(os.path.abspath(d) + os.sep for d in include)
    reached: Reached[Config] = Reached(lambda where: where.startswith(roots))
    with running(RECORD):
        for check in checks:
            report = check_equivalence(
                check.case(), ranks=pool.world_size, spatial_size=check.spatial_size,
                pool=pool, timeout=timeout, locate=False,
            )  # fmt: skip
            if not report.ok:
                say(f"  {check.label}: fails as it is ({', '.join(sorted(report.quantities))}): "
                    "left out of the mutants")  # fmt: skip
                continue
            reached.add(check, report.seconds, pool.last_sites)

    def rerun(check: Config, mode: MutantMode) -> Killed | None:
        report = check_equivalence(
            check.case(), ranks=pool.world_size, spatial_size=check.spatial_size,
            pool=pool, timeout=mode.timeout or timeout, locate=False,
        )  # fmt: skip
        return None if report.ok else Killed(check.label, ", ".join(sorted(report.quantities)))

    return campaign(
        reached,
        rerun,
        timeout=lambda _: min(timeout, RERUN_LIMIT),
        say=lambda o: say(f"  {o.mutant.label} at {o.location}: {verdict(o)}"),
    )


# ---------------------------------------------------------------------- faults


def _fault_matrix(args: argparse.Namespace, registry: PoolRegistry) -> list[str]:
    skipped_faults = _source(args.model).skipped
    matrix = [
        f for f in fault_configs(args.ranks, args.model) if _selected(f"{f[0]}:{f[2]}", args.select)
    ]
    skipped = [s for s in skipped_faults(args.ranks) if _selected(f"{s[0]}:{s[1]}", args.select)]
    if not matrix and not skipped:
        return []
    print(
        f"\nInjected faults ({len(matrix)}): each must make the check fail with an expected "
        "quantity",
        flush=True,
    )
    rows: list[tuple[str, str, str, str, str]] = []
    failures: list[str] = []
    for i, (stepper, cfg, fault, expected) in enumerate(matrix, 1):
        t0 = time.perf_counter()
        report = check_equivalence(
            cfg.case(faults=(fault,)),
            ranks=args.ranks,
            spatial_size=cfg.spatial_size,
            pool=registry.get(args.ranks),
            timeout=min(args.timeout, 30.0),
        )
        caught = bool(report.quantities & expected)
        first = report.mismatches[0].quantity if report.mismatches else "-"
        rest = sorted(report.quantities - {first})
        shown = first + (f" (+{','.join(rest)})" if rest else "")
        verdict = f"caught as {shown}" if caught else "MISSED"
        took = time.perf_counter() - t0
        print(f"  [{i}/{len(matrix)}] {stepper}:{fault}: {verdict} ({took:.1f}s)", flush=True)
        if report.first_divergence is not None:
            print(f"        first divergence: {report.first_divergence.located}", flush=True)
        if not caught:
            failures.append(
                f"{stepper}:{fault} was not caught as {'/'.join(sorted(expected))}"
                f" (the check said: {', '.join(sorted(report.quantities)) or 'ok'})"
            )
        rows.append(
            (stepper, fault, ",".join(sorted(expected)), shown, "caught" if caught else "MISSED")
        )
    if rows:
        print()
        for line in fault_table(rows, width=WIDTH):
            print(line)
        print(f"{len(rows) - len(failures)}/{len(rows)} faults caught")
    by_reason: dict[str, list[str]] = {}
    for stepper, fault, reason in skipped:
        by_reason.setdefault(reason, []).append(f"{stepper}:{fault}")
    for reason, faults in by_reason.items():
        print(f"skipped {len(faults)} fault(s), {reason}: {', '.join(faults)}")
    return failures


def fault_table(rows: list[tuple[str, str, str, str, str]], width: int = WIDTH) -> list[str]:
    """The fault matrix's table, each line within ``width`` columns.

    The "caught as" column is shortened (ending in "...") to make room, never the verdict:
    cutting the whole line once left "ve" or "ca" of it.

    >>> rows = [("sfno", "buffer-broadcast", "buffer", "error (+" + "x" * 80 + ")", "caught")]
    >>> [line.split()[-1] for line in fault_table(rows)] == ["verdict", "-------", "caught"]
    True
    """
    header = ("stepper", "fault", "expected", "caught as (first, +rest)", "verdict")
    if rows:
        longest = max(len(line) for line in format_table(header, rows))
        room = max(12, max(len(r[3]) for r in rows) - max(0, longest - width))
        rows = [(a, b, c, _shorten(caught, room), v) for a, b, c, caught, v in rows]
    return format_table(header, rows)


def _shorten(text: str, room: int) -> str:
    return text if len(text) <= room else text[: room - 3] + "..."


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in label)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
