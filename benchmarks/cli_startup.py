"""How fast ``hf-sms --help`` and ``hf-sms inspect`` answer on a small folder (issue 30: under 2 s), side by side
with what they would cost if they imported torch (``import torch`` alone) or the torch reader of checkpoints.

    python benchmarks/cli_startup.py [--repeats 7] [--mb 1]

Each command runs in a fresh process, rounds interleaved; the medians and the slowest round are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _folder(path: str, mb: float) -> str:
    import torch
    from torch import nn

    import hf_sms

    width = max(16, int((mb * 1e6 / 4 / 2 / 0.5) ** 0.5))  # two square layers at 50%: about `mb` on disk
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    torch.manual_seed(0)
    hf_sms.apply_masks(model, hf_sms.compute_masks(model, 0.5))
    return hf_sms.save_sparse(model, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mb", type=float, default=1.0, help="size of the inspected folder on disk")
    args = parser.parse_args()
    folder = _folder(tempfile.mkdtemp() + "/soup", args.mb)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 1e6
    cli = [shutil.which("hf-sms")] if shutil.which("hf-sms") else [sys.executable, "-m", "hf_sms.cli"]
    commands = {
        "hf-sms --help": [*cli, "--help"],
        f"hf-sms inspect ({size:.2f} MB folder)": [*cli, "inspect", folder],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "python -c 'import hf_sms.checkpoint.reader' (torch reader)": [
            sys.executable,
            "-c",
            "import hf_sms.checkpoint.reader",
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, argv in commands.items():
            start = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
    print(f"{'command':<62} {'median s':>8} {'slowest s':>9}")
    for name, seconds in times.items():
        print(f"{name:<62} {statistics.median(seconds):>8.2f} {max(seconds):>9.2f}")
    inspect = statistics.median(times[f"hf-sms inspect ({size:.2f} MB folder)"])
    torch_only = statistics.median(times["python -c 'import torch'"])
    print(f"inspect / import torch alone: {inspect / torch_only:.2f}x")


if __name__ == "__main__":
    main()
