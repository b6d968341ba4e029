"""The prepared GPU check runs end to end on a CPU in its --dry-run form (the GPU form needs a lent machine).

The dry run takes ~45 s (five fresh interpreters and a smoke recipe under accelerate launch), so it runs with
``-m slow`` (run it before a session that has a GPU); CI checks that the script and every benchmark it calls parse.
"""

import os
import py_compile
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_gpu_check_and_the_scripts_it_calls_parse():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    called = set(re.findall(r"(benchmarks/\w+\.py|recipes/\w+\.py)", SCRIPT.read_text()))
    assert {
        "benchmarks/gpu_runtime.py",
        "benchmarks/structured.py",
        "benchmarks/mask_overhead.py",
        "benchmarks/unit_multiple.py",
        "benchmarks/replica_memory.py",
        "benchmarks/batchnorm_processes.py",
        "benchmarks/learned_soup_memory.py",
        "benchmarks/trainer_fsdp.py",
        "benchmarks/llm_phase.py",
    } <= called
    for path in called:
        py_compile.compile(str(ROOT / path), doraise=True)


@pytest.mark.slow
def test_gpu_check_dry_run():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    for step in (
        "== (a)",
        "== (b)",
        "== (c)",
        "== (d)",
        "== (e)",
        "== (f)",
        "== (fgc)",
        "== (f64)",
        "== (g)",
        "3 processes vs 1, largest running-statistic difference 0\n",
        "== (h)",
        "fit / (weights + one training step) =",
        "masks exact after every run",
        "== (i)",
        "OK   no FSDP: masks exact after training",
        "OK   no FSDP: save_model -> load_sparse",
        "== (j)",
        "== (llm7b)",
        '"soup_mask_exact": true',
        "gpu_check done",
    ):
        assert step in out
    assert "| 512x512 | 32 | 90% csr |" in out and "| 90% uniform, auto |" in out
    assert "final soup speedup:" in out  # the smoke run's table with its measured speedup
    assert "| T5-small | 50% neurons+heads | forward 2x128 |" in out and "| ResNet-50 | 50% filters |" in out
