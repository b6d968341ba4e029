"""Every ```python block of README.md and docs/ (recursively) runs as written: offline, in a fresh folder, on its own.

A block fenced ```python no-test (one that needs the network, e.g. an upload to the Hub) is skipped; one fenced
```python requires=trl runs where that optional package is installed.
"""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
TIMEOUT_S = 300  # a block takes ~5-20 s on 2 busy cores; this only catches hangs


def _blocks():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for number, match in enumerate(FENCE.finditer(text), 1):
            name = f"{path.relative_to(ROOT)}:block{number}"
            line = text.count("\n", 0, match.start()) + 1
            info = match["info"].split()
            skip = "no-test" in info
            marks = [pytest.mark.skip(reason="```python no-test: needs the network")] if skip else []
            for package in [w.split("=", 1)[1] for w in info if w.startswith("requires=")]:
                found = importlib.util.find_spec(package) is not None
                marks.append(pytest.mark.skipif(not found, reason=f"needs the optional package {package}"))
            yield pytest.param(name, line, match["code"], id=name, marks=marks)


BLOCKS = list(_blocks())


def test_the_docs_have_examples():
    assert len(BLOCKS) >= 5, "the fence pattern found too few ```python blocks"


@pytest.mark.parametrize(("name", "line", "code"), BLOCKS)
def test_python_block_runs(fork_server, tmp_path, name, line, code):
    """Each block a fresh process (forked from one that imported torch, transformers and hf_sms: a block costs its
    own work, not its imports), in its own folder."""
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = fork_server.run(script, cwd=tmp_path, timeout=TIMEOUT_S)
    if proc.returncode is None:
        pytest.fail(f"{name} (line {line}) ran longer than {TIMEOUT_S} s")
    if proc.returncode != 0:
        pytest.fail(
            f"{name} (starting at line {line}; example.py line k is file line {line}+k) failed with exit code "
            f"{proc.returncode}:\n{proc.stderr[-4000:]}"
        )
