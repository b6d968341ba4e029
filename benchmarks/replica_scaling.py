"""Wall time of one SMS phase: m=2 replicas on 2 processes vs 1 replica on 1 process (1 thread each), and the
evaluation of the phase's soup (validation and test sets) on 2 processes vs 1.

    python benchmarks/replica_scaling.py --rounds 3

The paper's point is that the m retraining runs of a phase are fully parallel, so the phase ratio should
be close to 1 (target <= 1.2); the soup's evaluation is shared by the processes (target <= 0.6x on 2). Runs
alternate A/B to share the machine's noise; both times are measured inside the run (results.json,
``sms[0].seconds`` and ``sms[0].eval_seconds``), so process start-up is excluded.
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
p.add_argument("--eval-copies", type=int, default=20, help="Validation and test sets repeated (2880 + 7200 images).")
cli = p.parse_args()
env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def phase_seconds(nproc: int, replicas: int) -> tuple[float, float]:
    """(phase seconds, seconds evaluating the phase's soup)."""
    with tempfile.TemporaryDirectory(prefix="hf-sms-scaling-") as out:
        cmd = [sys.executable, SCRIPT, out, "--phases", "1", "--replicas", str(replicas), "--steps", str(cli.steps)]
        cmd += ["--eval-copies", str(cli.eval_copies)]
        if nproc > 1:
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            cmd = [sys.executable, *launcher, *cmd[1:]]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        with open(os.path.join(out, "results.json")) as f:
            phase = json.load(f)["sms"][0]
    return phase["seconds"], phase["eval_seconds"]


parallel, single = [], []
for r in range(cli.rounds):
    parallel.append(phase_seconds(2, 2))
    single.append(phase_seconds(1, 1))
    (a, ea), (b, eb) = parallel[-1], single[-1]
    print(f"round {r + 1}: m=2 on 2 processes {a:.2f} s (soup evaluated in {ea:.2f} s), m=1 on 1 process {b:.2f} s "
          f"({eb:.2f} s)", flush=True)  # fmt: skip
a, b = (statistics.median(t[0] for t in runs) for runs in (parallel, single))
print(f"median phase time: m=2 on 2 processes {a:.2f} s, m=1 on 1 process {b:.2f} s, ratio {a / b:.3f} (target <= 1.2)")
a, b = (statistics.median(t[1] for t in runs) for runs in (parallel, single))
print(f"median soup evaluation: 2 processes {a:.2f} s, 1 process {b:.2f} s, ratio {a / b:.3f} (target <= 0.6)")
