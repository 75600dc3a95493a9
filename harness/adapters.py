"""Model adapters: what ``harness-check --model NAME`` verifies, found by entry point.

An adapter says, for one model, which layouts the main job checks, which faults it injects
and which of them a rank count cannot show, what its rank processes should import once, and
how to tell that the model is installed. Adapters are registered, as pytest finds plugins,
under the entry-point group ``harness.models`` of their distribution's metadata::

    [project.entry-points."harness.models"]
    mymodel = "mypackage.harness_adapter:adapter"

The object named is a ``ModelAdapter``, or a module with the older implicit interface
(``main_configs(ranks)``, optionally ``fault_matrix(ranks)``, ``skipped_faults(ranks)``,
``PRELOAD`` and ``require()`` or ``require_<name>()``), which ``ModuleAdapter`` wraps. The
harness registers its own three that way in ``pyproject.toml``: ``builtin`` (the built-in
steppers), ``fme`` and ``anemoi`` (``harness.contrib``).

Loading an entry point must be cheap and must not import the model: ``require`` does that,
so ``harness-check`` can name the missing extra in one line.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from harness.case import SpatialCase
from harness.errors import ConfigError

#: The entry-point group adapters are registered under.
GROUP = "harness.models"

CaseFactory = Callable[..., SpatialCase]


class Layout(NamedTuple):
    """One equivalence check of the main job: ``make(**kwargs)`` on ``spatial_size`` ranks
    per spatial group (None: all ranks one group). A named tuple, so the older positional
    tuples ``(label, make, kwargs, spatial_size)`` and these read alike."""

    label: str
    make: CaseFactory
    kwargs: Mapping[str, object]
    spatial_size: int | None = None

    def case(self, **extra: object) -> SpatialCase:
        """The case to check: ``make(**kwargs, **extra)`` (``extra`` wins)."""
        return self.make(**{**self.kwargs, **extra})


class FaultCheck(NamedTuple):
    """One fault of the matrix: ``make(**kwargs, faults=(fault,))`` must fail the check
    with one of ``expected`` (the quantities FAULTS.md says catch it)."""

    stepper: str
    make: CaseFactory
    kwargs: Mapping[str, object]
    spatial_size: int | None
    fault: str
    expected: frozenset[str]

    @property
    def layout(self) -> Layout:
        """The layout the fault is injected on, without the fault."""
        return Layout(self.stepper, self.make, self.kwargs, self.spatial_size)


class Skipped(NamedTuple):
    """A fault that this rank count cannot show, and why."""

    stepper: str
    fault: str
    why: str


@runtime_checkable
class ModelAdapter(Protocol):
    """What ``harness-check --model NAME`` needs of a model."""

    @property
    def name(self) -> str:
        """The name ``--model`` takes."""
        ...

    @property
    def preload(self) -> tuple[str, ...]:
        """Modules the rank pool's fork server imports once (the model's heavy imports)."""
        ...

    def require(self) -> None:
        """Import the model; a ``ConfigError`` (or ``ImportError``) naming the fix if absent."""
        ...

    def layouts(self, ranks: int) -> list[Layout]:
        """The equivalence checks of the main job on ``ranks`` ranks."""
        ...

    def faults(self, ranks: int) -> list[FaultCheck]:
        """The injected faults each check must catch on ``ranks`` ranks."""
        ...

    def skipped(self, ranks: int) -> list[Skipped]:
        """The faults ``ranks`` ranks cannot show, each with why."""
        ...


@dataclass(frozen=True)
class ModuleAdapter:
    """An adapter over a module of the older implicit interface, imported on first use."""

    name: str
    module: str

    def _module(self) -> types.ModuleType:
        return importlib.import_module(self.module)

    @property
    def preload(self) -> tuple[str, ...]:
        """The module's ``PRELOAD`` (none if it has none)."""
        return tuple(getattr(self._module(), "PRELOAD", ()))

    def require(self) -> None:
        """Import the module, then call its ``require()`` or ``require_<name>()`` if it has one."""
        module = self._module()
        require = getattr(module, "require", None) or getattr(module, f"require_{self.name}", None)
        if require is not None:
            require()

    def layouts(self, ranks: int) -> list[Layout]:
        """The module's ``main_configs(ranks)``, as ``Layout`` s."""
        return [Layout(*c) for c in self._module().main_configs(ranks)]

    def faults(self, ranks: int) -> list[FaultCheck]:
        """The module's ``fault_matrix(ranks)``, as ``FaultCheck`` s (none without one)."""
        matrix = getattr(self._module(), "fault_matrix", None)
        if matrix is None:
            return []
        return [
            FaultCheck(stepper, make, kwargs, size, fault, frozenset(expected))
            for stepper, make, kwargs, size, fault, expected in matrix(ranks)
        ]

    def skipped(self, ranks: int) -> list[Skipped]:
        """The module's ``skipped_faults(ranks)``, as ``Skipped`` (none without one)."""
        skipped = getattr(self._module(), "skipped_faults", None)
        return [] if skipped is None else [Skipped(*s) for s in skipped(ranks)]


