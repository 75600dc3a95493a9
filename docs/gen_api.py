"""Write docs/api.md, the API reference, from the docstrings: ``python docs/gen_api.py``.

What it lists is what a user imports or types: ``harness.__all__``; the modules documented
for direct import (``DIRECT``, and every public module of ``harness.contrib``); the pytest
plugin's options and ini values (read from its ``pytest_addoption``), its markers (read from
its ``addinivalue_line("markers", ...)`` calls) and its fixtures with the object they give a
test. Each name is filed under the path a user imports it by (``harness.SpatialCase``,
``harness.partition.LatLonPartition``), never under the module that defines it, so moving
code between internal modules leaves the reference as it is. ``__module__`` is read only to
tell the harness's objects from a third party's (``typing.Any`` in a module's namespace).

Deterministic: names sorted, signatures as written in the source (annotations are strings
under ``from __future__ import annotations``), defaults without memory addresses, constants'
values as written. A name's documentation is its docstring; a constant's or an attribute's
is the ``#:`` comment above its assignment, as Sphinx reads them.

Only the standard library and ``inspect``; ``tests/docs/test_api_reference.py`` regenerates
the page in memory and fails when the committed one differs.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import pkgutil
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"
COMMAND = "python docs/gen_api.py"

#: modules documented for direct import, besides ``harness`` itself and ``harness.contrib.*``
#: (``DOCUMENTED`` of tests/unit/test_layers.py; a test holds the two lists together)
DIRECT = ("adapters", "adopt", "collectives", "partition", "steppers", "strategies")

#: the longest value written out as it stands in the source (longer ones: their type only)
VALUE_WIDTH = 72


# ---------------------------------------------------------------------- what is public


def documented_modules() -> list[str]:
    """Every module the reference documents, ``harness`` first, then by name."""
    import harness.contrib

    contrib = [
        f"harness.contrib.{m.name}"
        for m in pkgutil.iter_modules(harness.contrib.__path__)
        if not m.name.startswith("_")
    ]
    return ["harness", *sorted([*(f"harness.{m}" for m in DIRECT), "harness.contrib", *contrib])]


def _is_harness(obj: object) -> bool:
    """The harness's own class, function or instance (not one it imported from elsewhere)."""
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and (module == "harness" or module.startswith("harness."))


def _is_constant(obj: object) -> bool:
    return type(obj).__module__ == "builtins" and not callable(obj)


def public_names(module: types.ModuleType, elsewhere: set[int]) -> list[str]:
    """``__all__``, sorted; without one, the module's public names that are the harness's own
    and not documented under another path (``SpatialCase`` imported into ``adapters``)."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return sorted(names)
    found = []
    for name, obj in vars(module).items():
        if name.startswith("_") or isinstance(obj, types.ModuleType) or id(obj) in elsewhere:
            continue
        if _is_harness(obj) or _is_constant(obj):
            found.append(name)
    return sorted(found)


def _exported(modules: list[str]) -> set[int]:
    """The objects that modules with an ``__all__`` document (so others do not repeat them)."""
    ids = set()
    for name in modules:
        module = importlib.import_module(name)
        for n in getattr(module, "__all__", ()):
            obj = getattr(module, n)
            if not _is_constant(obj):  # equal small constants may be one object
                ids.add(id(obj))
    return ids


# ---------------------------------------------------------------------- source text


def _source(obj: object) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(obj))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None


def _comment_above(lines: list[str], lineno: int) -> str:
    """The ``#:`` comment lines right above line ``lineno`` (1-based), joined."""
    out: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#:"):
        out.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    return " ".join(out)


@dataclass
class Assigned:
    """A name assigned in a module's or a class's body: its annotation, value and comment."""

    annotation: str | None
    value: str | None
    doc: str


