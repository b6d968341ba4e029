"""The prepared GPU check runs end to end on a CPU in its --dry-run form (the GPU form needs a lent machine)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_gpu_check_dry_run():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    for step in ("== (a)", "== (b)", "== (c)", "== (d)", "masks exact after every run", "gpu_check done"):
        assert step in out
    assert "| 512x512 | 32 | 90% csr |" in out and "| 90% uniform, auto |" in out
    assert "final soup speedup:" in out  # the smoke run's table with its measured speedup
    assert "| T5-small | 50% neurons+heads | forward 2x128 |" in out and "| ResNet-50 | 50% filters |" in out
