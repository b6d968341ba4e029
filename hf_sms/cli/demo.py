"""``hf-sms demo``: SMS vs IMP on real data, offline, on a laptop CPU in minutes.

Pretrains a small ResNet-style CNN on scikit-learn's 8x8 digits, then runs SMS (m=3, 3 phases to
98% sparsity) and the IMP and IMP_3x baselines from the same pretrained model; prints the Table-1
shaped table and writes results.json, results.png and the final soup into ``--output-dir``.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from ..checkpoint.constants import RESULTS_FILE
from ..data import load_digits_splits
from ..evaluation.metrics import ClassificationAccuracy
from ..loop.sms import SparseModelSoup
from ..records.results import format_table, plot_results, save_results, speedup_report
from ..training.config import SparseSoupConfig
from ..training.trainer import cross_entropy_loss


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + self.skip(x))


class DigitsResNet(nn.Module):
    """A ResNet-style CNN for 1x8x8 images: stem, two stages of basic blocks, linear head."""

    def __init__(self, width: int = 32, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = _Block(width, width, 1)
        self.layer2 = _Block(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


def pretrain(model: nn.Module, train, output_dir: str, epochs: float, lr: float, seed: int) -> nn.Module:
    """Dense pretraining as the paper's code does it: SGD with Nesterov momentum on every parameter, weight
    decay 5e-4, no gradient clipping, linear LR decay (its peak LR and length feed ALLR)."""
    args = TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=epochs,
        per_device_train_batch_size=64,
        lr_scheduler_type="linear",
        max_grad_norm=0.0,
        seed=seed,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=50,
        disable_tqdm=True,
        label_names=["labels"],
    )
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    Trainer(model, args, train_dataset=train, compute_loss_func=cross_entropy_loss, optimizers=(sgd, None)).train()
    return model


# The demo's retraining (and benchmarks/reproduce_table1.py's): ALLR, SGD with Nesterov momentum, the decay of its
# pretraining, on the CPU
DIGITS_SETTINGS = {
    "retrain_schedule": "allr",
    "per_device_train_batch_size": 64,
    "optim": "sgd",
    "optim_args": "momentum=0.9,nesterov=true",
    "weight_decay": 5e-4,
    "use_cpu": True,
    "disable_tqdm": True,
    "report_to": "none",
}


def run_demo(output_dir: str, quick: bool = False, seed: int = 0, threads: int = 1) -> dict:
    """Pretrain, then SMS (m=3, 3 phases to 98%) beside IMP and IMP_3x; ``quick``: a smaller setting for CI.
    ``threads``: torch's intra-op threads. One by default: the demo's layers are too small to gain from more, and
    two threads on a two-core machine that runs anything else wait on each other (measured: docs/benchmarks.md)."""
    if threads < 1:
        raise ValueError(f"threads={threads}: give 1 or more")
    torch.set_num_threads(threads)
    t0 = time.time()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("hf_sms").setLevel(logging.INFO)  # one line per phase and replica
    torch.manual_seed(seed)
    train, val, test = load_digits_splits(seed=seed)
    pre_epochs, retrain_epochs, width, lr = (6, 2, 16, 0.1) if quick else (30, 8, 32, 0.1)
    with tempfile.TemporaryDirectory() as scratch:  # pretraining keeps nothing on disk
        model = pretrain(DigitsResNet(width), train, scratch, pre_epochs, lr, seed)
    accuracy = ClassificationAccuracy()
    args = SparseSoupConfig(
        output_dir=output_dir,
        target_sparsity=0.98,  # at 90% digits is saturated: every method is within a test image or two
        n_phases=2 if quick else 3,
        num_replicas=2 if quick else 3,
        pretrain_epochs=pre_epochs,
        pretrain_learning_rate=lr,
        learning_rate=lr,
        num_train_epochs=retrain_epochs,
        seed=seed,
        baselines=["imp", "imp_mx"],
        **DIGITS_SETTINGS,
    )
    runner = SparseModelSoup(model, args, train, accuracy, eval_dataset=val, test_dataset=test)
    runner.run()
    results = {**runner.results, "seconds": round(time.time() - t0, 1), "threads": threads, "quick": quick}
    save_results(results, os.path.join(output_dir, RESULTS_FILE))
    plot_results([results], os.path.join(output_dir, "results.png"), ylabel="accuracy (%)")
    print("\nTest accuracy (%) after each phase:\n" + format_table([results], "test"))
    # A tiny CNN on 8x8 images: layers this small are overhead-bound, so the sparse runtime may not win here;
    # the speedup report says what it gives (docs/benchmarks.md has models where it does).
    print("\n" + speedup_report([results]))
    took = f"{results['seconds']:.0f} s on {threads} thread{'s' if threads > 1 else ''}"
    print(f"\n[hf-sms] wrote {output_dir}/results.json, results.png, final_soup/ in {took}")
    return results


def command(args) -> int:
    """``hf-sms demo`` (its arguments: :mod:`hf_sms.cli`)."""
    run_demo(args.output_dir, args.quick, args.seed, args.threads)
    return 0