def assignments(source: str, body_of_class: bool = False) -> dict[str, Assigned]:
    """The names assigned at the top of ``source`` (or of its one class, ``body_of_class``)."""
    tree = ast.parse(source)
    body = tree.body
    if body_of_class:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    lines = source.splitlines()
    out: dict[str, Assigned] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets, annotation = [node.target.id], ast.get_source_segment(source, node.annotation)
        elif isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            annotation = None
        else:
            continue
        value = None if node.value is None else ast.get_source_segment(source, node.value)
        for name in targets:
            out[name] = Assigned(annotation, value, _comment_above(lines, node.lineno))
    return out


def constant_source(name: str, obj: object) -> Assigned | None:
    """Where the harness assigns the constant ``obj`` to ``name``, wherever it is re-exported
    from: of the loaded modules that bind it by an assignment, the first (by name) with a
    ``#:`` comment, else the first (so an alias ``X = other.X`` never hides the comment)."""
    found = []
    for module_name in sorted(m for m in sys.modules if m == "harness" or m.startswith("harness.")):
        module = sys.modules[module_name]
        if getattr(module, name, None) is not obj or module_name.endswith("__main__"):
            continue
        source = _source(module)
        assigned = assignments(source).get(name) if source else None
        if assigned is not None:
            found.append(assigned)
    return next((a for a in found if a.doc), found[0] if found else None)


# ---------------------------------------------------------------------- rendering


class _Text:
    """Renders as its text in ``inspect.Signature``'s ``str`` (no quotes, no module path)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


_QUALIFIED = re.compile(r"\b(?:typing|collections\.abc|harness(?:\.\w+)*)\.(?=\w)")


def annotation_text(annotation: object) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, typing.ForwardRef):  # a named tuple's field, as written
        return annotation.__forward_arg__
    if isinstance(annotation, type):
        return annotation.__qualname__
    return _QUALIFIED.sub("", inspect.formatannotation(annotation))


def default_text(value: object) -> str:
    """A default as it reads in the source, never with a memory address."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, type) or inspect.isroutine(value):
        return str(getattr(value, "__qualname__", getattr(value, "__name__", "?")))
    text = repr(value)
    if re.search(r" at 0x[0-9a-fA-F]+", text):
        return f"<{type(value).__qualname__}>"
    return _QUALIFIED.sub("", text)


def signature(obj: Callable[..., Any], drop_first: bool = False) -> str | None:
    """``(a: int, b=1) -> str`` as written, or None where Python cannot tell."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())[1 if drop_first else 0 :]
    empty = inspect.Parameter.empty
    params = [
        p.replace(
            annotation=empty if p.annotation is empty else _Text(annotation_text(p.annotation)),
            default=empty if p.default is empty else _Text(default_text(p.default)),
        )
        for p in params
    ]
    ret = sig.return_annotation
    ret = empty if ret is empty else _Text(annotation_text(ret))
    return str(sig.replace(parameters=params, return_annotation=ret))


def doc_of(obj: object) -> str:
    """The object's own docstring, cleaned: not one inherited from a base (``Exception``'s,
    ``torch.nn.Module.forward``'s), nor the one a dataclass or a named tuple generates."""
    raw = vars(obj).get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    doc = inspect.cleandoc(raw) if isinstance(raw, str) else ""
    if isinstance(obj, type) and re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)", doc, re.S):
        return ""
    return doc


def _inherited_doc(cls: type, name: str) -> str:
    """The docstring of ``name`` on the nearest harness base that documents it (an override
    says what the method it overrides says, as ``inspect.getdoc`` would, minus torch's)."""
    for base in cls.__mro__[1:]:
        raw = vars(base).get(name) if _is_harness(base) else None
        raw = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        if raw is not None and doc_of(raw):
            return doc_of(raw)
    return ""


@dataclass
class Entry:
    """One documented name: its heading, its signature line, its documentation, members."""

    path: str
    line: str | None
    doc: str
    members: list[Entry] = field(default_factory=list)
    attribute: bool = False  # a value (field, constant): a bullet of its class, no heading


