"""The paper's Table 1 protocol at small scale, offline: digits, 3 phases, ALLR, m in {3, 5}, >= 3 seeds.

    python benchmarks/reproduce_table1.py --output-dir runs/table1 --targets 0.98 --doc runs/table1/report.md
    python benchmarks/reproduce_table1.py --output-dir runs/offset --targets 0.98 --replicas 3 \\
        --merge-methods uniform --seeding offset --doc runs/offset/report.md

For each seed a ResNet-style CNN is pretrained densely once; from it, for each goal sparsity and m, SMS
(one trajectory per merge method), IMP, IMP_mx and IMP-RePrune run with the same retraining budget per
replica. Test accuracy (%) is reported as mean ± std over seeds; validation (10% of train, fixed seed) is
the only split used for selection. ``--seeding offset`` reproduces the seeding hf-sms had before replicas
were made independent (replica i: seed + i, accelerate's sampler seeding epoch e with seed + e), to
measure what that cost.
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from transformers import Trainer

import hf_sms.loop.sms
from hf_sms import SparseSoupConfig, SparseSoupTrainer
from hf_sms.cli.demo import DIGITS_SETTINGS, DigitsResNet, pretrain
from hf_sms.data import load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.loop.sms import SparseModelSoup
from hf_sms.records.results import format_table, metric_table, save_results

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--output-dir", default="runs/table1")
p.add_argument("--doc", default=None, help="Write the markdown report here.")
p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
p.add_argument("--targets", type=float, nargs="+", default=[0.9, 0.98])
p.add_argument("--replicas", type=int, nargs="+", default=[3, 5])
p.add_argument("--merge-methods", nargs="+", default=["uniform", "greedy"])
p.add_argument(
    "--soup-options", default=None, help='soup methods\' options as JSON, e.g. \'{"ties": {"density": 0.5}}\''
)
p.add_argument("--baselines", nargs="*", default=["imp", "imp_mx", "imp_reprune"])
p.add_argument("--seeding", choices=["independent", "offset"], default="independent")
p.add_argument("--no-augment", action="store_true", help="No random shifts: the data order is the only randomness.")
p.add_argument("--width", type=int, default=32)
p.add_argument("--pretrain-epochs", type=float, default=30)
p.add_argument("--retrain-epochs", type=float, default=8)
p.add_argument("--lr", type=float, default=0.1)
cli = p.parse_args()
torch.set_num_threads(1)

if cli.seeding == "offset":  # the old behaviour, for the before/after comparison only
    replica_overrides = SparseSoupConfig.replica_overrides

    def offset_overrides(self, phase=0):
        return [{**h, "seed": self.seed + i} for i, h in enumerate(replica_overrides(self, phase))]

    SparseSoupConfig.replica_overrides = offset_overrides
    hf_sms.loop.sms.derive_seed = lambda seed, name, phase, i: seed + i
    SparseSoupTrainer._get_train_sampler = Trainer._get_train_sampler

accuracy = ClassificationAccuracy()
runs: dict[tuple[float, int], list[dict]] = {}
t0 = time.time()
for seed in cli.seeds:
    torch.manual_seed(seed)
    train, val, test = load_digits_splits(seed=seed, augment=not cli.no_augment)
    pre_dir = os.path.join(cli.output_dir, f"pretrain-{seed}")
    dense = pretrain(DigitsResNet(cli.width), train, pre_dir, cli.pretrain_epochs, cli.lr, seed)
    print(f"seed {seed}: dense test accuracy {accuracy(dense, test):.2f}%", flush=True)
    for target in cli.targets:
        for m in cli.replicas:
            args = SparseSoupConfig(
                output_dir=os.path.join(cli.output_dir, f"s{target}-m{m}-seed{seed}"),
                target_sparsity=target,
                n_phases=3,
                num_replicas=m,
                pretrain_epochs=cli.pretrain_epochs,
                pretrain_learning_rate=cli.lr,
                learning_rate=cli.lr,
                num_train_epochs=cli.retrain_epochs,
                seed=seed,
                **DIGITS_SETTINGS,
                merge_methods=cli.merge_methods,
                soup_options=cli.soup_options,
                baselines=cli.baselines,
            )
            runner = SparseModelSoup(copy.deepcopy(dense), args, train, accuracy, eval_dataset=val, test_dataset=test)
            runner.run()
            runs.setdefault((target, m), []).append(runner.results)
            print(f"[{time.time() - t0:.0f}s] target {target} m {m} seed {seed} done", flush=True)

save_results({f"{t}-{m}": r for (t, m), r in runs.items()}, os.path.join(cli.output_dir, "all_results.json"))


def mean_sd(values: list[float], signed: bool = True) -> str:
    mean = f"{statistics.mean(values):+.2f}" if signed else f"{statistics.mean(values):.2f}"
    return mean + (f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else "")


def diversity_table(results: list[dict]) -> list[str]:
    """Per phase, mean ± std over seeds of the differences that decide whether a soup can gain."""
    first = cli.merge_methods[0]
    lines = [
        "| phase | disagreement on val (%) | pairwise L2 | best − mean cand. | ensemble − best | "
        f"SMS ({first}) − IMP | SMS ({first}) − IMP_mx |",
        "|---|---|---|---|---|---|---|",
    ]
    table = metric_table(results, "test")
    pairs = [("best_candidate", "mean_candidate"), ("ensemble", "best_candidate")]
    pairs += [(f"sms_{first}", "imp"), (f"sms_{first}", "imp_mx")]
    for p in range(len(results[0]["phases"])):
        diags = [[d for d in r["sms"] if d["trajectory"] == first][p] for r in results]
        cells = [
            mean_sd([d["disagreement_val"] for d in diags], signed=False),
            mean_sd([statistics.mean(d["pairwise_l2"]) if d["pairwise_l2"] else 0.0 for d in diags], signed=False),
        ]
        for a, b in pairs:
            ok = a in table and b in table
            cells.append(mean_sd([x - y for x, y in zip(table[a][p], table[b][p])]) if ok else "-")
        lines.append(f"| {p + 1} | " + " | ".join(cells) + " |")
    return lines


command = "python benchmarks/reproduce_table1.py " + " ".join(sys.argv[1:])
lines = [
    f"Command: `{command}` ({time.time() - t0:.0f} s, one CPU thread). Seeding: {cli.seeding}.",
    "",
    f"ResNet-style CNN (width {cli.width}) pretrained {cli.pretrain_epochs:g} epochs on scikit-learn's digits; 3 "
    f"phases, ALLR, {cli.retrain_epochs:g} retraining epochs per phase and replica (IMP_mx: the sum over the m "
    f"replicas), global magnitude pruning, BatchNorm recalibrated after every merge; seeds {cli.seeds}; "
    f"{'no augmentation' if cli.no_augment else 'random-shift augmentation'}. Test "
    "accuracy (%), mean ± std over seeds; differences are test points, paired by seed.",
    "",
]
for (target, m), results in runs.items():
    lines += [f"### Goal sparsity {100 * target:g}%, m = {m}", "", format_table(results, "test"), ""]
    lines += ["Diversity and gains per phase (test points; disagreement and L2 on the SMS candidates):", ""]
    lines += [*diversity_table(results), ""]
report = "\n".join(lines)
print(report)
if cli.doc:
    os.makedirs(os.path.dirname(os.path.abspath(cli.doc)), exist_ok=True)
    with open(cli.doc, "w") as f:
        f.write(report + "\n")
