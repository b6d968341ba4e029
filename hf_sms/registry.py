"""One ``Registry`` class for every table of pluggable pieces: allocations, LR schedules, soups, pruning methods,
baselines, model families. A new piece is one registration; a lookup that fails says what there is.

Like peft's and mergekit's registries: entries are registered by name (a plain identifier: names become folder
names and command-line choices), once; each may carry metadata and a ``check(config)`` that validates a run
configuration for it before any work (e.g. BIMP's epoch range), so the config loops over entries instead of
knowing them.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass
class Entry(Generic[T]):
    """A registered piece: the object, its metadata, and the check a config must pass to use it."""

    name: str
    obj: T
    meta: dict = field(default_factory=dict)
    check: Callable[[object], None] | None = None


class Registry(Generic[T]):
    """A named table. ``@REG.register("name", check=fn, **meta)`` adds an entry; ``REG.get("name")`` returns it.

    Args:
        kind: what the entries are, for messages ("allocation", "soup method", ...).
        hint: appended to the "unknown" message, e.g. how to write a pattern.
        home: the module whose import registers the built-in entries; imported on the first lookup (``import
            hf_sms`` imports nothing, :mod:`hf_sms.lazy`), so a table is never seen half empty.

    ``parse``, set by the module that owns the patterns: ``parse(name) -> object | None`` for names that are
    patterns rather than entries (the n:m allocations, ``"2:4"``); tried before the table.
    """

    def __init__(self, kind: str, hint: str = "", home: str | None = None):
        self.kind, self.hint, self._home = kind, hint, home
        self.parse: Callable[[str], T | None] | None = None
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, *, check: Callable[[object], None] | None = None, **meta) -> Callable[[T], T]:
        """Decorator adding ``obj`` under ``name`` (a plain identifier, new to this registry)."""

        def add(obj: T) -> T:
            self.add(name, obj, check=check, **meta)
            return obj

        return add

    def add(self, name: str, obj: T, *, check: Callable[[object], None] | None = None, **meta) -> T:
        """Add ``obj`` under ``name``; see :meth:`register`."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{self.kind} name {name!r} must be a plain identifier (letters, digits, _)")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = Entry(name, obj, meta, check)
        return obj

    def _load(self) -> None:
        home, self._home = self._home, None  # before the import: its own lookups must not import it again
        if home is not None:
            try:
                importlib.import_module(home)
            except BaseException:
                self._home = home
                raise

    def remove(self, name: str) -> T:
        """Take an entry out again (a plugin or a test that registered one)."""
        return self._entries.pop(name).obj

    def get(self, name: str) -> T:
        """The entry called ``name``, or a ``ValueError`` naming the choices."""
        self._load()
        if self.parse is not None:
            parsed = self.parse(name)
            if parsed is not None:
                return parsed
        if name not in self._entries:
            hint = f" {self.hint}" if self.hint else ""
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}{hint}")
        return self._entries[name].obj

    def meta(self, name: str) -> dict:
        """The metadata ``name`` was registered with (``{}`` for a parsed pattern)."""
        self._load()
        return self._entries[name].meta if name in self._entries else {}

    def check(self, name: str, config) -> None:
        """Validate ``config`` for the entry ``name`` (unknown names raise; entries without a check pass)."""
        self.get(name)
        entry = self._entries.get(name)
        if entry is not None and entry.check is not None:
            entry.check(config)

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __contains__(self, name) -> bool:
        self._load()
        return name in self._entries

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(self._entries)

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def items(self):
        self._load()
        return [(n, e.obj) for n, e in self._entries.items()]

    def values(self):
        self._load()
        return [e.obj for e in self._entries.values()]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def import_submodules(package: str, path: Iterable[str]) -> None:
    """Import every module of ``package`` (its ``__name__`` and ``__path__``), so that each file registers its
    entries by being there: a new soup, method or baseline needs no import line elsewhere."""
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")


# -- the tables -------------------------------------------------------------------------------------------------
# Declared here, filled where each piece lives (the home module, imported on the first lookup), so the config
# validates against them without importing the pieces and nothing imports in a circle.
ALLOCATIONS: Registry = Registry("allocation", hint="or 'n:m' (e.g. '2:4')", home="hf_sms.pruning.allocations")
RETRAIN_SCHEDULES: Registry = Registry("retraining schedule", home="hf_sms.training.schedules")
PRETRAIN_SHAPES: Registry = Registry("original LR schedule shape", home="hf_sms.training.schedules")
SOUPS: Registry = Registry("soup method", home="hf_sms.soup")
PRUNING_METHODS: Registry = Registry("pruning method", hint="or 'imp' (the SMS loop)", home="hf_sms.methods")
BASELINES: Registry = Registry("baseline", home="hf_sms.baselines")
CRITERIA: Registry = Registry("pruning criterion", home="hf_sms.pruning.criteria")
REPLICA_PARAMS: Registry = Registry("replica parameter subset", home="hf_sms.adapters.replica")
STRUCTURES: Registry = Registry(
    "pruning structure",
    hint="or 'n:m' (e.g. '2:4'), or several joined by '+' (e.g. 'neurons+heads')",
    home="hf_sms.plan.structures",
)