def _value_line(name: str, assigned: Assigned | None, obj: object) -> str:
    annotation = assigned.annotation if assigned and assigned.annotation else None
    line = f"{name}: {annotation or type(obj).__qualname__}"
    value = assigned.value if assigned else None
    if value is not None and "\n" not in value and len(value) <= VALUE_WIDTH and name[:2] != "__":
        line += f" = {value}"
    return line


def entry(path: str, obj: object, public: set[int]) -> Entry:
    """The entry of one public name, ``path`` being how a user imports it."""
    name = path.rsplit(".", 1)[-1]
    if isinstance(obj, type):
        return class_entry(path, obj, public)
    if inspect.isroutine(obj):
        return Entry(path, f"def {name}{signature(obj) or '(...)'}", doc_of(obj))
    assigned = constant_source(name, obj)
    return Entry(path, _value_line(name, assigned, obj), assigned.doc if assigned else "")


def class_entry(path: str, cls: type, public: set[int]) -> Entry:
    name = path.rsplit(".", 1)[-1]
    bases = [b.__qualname__ for b in cls.__bases__ if b is not object]
    sig = None
    if not issubclass(cls, enum.Enum) and not getattr(cls, "_is_protocol", False):
        sig = (signature(cls) or "").removesuffix(" -> None")
    line = f"class {name}{sig or ''}" + (f"  # bases: {', '.join(bases)}" if bases else "")
    return Entry(path, line, doc_of(cls), members(cls, public))


def _own_classes(cls: type, public: set[int]) -> Iterator[type]:
    """``cls`` and the private harness bases whose members it shows (a public base is
    documented under its own name; a third party's, such as ``Exception``, not at all)."""
    yield cls
    for base in cls.__mro__[1:]:
        if _is_harness(base) and id(base) not in public:
            yield base


def members(cls: type, public: set[int]) -> list[Entry]:
    """The public attributes, properties and methods of ``cls``, sorted by name."""
    seen: dict[str, Entry] = {}
    for klass in _own_classes(cls, public):
        source = _source(klass)
        attributes = assignments(source, body_of_class=True) if source else {}
        for name, raw in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            prefix = f"{cls.__name__}.{name}"
            member = _member(prefix, name, raw, attributes.get(name))
            if member is not None and not member.doc and not member.attribute:
                member.doc = _inherited_doc(klass, name)
            if member is not None:
                seen[name] = member
        for name, assigned in attributes.items():  # annotated fields without a value
            if not name.startswith("_") and name not in seen:
                line = _value_line(name, assigned, None)
                seen[name] = Entry(f"{cls.__name__}.{name}", line, assigned.doc, attribute=True)
    return [seen[n] for n in sorted(seen)]


def _member(path: str, name: str, raw: object, assigned: Assigned | None) -> Entry | None:
    if isinstance(raw, (staticmethod, classmethod)):
        function = raw.__func__
        return Entry(
            path, f"def {name}{signature(function, isinstance(raw, classmethod))}", doc_of(function)
        )
    if inspect.isfunction(raw):
        return Entry(path, f"def {name}{signature(raw, drop_first=True)}", doc_of(raw))
    getter = getattr(raw, "fget", None) or getattr(raw, "func", None)
    if isinstance(raw, property) or type(raw).__name__ == "cached_property":
        ret = getattr(getter, "__annotations__", {}).get("return")
        kind = f"{name}: {annotation_text(ret)}" if ret is not None else name
        return Entry(path, f"{kind} (property)", doc_of(raw))
    if assigned is not None:
        return Entry(path, _value_line(name, assigned, raw), assigned.doc, attribute=True)
    return None


# ---------------------------------------------------------------------- the pytest plugin


@dataclass
class Option:
    """One option or ini value, as the plugin's ``pytest_addoption`` declares it."""

    names: tuple[str, ...]
    default: object
    help: str
    metavar: str | None = None
    kind: str | None = None  # an ini value's type; None for a command-line option


