"""Wall time of one SMS phase: m=2 replicas on 2 processes vs 1 replica on 1 process (1 thread each).

    python benchmarks/replica_scaling.py --rounds 3

The paper's point is that the m retraining runs of a phase are fully parallel, so the ratio should
be close to 1 (target <= 1.2). Runs alternate A/B to share the machine's noise; the phase time is
measured inside the run (results.json, ``sms[0].seconds``), so process start-up is excluded.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "tests", "scripts", "sms_digits.py")

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--steps", type=int, default=150, help="Retraining steps per replica.")
cli = p.parse_args()
env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def phase_seconds(nproc: int, replicas: int) -> float:
    out = tempfile.mkdtemp(prefix="hf-sms-scaling-")
    cmd = [sys.executable, SCRIPT, out, "--phases", "1", "--replicas", str(replicas), "--steps", str(cli.steps)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd[1:]]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)["sms"][0]["seconds"]


parallel, single = [], []
for r in range(cli.rounds):
    parallel.append(phase_seconds(2, 2))
    single.append(phase_seconds(1, 1))
    print(f"round {r + 1}: m=2 on 2 processes {parallel[-1]:.2f} s, m=1 on 1 process {single[-1]:.2f} s", flush=True)
a, b = statistics.median(parallel), statistics.median(single)
print(f"median phase time: m=2 on 2 processes {a:.2f} s, m=1 on 1 process {b:.2f} s, ratio {a / b:.3f} (target <= 1.2)")
