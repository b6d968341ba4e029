"""Retraining with SparseSoupTrainer vs a plain PyTorch loop of the same settings, m replicas each, on digits.

    python benchmarks/trainer_vs_plain_loop.py

One pruned start (a ResNet-style CNN pretrained densely, magnitude-pruned to --sparsity), m replica seeds
derived as the SMS loop derives them. Each replica is retrained (SGD, Nesterov momentum 0.9, weight decay
5e-4, ALLR, batch 64, random-shift augmentation) by

- ``plain``: a 30-line loop: torch.optim.SGD(model.parameters()), the same sampler and LR function, masks
  re-applied after every step (the paper's code does the same);
- ``trainer``: SparseSoupTrainer with hf-sms' defaults (the paper's settings);
- ``trainer, HF defaults``: SparseSoupTrainer with TrainingArguments' own defaults the paper never used
  (gradient clipping at max_grad_norm=1.0, no weight decay on biases and norms).

Printed per variant: mean test accuracy of the replicas, their prediction disagreement on test, mean pairwise
L2 between replicas, mean L2 moved from the pruned start, and the L2 between a replica and the plain loop's
replica of the same seed (0 means the same run).
"""

import argparse
import copy
import itertools
import math
import time

import torch
import torch.nn.functional as F
from transformers import set_seed

from hf_sms import SparseSoupConfig, SparseSoupTrainer, prune
from hf_sms.cli.demo import DigitsResNet, pretrain
from hf_sms.data import load_digits_splits
from hf_sms.evaluation import predict_proba
from hf_sms.pruning.enforcement import MaskEnforcer
from hf_sms.seeding import EpochShuffleSampler, derive_seed
from hf_sms.training.schedules import RETRAIN_SCHEDULES, ScheduleContext, allr_start_lr

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--sparsity", type=float, default=0.9)
p.add_argument("--replicas", type=int, default=3)
p.add_argument("--pretrain-epochs", type=float, default=30)
p.add_argument("--retrain-epochs", type=int, default=8)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--width", type=int, default=32)
p.add_argument("--seed", type=int, default=0)
cli = p.parse_args()
torch.set_num_threads(1)
BATCH, WD = 64, 5e-4


def plain_loop(start, step, seed: int, train) -> torch.nn.Module:
    """The reference: what the paper's code does for one replica, written out."""
    model = copy.deepcopy(start).train()
    set_seed(seed)  # as Trainer does: python, numpy and torch generators (augmentation draws from torch's)
    sampler = EpochShuffleSampler(len(train), seed)
    opt = torch.optim.SGD(model.parameters(), lr=cli.lr, momentum=0.9, nesterov=True, weight_decay=WD)
    enforcer = MaskEnforcer(model, step.masks)
    total = math.ceil(len(train) / BATCH) * cli.retrain_epochs
    ratio = cli.retrain_epochs / cli.pretrain_epochs
    start_lr = allr_start_lr(step.norm_fraction, step.phase_fraction, cli.lr, ratio)
    ctx = ScheduleContext(total, cli.lr, 0.0, "linear", ratio, start_lr)
    loader = torch.utils.data.DataLoader(train, BATCH, sampler=sampler)
    k = 0
    for epoch in range(cli.retrain_epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            for group in opt.param_groups:
                group["lr"] = RETRAIN_SCHEDULES["allr"](k, ctx)
            loss = F.cross_entropy(model(batch["x"]), batch["labels"])
            opt.zero_grad()
            loss.backward()
            enforcer.mask_gradients()
            opt.step()
            enforcer.after_step(opt)
            k += 1
    return model


def trainer_run(start, step, seed: int, train, **overrides) -> torch.nn.Module:
    model = copy.deepcopy(start)
    args = SparseSoupConfig(
        output_dir="/tmp/hf-sms-plain-vs-trainer",
        retrain_schedule="allr",
        pretrain_epochs=cli.pretrain_epochs,
        learning_rate=cli.lr,
        num_train_epochs=cli.retrain_epochs,
        per_device_train_batch_size=BATCH,
        optim="sgd",
        optim_args="momentum=0.9,nesterov=true",
        weight_decay=WD,
        seed=seed,
        use_cpu=True,
        disable_tqdm=True,
        report_to="none",
        logging_steps=10_000,
        **overrides,
    )
    SparseSoupTrainer(model, args, masks=step, train_dataset=train).train()
    return model


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def l2(a, b) -> float:
    return float(torch.linalg.vector_norm(flat(a) - flat(b)))


t0 = time.time()
train, val, test = load_digits_splits(seed=cli.seed)
torch.manual_seed(cli.seed)
dense = pretrain(DigitsResNet(cli.width), train, "/tmp/hf-sms-plain-vs-trainer-pre", cli.pretrain_epochs, cli.lr, 0)
start = copy.deepcopy(dense)
step = prune(start, cli.sparsity)
seeds = [derive_seed(cli.seed, "sms", 0, i) for i in range(cli.replicas)]
variants = {
    "plain": lambda s: plain_loop(start, step, s, train),
    "trainer": lambda s: trainer_run(start, step, s, train),
    "trainer, HF defaults": lambda s: trainer_run(start, step, s, train, max_grad_norm=1.0, decay_all_parameters=False),
}
models = {name: [fn(s) for s in seeds] for name, fn in variants.items()}

print(
    f"sparsity {cli.sparsity}, m={cli.replicas}, {cli.retrain_epochs} epochs, pretrained {cli.pretrain_epochs} epochs"
)
print("| variant | test acc (mean) | disagreement on test (%) | pairwise L2 | L2 moved from start | L2 to plain |")
print("|---|---|---|---|---|---|")
for name, reps in models.items():
    probs = [predict_proba(m, test)[0] for m in reps]
    labels = predict_proba(reps[0], test)[1]
    acc = sum(100 * float((pr.argmax(-1) == labels).float().mean()) for pr in probs) / len(reps)
    pairs = list(itertools.combinations(range(len(reps)), 2))
    disagree = sum(100 * float((probs[i].argmax(-1) != probs[j].argmax(-1)).float().mean()) for i, j in pairs)
    pair_l2 = sum(l2(reps[i], reps[j]) for i, j in pairs) / len(pairs)
    moved = sum(l2(m, start) for m in reps) / len(reps)
    to_plain = sum(l2(m, ref) for m, ref in zip(reps, models["plain"])) / len(reps)
    print(f"| {name} | {acc:.2f} | {disagree / len(pairs):.2f} | {pair_l2:.3f} | {moved:.3f} | {to_plain:.2e} |")
print(f"({time.time() - t0:.0f} s)")
