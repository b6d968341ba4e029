"""The paper's Table 1 protocol at small scale, offline: digits, 3 phases, ALLR, m in {3, 5}, >= 3 seeds.

    python benchmarks/reproduce_table1.py --output-dir runs/table1 --doc docs/results.md

For each seed a ResNet-style CNN is pretrained densely once; from it, for each goal sparsity and m,
SMS (uniform; greedy on the same candidates), IMP, IMP_mx and IMP-RePrune run with the same
retraining budget per replica. Test accuracy (%) is reported as mean ± std over seeds; validation
(10% of train, fixed seed) is the only split used for selection.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

from hf_sms import SparseSoupConfig
from hf_sms.data import load_digits_splits
from hf_sms.demo import DigitsResNet, pretrain
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.results import format_table, metric_table, save_results
from hf_sms.sms import SparseModelSoup

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--output-dir", default="runs/table1")
p.add_argument("--doc", default=None, help="Write the markdown report here (e.g. docs/results.md).")
p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
p.add_argument("--targets", type=float, nargs="+", default=[0.9, 0.98])
p.add_argument("--replicas", type=int, nargs="+", default=[3, 5])
p.add_argument("--width", type=int, default=32)
p.add_argument("--pretrain-epochs", type=float, default=30)
p.add_argument("--retrain-epochs", type=float, default=8)
p.add_argument("--lr", type=float, default=0.1)
cli = p.parse_args()

accuracy = ClassificationAccuracy()
runs: dict[tuple[float, int], list[dict]] = {}
t0 = time.time()
for seed in cli.seeds:
    torch.manual_seed(seed)
    train, val, test = load_digits_splits(seed=seed)
    dense = pretrain(DigitsResNet(cli.width), train, os.path.join(cli.output_dir, f"pretrain-{seed}"),
                     cli.pretrain_epochs, cli.lr, seed)  # fmt: skip
    print(f"seed {seed}: dense test accuracy {accuracy(dense, test):.2f}%", flush=True)
    for target in cli.targets:
        for m in cli.replicas:
            args = SparseSoupConfig(
                output_dir=os.path.join(cli.output_dir, f"s{target}-m{m}-seed{seed}"), target_sparsity=target,
                n_phases=3, num_replicas=m, retrain_schedule="allr", pretrain_epochs=cli.pretrain_epochs,
                pretrain_learning_rate=cli.lr, learning_rate=cli.lr, num_train_epochs=cli.retrain_epochs,
                per_device_train_batch_size=64, optim="sgd", optim_args="momentum=0.9,nesterov=true",
                weight_decay=5e-4, seed=seed, use_cpu=True, disable_tqdm=True,
                baselines=["imp", "imp_mx", "imp_reprune"],
            )  # fmt: skip
            runner = SparseModelSoup(copy.deepcopy(dense), args, train, accuracy, eval_dataset=val, test_dataset=test)
            runner.run()
            runs.setdefault((target, m), []).append(runner.results)
            print(f"[{time.time() - t0:.0f}s] target {target} m {m} seed {seed} done", flush=True)

save_results({f"{t}-{m}": r for (t, m), r in runs.items()}, os.path.join(cli.output_dir, "all_results.json"))
command = "python benchmarks/reproduce_table1.py " + " ".join(sys.argv[1:])
lines = [
    "# Table 1 at small scale (digits)",
    "",
    f"Command: `{command}` ({time.time() - t0:.0f} s on this machine's CPU).",
    "",
    f"ResNet-style CNN (width {cli.width}) pretrained {cli.pretrain_epochs:g} epochs on scikit-learn's digits; "
    "3 phases, "
    f"ALLR, {cli.retrain_epochs:g} retraining epochs per phase and replica (IMP_mx: m times as long), global magnitude "
    f"pruning, BatchNorm recalibrated after every merge; seeds {cli.seeds}. Test accuracy (%), mean ± std over seeds.",
    "",
]
verdicts = []
for (target, m), results in runs.items():
    lines += [f"## Goal sparsity {100 * target:g}%, m = {m}", "", format_table(results, "test"), ""]
    final = {k: statistics.mean(v[-1]) for k, v in metric_table(results, "test").items() if v[-1]}
    for rival in ("best_candidate", "imp_mx", "imp"):
        diff = final["sms_uniform"] - final[rival]
        verdicts.append(f"- {100 * target:g}%, m={m}: SMS (uniform) {'beats' if diff > 0 else 'does not beat'} "
                        f"{rival} at the last phase ({diff:+.2f} points)")  # fmt: skip
lines += ["## Verdicts (last phase, mean over seeds)", "", *verdicts, ""]
report = "\n".join(lines)
print(report)
if cli.doc:
    with open(cli.doc, "w") as f:
        f.write(report)
    with open(os.path.join(cli.output_dir, "report.json"), "w") as f:
        json.dump({"command": command, "verdicts": verdicts}, f, indent=2)
