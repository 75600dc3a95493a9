"""The session's report as one self-contained HTML page (``--spatial-report``): pure text in,
text out, no pytest.

Everything the page shows is inside it: the style inline, each picture a ``data:`` URI, no
script. Its Content-Security-Policy says so to the browser (``default-src 'none'``), so a
page that reached for anything outside itself would be refused and say so in the console,
which the browser test reads; it opens the same from a CI artifact, a mail or a laptop
offline.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from harness.compare import NUMERIC
from harness.report import SummaryRow

__all__ = ["FailedTest", "Figure", "Page", "SweepRow", "render_page"]

#: nothing from outside the page: no fetch, no script; pictures only as data: URIs
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px;
       padding: 0 1em; color: #1b1b1b; background: #fff; }
h1 { font-size: 1.5em; margin-bottom: .2em; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
h3 { font-size: 1.05em; font-family: ui-monospace, monospace; word-break: break-all; }
.wide { overflow-x: auto; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { border: 1px solid #d0d0d0; padding: .25em .6em; text-align: left;
         font-family: ui-monospace, monospace; font-size: 12px; vertical-align: top;
         overflow-wrap: break-word; }
td.id { overflow-wrap: anywhere; min-width: 14em; }
th { background: #f2f2f2; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: .8em; overflow-x: auto;
      white-space: pre-wrap; font-size: 12.5px; }
.ok { color: #176f2c; } .bad { color: #b00020; font-weight: 600; } .dim { color: #666; }
.tally span { margin-right: 1.2em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-family: ui-monospace, monospace; font-size: 12px; color: #555; }
.notplotted { font-family: ui-monospace, monospace; color: #8a5300; }
"""


@dataclass(frozen=True)
class Figure:
    """A picture of a failing check: its PNG, or ``not_plotted``, the line saying why not."""

    caption: str
    png: bytes | None = None
    not_plotted: str = ""


@dataclass
class FailedTest:
    """A test that failed (or errored): pytest's report text and the pictures of its check."""

    nodeid: str
    when: str  # "call", "setup", "teardown", "collect"
    text: str
    figures: list[Figure] = field(default_factory=list)


class SweepRow(TypedDict, total=False):
    """One layout sweep (``check_layouts``): plain data, it travels from an xdist worker."""

    test: str
    case: str
    max_ranks: int
    passed: int
    failing: int
    refused: int
    smallest: str  # the smallest failing layout, "" when none failed
    ok: bool


@dataclass
class Page:
    """What the page shows, gathered over the session (on xdist's controller)."""

    outcomes: dict[str, str]  # nodeid -> passed, failed, error, skipped, xfailed, xpassed
    exitstatus: int
    equivalences: list[SummaryRow] = field(default_factory=list)
    goldens: list[str] = field(default_factory=list)  # the goldens' tally and changes
    sweeps: list[SweepRow] = field(default_factory=list)
    failures: list[FailedTest] = field(default_factory=list)
    title: str = "spatial equivalence report"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table of already-escaped cells; the first column a test id, broken anywhere."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join(
        f'<tr><td class="id">{r[0]}</td>' + "".join(f"<td>{c}</td>" for c in r[1:]) + "</tr>"
        for r in rows
    )
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    return f'<div class="wide">{table}</div>'


def _verdict(ok: bool, problems: Sequence[str] = ()) -> str:
    if ok:
        return '<span class="ok">equivalent</span>'
    return f'<span class="bad">MISMATCH: {_e(", ".join(problems))}</span>'


def _tally(outcomes: dict[str, str], exitstatus: int) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    parts = [
        f'<span class="{"bad" if k in ("failed", "error") else "ok"}">{n} {_e(k)}</span>'
        for k, n in sorted(counts.items())
    ]
    n = len(outcomes)
    return (
        f'<p class="tally"><span>{n} test{"s" if n != 1 else ""}</span>{"".join(parts)}'
        f'<span class="dim">exit status {int(exitstatus)}</span></p>'
    )


