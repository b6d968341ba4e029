"""Registries of pluggable methods (allocations, soups, baselines, pruning methods): a new method is one
function and one decorator line, and a name is registered once."""

from __future__ import annotations

import re
from collections.abc import Callable


def registrar(table: dict, kind: str) -> Callable[[str], Callable]:
    """``register = registrar(TABLE, "allocation")``; then ``@register("name")`` adds a function to ``TABLE``."""

    def register(name: str) -> Callable:
        def deco(fn: Callable) -> Callable:
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
                # names become folder names (run/<baseline>/phase1) and command-line choices
                raise ValueError(f"{kind} name {name!r} must be a plain identifier (letters, digits, _)")
            if name in table:
                raise ValueError(f"{kind} {name!r} is already registered")
            table[name] = fn
            return fn

        return deco

    return register
