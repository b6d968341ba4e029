"""Wall time of one SMS phase: m=2 replicas on 2 processes vs 1 replica on 1 process (1 thread each), and the
evaluation of the phase's soup (validation and test sets) on 2 processes vs 1; with ``--whole-run``, the whole run
with baselines (every process busy, issue 29): m replicas and baselines imp + imp_mx on m processes vs on 1.

    python benchmarks/replica_scaling.py --rounds 3
    python benchmarks/replica_scaling.py --whole-run --rounds 3 --steps 300 --phases 1

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
import time

from hf_sms.records.results import timeline

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "tests", "scripts", "sms_digits.py")

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--steps", type=int, default=150, help="Retraining steps per replica.")
p.add_argument("--eval-copies", type=int, default=20, help="Validation and test sets repeated (2880 + 7200 images).")
p.add_argument("--whole-run", action="store_true", help="Time whole runs with baselines imp + imp_mx instead.")
p.add_argument("--replicas", type=int, default=2, help="--whole-run: m, and the processes of the parallel run.")
p.add_argument("--phases", type=int, default=1, help="--whole-run: phases.")
p.add_argument("--share", action="store_true", help="--whole-run: also time share_idle_groups=True.")
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


def whole_run(nproc: int, share: bool = False) -> tuple[float, float, float]:
    """(launch seconds, in-run seconds, the largest idle fraction of a process) of a run with baselines."""
    with tempfile.TemporaryDirectory(prefix="hf-sms-scaling-") as out:
        cmd = [SCRIPT, out, "--phases", str(cli.phases), "--replicas", str(cli.replicas), "--steps", str(cli.steps)]
        cmd += ["--baselines", "imp", "imp_mx"] + (["--share"] if share else [])
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
        start = time.perf_counter()
        subprocess.run([sys.executable, *launcher, *cmd], env=env, check=True, capture_output=True)
        took = time.perf_counter() - start
        with open(os.path.join(out, "results.json")) as f:
            run = json.load(f)
    return took, run["world"]["seconds"], max(r["idle"] for r in timeline(run))


if cli.whole_run:
    kinds = {"1 process": (1, False), f"{cli.replicas} processes": (cli.replicas, False)}
    if cli.share:
        kinds[f"{cli.replicas} processes, share_idle_groups"] = (cli.replicas, True)
    times = {k: [] for k in kinds}
    for r in range(cli.rounds):
        for kind, (n, share) in kinds.items():
            times[kind].append(whole_run(n, share))
        said = [f"{k} {t[-1][0]:.2f} s (in run {t[-1][1]:.2f} s, most idle {100 * t[-1][2]:.1f}%)" for k, t in
                times.items()]  # fmt: skip
        print(f"round {r + 1}: " + "; ".join(said), flush=True)
    base = [statistics.median(t[j] for t in times["1 process"]) for j in (0, 1)]
    for kind, t in times.items():
        launch, inside, idle = (statistics.median(x[j] for x in t) for j in (0, 1, 2))
        print(
            f"median {kind}: launch {launch:.2f} s ({launch / base[0]:.3f}x), in run {inside:.2f} s "
            f"({inside / base[1]:.3f}x), most idle process {100 * idle:.1f}%"
        )
    sys.exit(0)

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
