"""BatchNorm recalibration on 1, 2 and 3 processes of one device gives the same statistics (issue 37 item 2): a
WRN-style block (dropout 0.3 before a BatchNorm, as recipes/cifar.py) over randomly shifted digits, read by 2 loader
workers per process; the CUDA half of the CPU test in tests/test_loop_parallel.py. Prints the largest difference of
any running statistic from one process's (0 expected: the same batches, the same draws, sums in float64).

    python benchmarks/batchnorm_processes.py --device cuda   # the processes share GPU 0 (gloo gathers the sums)
    python benchmarks/batchnorm_processes.py                 # CPU
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.drop = nn.Conv2d(1, 32, 3, padding=1), nn.Dropout(0.3)
        self.bn, self.conv2 = nn.BatchNorm2d(32), nn.Conv2d(32, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)

    def forward(self, x):
        return self.bn2(self.conv2(torch.relu(self.bn(self.drop(self.conv1(x))))))


def worker(out: Path, device: str) -> None:
    from hf_sms.data import load_digits_splits
    from hf_sms.evaluation.sharded import recalibrate_shared
    from hf_sms.loop.distributed import ReplicaWorld

    world = ReplicaWorld(num_replicas=1, cpu=True)  # gloo: the sums travel as CPU objects
    torch.manual_seed(0)
    model = Block().to(device)
    torch.manual_seed(11 + world.rank)  # each process's own generators: the pass must not depend on them
    train, _, _ = load_digits_splits(seed=0)
    recalibrate_shared(model, train, 32, world, seed=3, max_batches=23, loader_kwargs={"num_workers": 2})
    stats = {k: v.double().cpu().tolist() for k, v in model.state_dict().items() if "running" in k}
    (out / f"rank{world.rank}.json").write_text(json.dumps(stats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.device)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2, 3):
            out = Path(tmp, str(n))
            out.mkdir()
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
            cmd = [*(launch if n > 1 else [sys.executable]), __file__, "--device", args.device, "--worker", str(out)]
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            runs[n] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    one = runs[1][0]
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    for n in (2, 3):
        diff = max(abs(a - b) for r in runs[n] for k in one for a, b in zip(one[k], r[k]))
        print(f"{name}: {n} processes vs 1, largest running-statistic difference {diff:.3g}")


if __name__ == "__main__":
    main()
