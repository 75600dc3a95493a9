"""The main job: verify the built-in steppers on N ranks and print the equivalence summary.

    harness-check                 # or: python -m harness
    harness-check --ranks 4 --no-faults
    harness-check --update-goldens

Each built-in stepper runs as the single-process reference and partitioned on a warm pool
of gloo ranks; the table shows the worst relative error per quantity and the verdict. Then
every fault of the catalogue (FAULTS.md) is injected in turn, to show that each is caught.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.compare import Tolerance, equivalence_table, format_table
from harness.equivalence import SpatialCase, check_equivalence
from harness.errors import ConfigError
from harness.goldens import GoldenStore
from harness.pool import PoolRegistry, check_oversubscription


@dataclass
class Config:
    """One equivalence check of the main job."""

    label: str
    make: Callable[..., SpatialCase]
    kwargs: dict[str, Any]
    spatial_size: int | None = None  # None: all ranks one spatial group

    def case(self, **extra: Any) -> SpatialCase:
        return self.make(**{**self.kwargs, **extra})


def configs(ranks: int) -> list[Config]:
    """The checks the main job runs on ``ranks`` ranks."""
    from harness.steppers.catalogue import main_configs

    return [Config(label, make, kw, s) for label, make, kw, s in main_configs(ranks)]


def fault_configs(ranks: int) -> Iterator[tuple[str, Config, str, set[str]]]:
    """(stepper, config, fault id, quantities FAULTS.md says catch it)."""
    from harness.steppers.catalogue import fault_matrix

    for stepper, make, kw, s, fault, expected in fault_matrix(ranks):
        yield stepper, Config(stepper, make, kw, s), fault, expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="harness-check",
        description="Verify the built-in spatially parallel steppers against their "
        "single-process references.",
    )
    parser.add_argument("--ranks", type=int, default=4, help="rank processes (default 4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-run timeout, s")
    parser.add_argument("--no-faults", action="store_true", help="skip the fault matrix")
    parser.add_argument(
        "--golden-dir", default="goldens/main", help="goldens of the main job (default %(default)s)"
    )
    parser.add_argument("--update-goldens", action="store_true", help="(re)write the goldens")
    parser.add_argument(
        "--oversubscribe", action="store_true", help="allow many more ranks than CPU cores"
    )
    args = parser.parse_args(argv)
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

    registry = PoolRegistry(
        default_ranks=args.ranks, timeout=args.timeout, start_method="forkserver"
    )
    store = GoldenStore(Path(args.golden_dir), update=args.update_goldens)
    for path in store.sweep():
        print(f"removed {path}: the temporary file of an interrupted golden write")
    use_goldens = args.update_goldens or Path(args.golden_dir).is_dir()
    failed = 0
    try:
        t0 = time.perf_counter()
        print(
            f"harness: checking the built-in steppers on {args.ranks} ranks "
            "(gloo, CPU) against their single-process references",
            flush=True,
        )
        rows = []
        for cfg in configs(args.ranks):
            report = check_equivalence(
                cfg.case(),
                ranks=args.ranks,
                spatial_size=cfg.spatial_size,
                pool=registry.get(args.ranks),
                timeout=args.timeout,
            )
            row = report.summary_row()
            row["case"] = cfg.label
            if use_goldens and report.reference:
                dtype = next(iter(report.reference.values())).dtype
                path = store.root / f"{_slug(cfg.label)}-r{args.ranks}.pt"
                if store.update and not report.ok:  # goldens only from passing checks
                    result = store.not_updated(path, "the equivalence check failed")
                else:
                    result = store.check(
                        path,
                        report.reference,
                        bound=Tolerance.for_dtype(dtype).field,
                        provenance={
                            "case": cfg.label,
                            "ranks": args.ranks,
                            "partition": report.partition,
                        },
                    )
                row["golden"] = result.status
                failed += not result.ok
            failed += not report.ok
            rows.append(row)
            print(
                f"  {cfg.label:<22} {'equivalent' if report.ok else 'MISMATCH'}"
                f"  ({report.seconds:.1f}s)",
                flush=True,
            )
            if not report.ok:
                print(report)
        print()
        for line in equivalence_table(rows):
            print(line)
        if not use_goldens:
            print(f"(no goldens at {args.golden_dir}: run with --update-goldens to record them)")

        if not args.no_faults:
            failed += _fault_matrix(args, registry)
        print(
            f"\n{'ALL CHECKS PASSED' if not failed else f'{failed} CHECK(S) FAILED'} "
            f"in {time.perf_counter() - t0:.0f}s"
        )
    finally:
        registry.close()
    return 1 if failed else 0


def _fault_matrix(args: argparse.Namespace, registry: PoolRegistry) -> int:
    matrix = list(fault_configs(args.ranks))
    print("\nInjected faults (FAULTS.md): each must make the check fail with the named quantity")
    header = ("stepper", "fault", "expected", "caught as (first, then the rest)", "verdict")
    rows = []
    missed = 0
    for stepper, cfg, fault, expected in matrix:
        report = check_equivalence(
            cfg.case(faults=(fault,)),
            ranks=args.ranks,
            spatial_size=cfg.spatial_size,
            pool=registry.get(args.ranks),
            timeout=min(args.timeout, 10.0),
        )
        caught = report.quantities & expected
        missed += not caught
        first = report.mismatches[0].quantity if report.mismatches else "-"
        rest = sorted(report.quantities - {first})
        shown = first + (f" (+{','.join(rest)})" if rest else "")
        rows.append(
            (stepper, fault, ",".join(sorted(expected)), shown, "caught" if caught else "MISSED")
        )
    for line in format_table(header, rows):
        print(line)
    print(f"{len(rows) - missed}/{len(rows)} faults caught")
    return missed


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in label)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
