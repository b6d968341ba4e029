"""The shape of the paper's Table 3 at small scale, offline: pruning during training with and without SMS, and
structured (filter) pruning with IMP vs SMS.

    python benchmarks/during_training.py --output-dir runs/during --doc runs/during/report.md

Part 1: a ResNet-style CNN trained from scratch on scikit-learn's digits for one budget of --epochs (SGD,
Nesterov momentum 0.9, weight decay 1e-4, linear LR from 0.1: the paper's setting for these methods), pruned
during training to each goal sparsity by GMP, DPF (--steps pruning steps) and BIMP (dense for 60% of the
budget, then 3 IMP cycles with ALLR), each plain (m = 1) and +SMS (m = --replicas copies per phase from
--sms-start of the budget on, uniform soup). Part 2: the CNN pretrained densely, then 3 phases of filter
pruning (Li et al. 2017, L2 norm, the same fraction of filters per conv layer) with ALLR: SMS (uniform,
m = 3) vs IMP. Test accuracy (%) and theoretical speedup, mean ± std over seeds.
"""

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch

from hf_sms import SparseModelSoup, SparseSoupConfig
from hf_sms.cli.demo import DigitsResNet, pretrain
from hf_sms.data import load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.records.results import save_results

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--output-dir", default="runs/during")
p.add_argument("--doc", default=None)
p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
p.add_argument("--targets", type=float, nargs="+", default=[0.9, 0.98])
p.add_argument("--filter-fractions", type=float, nargs="+", default=[0.3, 0.5])
p.add_argument("--epochs", type=float, default=30)
p.add_argument("--steps", type=int, default=5, help="GMP/DPF pruning steps (the paper's grid: 5, 9, 18, 45)")
p.add_argument("--replicas", type=int, default=3)
p.add_argument("--sms-start", type=float, default=0.5, help="fraction of the budget before copies start")
p.add_argument("--width", type=int, default=32)
p.add_argument("--retrain-epochs", type=float, default=8, help="part 2: epochs per phase and replica")
p.add_argument("--report-only", action="store_true", help="rewrite the report from OUTPUT_DIR/all_results.json")
cli = p.parse_args()
torch.set_num_threads(1)
accuracy = ClassificationAccuracy()
COMMON = dict(
    per_device_train_batch_size=64,
    optim="sgd",
    optim_args="momentum=0.9,nesterov=true",
    learning_rate=0.1,
    use_cpu=True,
    disable_tqdm=True,
    report_to="none",
    logging_steps=10_000,
)


def final_row(results: dict, method: str) -> dict:
    rows = results["rows"]
    return (rows.get("sms_uniform") or rows[method])[-1]


def during(train, val, test, seed: int, method: str, target: float, m: int) -> dict:
    extra = {"bimp_pretrain_epochs": 0.6 * cli.epochs, "n_phases": 3, "retrain_schedule": "allr"}
    args = SparseSoupConfig(
        output_dir=os.path.join(cli.output_dir, f"{method}-m{m}-s{target}-seed{seed}"),
        pruning_method=method,
        target_sparsity=target,
        num_train_epochs=cli.epochs,
        num_replicas=m,
        pruning_steps=cli.steps,
        sms_start_epoch=cli.sms_start * cli.epochs,
        weight_decay=1e-4,
        seed=seed,
        **(extra if method == "bimp" else {}),
        **COMMON,
    )
    torch.manual_seed(seed)
    runner = SparseModelSoup(DigitsResNet(cli.width), args, train, accuracy, eval_dataset=val, test_dataset=test)
    runner.run()
    return final_row(runner.results, method)


