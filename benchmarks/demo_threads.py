"""Wall time of the offline demo (``hf-sms demo``) with 1 and 2 torch threads, alone and beside another
single-thread job (a torch matmul loop), each in a fresh process: what picks the demo's thread default.

    python benchmarks/demo_threads.py            # the full demo, 4 runs
    python benchmarks/demo_threads.py --quick    # hf-sms demo --quick
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true")
cli = p.parse_args()
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a = (a @ a).tanh()"
print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
print("| threads | beside a 1-thread job | demo s |\n|---|---|---|")
for busy in (False, True):
    for threads in (1, 2):
        other = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
        try:
            with tempfile.TemporaryDirectory(prefix="hf-sms-demo-") as out:
                cmd = [sys.executable, "-m", "hf_sms.cli", "demo", "--output-dir", out, "--threads", str(threads)]
                start = time.perf_counter()
                subprocess.run(cmd + (["--quick"] if cli.quick else []), check=True, capture_output=True)
                seconds = time.perf_counter() - start  # not the folder's removal
            print(f"| {threads} | {'yes' if busy else 'no'} | {seconds:.0f} |", flush=True)
        finally:
            if other is not None:
                other.kill()
