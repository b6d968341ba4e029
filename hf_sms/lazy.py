"""Packages whose public names are imported when first used (PEP 562), as transformers' and diffusers' are.

``import hf_sms`` and ``hf-sms inspect`` / ``hf-sms --help`` then start without torch (2.4 s of import alone on a
small CPU), and ``from hf_sms import SparseSoupTrainer`` imports what the trainer needs, once. Each lazy package
lists ``{public name: defining module}`` in one table; ``tests/test_house.py`` checks every entry resolves and that
no public name is also a submodule's name (importing that submodule would replace the name on the package).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose names live in its submodules (a submodule is an attribute
    too, imported when first asked for, as it was when the package imported everything).

    Args:
        package: the package's ``__name__``.
        table: ``{name: module}``, the module relative to ``package`` (e.g. ``".checkpoint.sparse"``).
    """

    def __getattr__(name: str):
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            setattr(sys.modules[package], name, value)  # the next lookup is a plain attribute
            return value
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f".{name}", package)  # `hf_sms.pruning.X` after a plain `import hf_sms`
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``module`` with the other finders and runs ``hook`` right after the module has executed."""

    def __init__(self, module: str, hook: Callable[[], None]):
        self.module, self.hook = module, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute, hook = spec.loader.exec_module, self.hook

        def exec_module(module):
            execute(module)
            hook()

        spec.loader.exec_module = exec_module  # this loader instance serves this one module
        return spec


def when_imported(module: str, hook: Callable[[], None]) -> None:
    """Run ``hook`` once ``module`` is imported: now if it already is, else right after its import (so registering
    with a heavy library costs nothing until that library is used)."""
    if module in sys.modules:
        hook()
    elif not any(isinstance(f, _AfterImport) and f.module == module for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module, hook))