def structured(dense, train, val, test, seed: int, fraction: float) -> dict:
    args = SparseSoupConfig(
        output_dir=os.path.join(cli.output_dir, f"filters-{fraction}-seed{seed}"),
        allocation="filter_l2",
        target_sparsity=fraction,
        n_phases=3,
        num_replicas=3,
        retrain_schedule="allr",
        pretrain_epochs=cli.epochs,
        num_train_epochs=cli.retrain_epochs,
        weight_decay=5e-4,
        seed=seed,
        baselines=["imp"],
        **COMMON,
    )
    runner = SparseModelSoup(copy.deepcopy(dense), args, train, accuracy, eval_dataset=val, test_dataset=test)
    runner.run()
    return {"sms": runner.results["rows"]["sms_uniform"][-1], "imp": runner.results["rows"]["imp"][-1]}


t0 = time.time()
table: dict[tuple, list[dict]] = {}
if cli.report_only:
    with open(os.path.join(cli.output_dir, "all_results.json")) as f:
        for key, rows in json.load(f).items():
            target, method, m = key.split("|")
            table[(float(target), method, int(m))] = rows
else:
    for seed in cli.seeds:
        train, val, test = load_digits_splits(seed=seed)
        for target in cli.targets:
            for method in ("gmp", "dpf", "bimp"):
                for m in (1, cli.replicas):
                    table.setdefault((target, method, m), []).append(during(train, val, test, seed, method, target, m))
                    print(f"[{time.time() - t0:.0f}s] {method} m={m} target {target} seed {seed} done", flush=True)
        torch.manual_seed(seed)
        dense = pretrain(
            DigitsResNet(cli.width), train, os.path.join(cli.output_dir, f"pre-{seed}"), cli.epochs, 0.1, seed
        )
        for fraction in cli.filter_fractions:
            for variant, row in structured(dense, train, val, test, seed, fraction).items():
                table.setdefault((fraction, f"filters-{variant}", 3 if variant == "sms" else 1), []).append(row)
            print(f"[{time.time() - t0:.0f}s] filters {fraction} seed {seed} done", flush=True)
    save_results({"|".join(map(str, k)): v for k, v in table.items()}, os.path.join(cli.output_dir, "all_results.json"))


def cell(rows: list[dict], key: str, digits: int = 2) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if any(math.isinf(v) for v in values):  # a whole layer pruned: no FLOPs left to count
        return "inf (" + ", ".join(f"{v:.{digits}f}" for v in values) + ")"
    sd = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.{digits}f}{sd}" if values else "-"


command = "python benchmarks/during_training.py " + " ".join(sys.argv[1:])
lines = [f"Command: `{command}` ({time.time() - t0:.0f} s, one CPU thread); seeds {cli.seeds}.", ""]
names = {"gmp": "GMP", "dpf": "DPF", "bimp": "BIMP"}
head = "| method | " + " | ".join(f"{100 * t:g}%: accuracy | speedup" for t in cli.targets) + " |"
lines += [head, "|---|" + "---|---|" * len(cli.targets)]
for method in ("bimp", "gmp", "dpf"):
    for m in (cli.replicas, 1):
        label = f"{names[method]}+SMS (m={m})" if m > 1 else names[method]
        cells = [
            f"{cell(table[(t, method, m)], 'test')} | {cell(table[(t, method, m)], 'speedup', 1)}" for t in cli.targets
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
lines += ["", "Structured (filter) pruning, 3 phases, ALLR, m = 3:", ""]
lines += ["| filters removed per conv | method | test accuracy | weights removed | speedup |", "|---|---|---|---|---|"]
for fraction in cli.filter_fractions:
    for variant, m in (("sms", 3), ("imp", 1)):
        rows = table[(fraction, f"filters-{variant}", m)]
        label = "SMS (uniform)" if variant == "sms" else "IMP"
        cells = [cell(rows, "test"), cell(rows, "sparsity", 3), cell(rows, "speedup", 2)]
        lines.append(f"| {100 * fraction:g}% | {label} | " + " | ".join(cells) + " |")
report = "\n".join(lines)
print(report)
if cli.doc:
    os.makedirs(os.path.dirname(os.path.abspath(cli.doc)), exist_ok=True)
    with open(cli.doc, "w") as f:
        f.write(report + "\n")