def _equivalences(rows: Sequence[SummaryRow]) -> str:
    if not rows:
        return '<p class="dim">No equivalence check ran.</p>'
    header = ("test", "case", "ranks", "partition", "dtype", *NUMERIC, "golden", "verdict")
    body = []
    for r in sorted(rows, key=lambda r: (r.get("test", ""), r.get("case", ""))):
        worst = r.get("worst", {})
        body.append(
            (
                _e(r.get("test", "")),
                _e(r.get("case", "")),
                _e(r.get("ranks", "")),
                _e(r.get("partition", "")),
                _e(r.get("dtype", "")),
                *("-" if worst.get(q) is None else f"{worst[q]:.1e}" for q in NUMERIC),
                _e(r.get("golden", "-")),
                _verdict(bool(r.get("ok")), r.get("problems", [])),
            )
        )
    return "<p>Worst relative error per quantity, partitioned vs reference.</p>" + _table(
        header, body
    )


def _sweeps(rows: Sequence[SweepRow]) -> str:
    header = ("test", "case", "up to ranks", "passed", "failing", "refused", "smallest failing")
    body = [
        (
            _e(r.get("test", "")),
            _e(r.get("case", "")),
            _e(r.get("max_ranks", "")),
            _e(r.get("passed", 0)),
            f'<span class="{"bad" if r.get("failing") else "ok"}">{_e(r.get("failing", 0))}</span>',
            _e(r.get("refused", 0)),
            _e(r.get("smallest") or "-"),
        )
        for r in rows
    ]
    return _table(header, body)


def _figure(fig: Figure) -> str:
    if fig.png is None:
        return f'<p class="notplotted">{_e(fig.not_plotted or "Not plotted")}</p>'
    data = base64.b64encode(fig.png).decode("ascii")
    return (
        f'<figure><img alt="{_e(fig.caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{_e(fig.caption)}</figcaption></figure>"
    )


def _failure(f: FailedTest, anchor: str) -> str:
    """The test's report: its first paragraph (the verdict, the first divergence), the
    pictures, then the rest (the table, what to do)."""
    where = "" if f.when == "call" else f" ({_e(f.when)})"
    figures = "".join(_figure(fig) for fig in f.figures)
    head, blank, rest = f.text.partition("\n\n")
    body = f"<pre>{_e(head)}</pre>{figures}" + (f"<pre>{_e(rest)}</pre>" if blank else "")
    return f'<section id="{anchor}"><h3>{_e(f.nodeid)}{where}</h3>{body}</section>'


def render_page(page: Page) -> str:
    """The whole HTML document of ``page``."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        f"<title>{_e(page.title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_e(page.title)}</h1>",
        _tally(page.outcomes, page.exitstatus),
    ]
    if page.failures:
        links = "".join(
            f'<li><a href="#failure-{i}">{_e(f.nodeid)}</a></li>'
            for i, f in enumerate(page.failures)
        )
        parts.append(f'<p class="bad">Failed:</p><ul>{links}</ul>')
    parts += ["<h2>Equivalence</h2>", _equivalences(page.equivalences)]
    if page.sweeps:
        parts += ["<h2>Layout sweeps</h2>", _sweeps(page.sweeps)]
    if page.goldens:
        parts += ["<h2>Goldens</h2>", f"<pre>{_e(chr(10).join(page.goldens))}</pre>"]
    if page.failures:
        parts.append("<h2>Failures</h2>")
        parts += [_failure(f, f"failure-{i}") for i, f in enumerate(page.failures)]
    rows = [(_e(nodeid), _outcome(o)) for nodeid, o in page.outcomes.items()]
    parts += ["<h2>Tests</h2>", _table(("test", "outcome"), rows), "</body></html>"]
    return "\n".join(parts) + "\n"


def _outcome(outcome: str) -> str:
    cls = "bad" if outcome in ("failed", "error") else "ok"
    return f'<span class="{cls}">{_e(outcome)}</span>'
