"""The structure of the package: no import circle (imports inside functions and under TYPE_CHECKING included), no
import of hf-sms's own modules placed inside a function, modules of a readable size, and every registry table
serves lookups with one error message."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "hf_sms"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(module: str, path: Path) -> list[tuple[str, ast.AST]]:
    """``(imported hf_sms module, import node)`` of every import in the file, wherever it stands."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names if a.name.startswith("hf_sms")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if not target.startswith("hf_sms"):
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in MODULES else target, node))
    return [(t, n) for t, n in out if t in MODULES and t != module]


def test_no_import_circle():
    graph = {m: {t for t, _ in _edges(m, p)} for m, p in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import circle: " + " -> ".join(stack[stack.index(t) :] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_own_modules_are_imported_at_the_top_of_each_file():
    misplaced = []
    for module, path in MODULES.items():
        top = {(n.lineno, n.col_offset) for n in ast.parse(path.read_text()).body}
        edges = _edges(module, path)
        misplaced += sorted({f"{module}:{n.lineno}" for _, n in edges if (n.lineno, n.col_offset) not in top})
    assert not misplaced, f"hf_sms imports inside functions or TYPE_CHECKING blocks: {misplaced}"


def test_modules_stay_readable():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_table_is_a_registry_with_one_error_message():
    import hf_sms
    from hf_sms.families import FAMILIES
    from hf_sms.registry import PRETRAIN_SHAPES, Registry

    tables = [hf_sms.ALLOCATIONS, hf_sms.RETRAIN_SCHEDULES, PRETRAIN_SHAPES, hf_sms.SOUPS]
    tables += [hf_sms.PRUNING_METHODS, hf_sms.BASELINES, FAMILIES]
    for table in tables:
        assert isinstance(table, Registry) and len(table) > 0
        with pytest.raises(ValueError, match=rf"unknown {table.kind} 'nope'; choose one of \['"):
            table.get("nope")


def test_a_new_file_in_a_registering_package_needs_no_import_line(tmp_path, monkeypatch):
    """soup/, methods/ and baselines/ import every module they hold: adding a file is enough to register."""
    import sys

    from hf_sms.registry import Registry, import_submodules

    package = tmp_path / "plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    table = Registry("plugin")
    monkeypatch.setitem(sys.modules, "plugin_table", type(sys)("plugin_table"))
    sys.modules["plugin_table"].TABLE = table
    for name in ("first", "second"):
        (package / f"{name}.py").write_text(f"from plugin_table import TABLE\nTABLE.add({name!r}, object())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import plugins

    import_submodules(plugins.__name__, plugins.__path__)
    assert table.names() == ["first", "second"]
    for pkg in ("soup", "methods", "baselines"):
        source = (PACKAGE / pkg / "__init__.py").read_text()
        assert "import_submodules(__name__, __path__)" in source, pkg


LAZY_PACKAGES = ("hf_sms", "hf_sms.checkpoint")


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_lazy_name_resolves_and_none_is_a_submodule(package):
    """A lazy package's table names where each public name lives; a name that were also a submodule's would be
    replaced by the submodule whenever that submodule is imported first (``hf_sms.shrink``: the function, not the
    package, which is therefore ``hf_sms.shrinking``)."""
    import importlib

    pkg = importlib.import_module(package)
    for name, module in pkg._EXPORTS.items():
        assert f"{package}.{name}" not in MODULES, f"{package}.{name} is a public name and a submodule"
        defined = getattr(importlib.import_module(module, package), name)
        assert getattr(pkg, name) is defined, name
    assert set(pkg._EXPORTS) <= set(pkg.__all__) and set(pkg._EXPORTS) <= set(dir(pkg))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        pkg.nope  # noqa: B018


def test_a_plain_import_reaches_every_submodule_as_an_attribute():
    """``import hf_sms`` then ``hf_sms.pruning.ExactMasking`` worked when the package imported everything; it still
    does, each submodule imported when first asked for."""
    import subprocess
    import sys

    code = (
        "import sys, hf_sms\n"
        "assert 'hf_sms.pruning' not in sys.modules\n"
        "assert hf_sms.pruning.ExactMasking and hf_sms.checkpoint.codec.encode_tensor and hf_sms.soup.soup\n"
        "assert hf_sms.soup.merging.greedy_soup\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_every_registry_fills_itself_on_its_first_lookup():
    """``import hf_sms`` imports no piece: each table imports its home on first use, so a lookup through a
    submodule (``from hf_sms.registry import SOUPS``) never sees it half empty."""
    import subprocess
    import sys

    code = (
        "import sys; from hf_sms.registry import SOUPS, BASELINES, STRUCTURES, ALLOCATIONS, CRITERIA\n"
        "assert 'hf_sms.soup' not in sys.modules\n"
        "assert 'greedy' in SOUPS and 'imp' in BASELINES and STRUCTURES.get('2:4') and ALLOCATIONS.get('2:4')\n"
        "assert 'magnitude' in CRITERIA.names()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_every_command_names_a_function_and_the_formats_agree():
    from hf_sms import cli
    from hf_sms.checkpoint.constants import FORMATS

    assert cli.FORMATS == FORMATS
    subcommands = next(a for a in cli._parser()._actions if a.dest == "command").choices
    for name, parser in subcommands.items():
        assert callable(cli.command(parser.get_default("run"))), name