# what pyproject.toml registers; named here so that entry points can point at them
#: the built-in steppers' layouts and fault catalogue (``harness.steppers.catalogue``)
builtin = ModuleAdapter("builtin", "harness.steppers.catalogue")
#: ACE's SFNO through fme's own distributed code path (``harness.contrib.fme``)
fme = ModuleAdapter("fme", "harness.contrib.fme")
#: anemoi-models' graph model through its own sharded path (``harness.contrib.anemoi``)
anemoi = ModuleAdapter("anemoi", "harness.contrib.anemoi")
#: makani's SFNO, model parallel over latitudes by its own code (``harness.contrib.makani``)
makani = ModuleAdapter("makani", "harness.contrib.makani")
_OWN = {a.name: a for a in (builtin, fme, anemoi, makani)}


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def adapter_names() -> list[str]:
    """The names ``--model`` takes: every registered adapter (the harness's own three even
    where this checkout's install metadata predates their registration)."""
    return sorted({*_OWN, *_entry_points()}, key=lambda n: (n != "builtin", n))


def as_adapter(name: str, obj: object) -> ModelAdapter:
    """``obj`` as an adapter: itself, or a module of the implicit interface wrapped."""
    if isinstance(obj, types.ModuleType):
        if not hasattr(obj, "main_configs"):
            raise ConfigError(
                f"the {GROUP} entry point {name!r} names module {obj.__name__}, which has no "
                "main_configs(ranks); name a ModelAdapter object, or give the module one"
            )
        return ModuleAdapter(name, obj.__name__)
    if not isinstance(obj, ModelAdapter):
        missing = [
            a
            for a in ("name", "preload", "require", "layouts", "faults", "skipped")
            if not hasattr(obj, a)
        ]
        raise ConfigError(
            f"the {GROUP} entry point {name!r} names {obj!r}, which is not a ModelAdapter "
            f"(it lacks {', '.join(missing)}); see harness.adapters.ModelAdapter"
        )
    return obj


def find_adapter(name: str) -> ModelAdapter:
    """The adapter registered as ``name``; a ``ConfigError`` naming the registered ones."""
    found = _entry_points()
    if name in found:
        try:
            obj = found[name].load()
        except Exception as exc:  # whatever its module raises on import
            raise ConfigError(
                f"the {GROUP} entry point {name!r} ({found[name].value}) cannot be loaded: "
                f"{type(exc).__name__}: {exc}; fix or reinstall the package that registers "
                "it (python -c 'import MODULE' shows the traceback)"
            ) from exc
        return as_adapter(name, obj)
    if name in _OWN:
        return _OWN[name]
    raise ConfigError(
        f"no model adapter named {name!r}; registered under the entry-point group {GROUP!r}: "
        f"{', '.join(adapter_names())}"
    )