class _Recorder:
    """Stands in for ``pytest.Parser`` and its option groups: records every declaration."""

    def __init__(self) -> None:
        self.options: list[Option] = []
        self.ini: list[Option] = []

    def getgroup(self, name: str, description: str = "", after: str | None = None) -> _Recorder:
        return self

    def addoption(self, *names: str, **kwargs: Any) -> None:
        default = kwargs.get("default", False if kwargs.get("action") == "store_true" else None)
        metavar = kwargs.get("metavar")
        if kwargs.get("choices") and metavar is None:
            metavar = "{" + ",".join(kwargs["choices"]) + "}"
        self.options.append(Option(names, default, kwargs.get("help", ""), metavar))

    def addini(self, name: str, help: str, type: str | None = None, default: object = None) -> None:
        self.ini.append(Option((name,), default, help, kind=type or "string"))


def plugin_options() -> _Recorder:
    from harness.plugin import options

    recorder = _Recorder()
    options.pytest_addoption(recorder)  # type: ignore[arg-type]
    return recorder


def plugin_markers() -> list[tuple[str, str]]:
    """``(signature, description)`` of each marker the plugin registers, from its source."""
    import harness.plugin

    found = []
    for path in sorted(Path(harness.plugin.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "addinivalue_line"
                and len(node.args) == 2
                and ast.literal_eval(node.args[0]) == "markers"
            ):
                text = ast.literal_eval(node.args[1])
                head, _, description = text.partition(": ")
                found.append((head, description))
    return sorted(found)


def _fixture_function(obj: object) -> Callable[..., Any] | None:
    """The function under ``@pytest.fixture`` (pytest 8.4+ wraps it in an object)."""
    if type(obj).__name__ == "FixtureFunctionDefinition":
        return obj._get_wrapped_function()  # type: ignore[attr-defined, no-any-return]
    if getattr(obj, "_pytestfixturefunction", None) is not None:
        return obj  # type: ignore[return-value]
    return None


def plugin_fixtures() -> list[tuple[str, Callable[..., Any], type | None]]:
    """``(name, function, the class of what it gives the test)`` of each fixture."""
    import harness.plugin

    found = {}
    for info in pkgutil.walk_packages(harness.plugin.__path__, "harness.plugin."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            function = _fixture_function(obj)
            if function is None:
                continue
            ret = function.__annotations__.get("return")  # Iterator[SpatialFixture]: the last word
            given = (
                function.__globals__.get(re.findall(r"\w+", ret)[-1])
                if isinstance(ret, str)
                else ret
            )
            found[getattr(obj, "name", name)] = (
                function,
                given if isinstance(given, type) else None,
            )
    return [(name, *found[name]) for name in sorted(found)]


# ---------------------------------------------------------------------- the page


def reference() -> list[tuple[str, str, list[Entry]]]:
    """``(module path, module docstring, entries)`` for every documented module."""
    modules = documented_modules()
    exported = _exported(modules)
    out = []
    first: dict[int, str] = {}  # an object exported twice is documented where it comes first
    for module_name in modules:
        module = importlib.import_module(module_name)
        names = public_names(module, exported - _exported([module_name]))
        public = exported | {id(getattr(module, n)) for n in names}
        entries = []
        for n in names:
            obj, path = getattr(module, n), f"{module_name}.{n}"
            if id(obj) in first and not _is_constant(obj):
                where = first[id(obj)]
                entries.append(Entry(path, None, f"The same as [`{where}`](#{_anchor(where)})."))
                continue
            first.setdefault(id(obj), path)
            entries.append(entry(path, obj, public))
        out.append((module_name, doc_of(module), entries))
    return out


def undocumented(values: bool = False) -> list[str]:
    """Every documented name, method, property and fixture whose documentation is empty;
    with ``values``, also the fields and class attributes without a ``#:`` comment (many
    are told in their class's docstring: listed, not held by a test)."""
    missing: list[str] = []

    def check(entries: list[Entry], prefix: str = "") -> None:
        missing.extend(
            f"{prefix}{e.path}" for e in entries if not e.doc and (values or not e.attribute)
        )

    for module_name, doc, entries in reference():
        if not doc:
            missing.append(module_name)
        for e in entries:
            check([e, *e.members])
    for name, function, given in plugin_fixtures():
        if not doc_of(function):
            missing.append(f"fixture {name}")
        if given is not None:
            check(members(given, set()), f"fixture {name}: ")
    return missing


def _anchor(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def markdown(doc: str) -> str:
    """A docstring as Markdown shows it: a doctest paragraph as a code block (else its lines
    run together), a numpydoc section title underlined with dashes in bold (else it becomes
    a heading of the page). Everything else reads the same in both."""
    paragraphs = []
    for paragraph in doc.split("\n\n"):
        lines = paragraph.split("\n")
        if lines[0].startswith(">>>"):
            lines = ["    " + line for line in lines]
        for i in range(1, len(lines)):
            if re.fullmatch(r"-{3,}", lines[i]) and lines[i - 1].strip():
                lines[i - 1], lines[i] = f"**{lines[i - 1].strip()}**", ""
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def _entry_lines(e: Entry, level: str) -> list[str]:
    lines = [f"{level} `{e.path}`", ""]
    if e.line:
        lines += ["```text", e.line, "```", ""]
    if e.doc:
        lines += [markdown(e.doc), ""]
    lines += _member_lines(e.members, level + "#", e.path.rsplit(".", 1)[-1])
    return lines


def _member_lines(entries: list[Entry], level: str, owner: str) -> list[str]:
    """A class's values as one list, then each method or property under its signature."""
    lines = [f"- `{m.line}`" + (f": {m.doc}" if m.doc else "") for m in entries if m.attribute]
    lines += [""] if lines else []
    for m in entries:
        if not m.attribute:
            heading = f"{owner}.{m.line.removeprefix('def ')}" if m.line else m.path
            lines += [f"{level} `{heading}`", "", markdown(m.doc), ""]
    return lines


def _option_lines(opt: Option) -> list[str]:
    name = " ".join(opt.names) + (f" {opt.metavar}" if opt.metavar else "")
    kind = f", {opt.kind}" if opt.kind else ""
    return [f"- `{name}` (default `{opt.default!r}`{kind}): {opt.help.replace('%%', '%')}"]


def plugin_lines() -> list[str]:
    recorded = plugin_options()
    lines = ["## The pytest plugin", "", "Options, as `pytest --help` lists them:", ""]
    for opt in recorded.options:
        lines += _option_lines(opt)
    lines += ["", "Ini values (`[tool.pytest.ini_options]`, `pytest.ini`):", ""]
    for opt in recorded.ini:
        lines += _option_lines(opt)
    lines += ["", "### Markers", ""]
    for head, description in plugin_markers():
        lines += [f"- `@pytest.mark.{head}`: {description}"]
    lines += [""]
    for name, function, given in plugin_fixtures():
        lines += [f"### Fixture `{name}`", ""]
        if given is not None:
            lines += ["```text", f"{name}: {given.__name__}", "```", ""]
        lines += [markdown(doc_of(function)), ""]
        if given is not None:
            lines += _member_lines(members(given, set()), "####", name)
    return lines


def render() -> str:
    """The whole page, as docs/api.md holds it."""
    modules = reference()
    lines = [
        "# API reference",
        "",
        f"Generated from the docstrings by `{COMMAND}`: edit the docstrings, not this page",
        "(a test fails when the two differ). Every name is listed under the path you import it",
        "by; `harness.__all__` is the stable API, the modules below it are documented for",
        "direct import. [How it works](architecture.md) is the map of the code.",
        "",
        *[f"- [`{name}`](#{_anchor(name)})" for name, _, _ in modules],
        "- [The pytest plugin](#the-pytest-plugin)",
        "",
    ]
    for module_name, doc, entries in modules:
        lines += [f"## `{module_name}`", "", markdown(doc), ""]
        for e in entries:
            lines += _entry_lines(e, "###")
    lines += plugin_lines()
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def main() -> None:
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's harness, not another installed one
    main()
