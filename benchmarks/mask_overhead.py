"""Seconds per training step: SparseSoupTrainer vs plain transformers Trainer, same model, data and optimizer.

The extra work of SparseSoupTrainer per step is masking the gradients before clipping, masking the weights
and the optimizer state after the step, and computing the sparsity at logging steps. Both trainers start
from the same pruned model (the plain Trainer lets pruned weights revive; it is only the timing baseline).
Runs are interleaved (A B, then B A, ...) so drift in machine speed hits both; each run's first steps are
dropped as warm-up and the per-step times are compared by their medians. Target: ratio <= 1.05 (goal 1.02).

Denormal floats are flushed to zero by default: a pruned network has layers with tiny gradients whose
squares (Adam's second moment) are denormal, which makes CPU arithmetic slow for any trainer; that is a
cost of sparse numerics on CPU, not of mask bookkeeping (``--keep-denormals`` measures it too).

    python benchmarks/mask_overhead.py       # half-width timm ResNet-18, the paper's CIFAR SGD setting, CPU
    python benchmarks/mask_overhead.py --batch-size 32 --rounds 10 --steps 8   # 4x less compute per mask pass
    python benchmarks/mask_overhead.py --optim adamw_torch --optim-args ""    # AdamW: two moments to mask
    python benchmarks/mask_overhead.py --channels 64,128,256,512 --rounds 4   # full-width ResNet-18
    python benchmarks/mask_overhead.py --model t5      # a 4+4 layer T5 (d_model 256) on random bytes

The overhead is memory traffic proportional to the number of prunable weights (three passes per step with
SGD+momentum: gradients, weights, momentum; four with AdamW), so it is largest where compute per weight is
small: small images, small batches. On a machine shared with other jobs those memory-bound passes slow down
more than the convolutions do, which raises the measured ratio. With AdamW on CPU there is a second cost
that is not bookkeeping: the second moment is exactly 0 at pruned weights and PyTorch's CPU ``sqrt`` is
~5x slower on zeros than on other values, so AdamW's own step gets slower on a masked model.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings

import torch
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from hf_sms import SparseSoupTrainer, apply_masks, compute_masks
from hf_sms.training.trainer import cross_entropy_loss


class StepTimer(TrainerCallback):
    """Time between consecutive optimizer steps (everything the training loop does per step), on two clocks.

    Wall time is what a user waits; this process's CPU time is less disturbed by other processes on a
    shared machine.
    """

    def __init__(self):
        self.ends: list[tuple[float, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.ends = [(time.perf_counter(), time.process_time())]

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append((time.perf_counter(), time.process_time()))

    def step_times(self, warmup: int, clock: int) -> list[float]:
        return [b[clock] - a[clock] for a, b in zip(self.ends, self.ends[1:])][warmup:]


def build(name: str, batch_size: int, image_size: int, seq_len: int, channels: tuple[int, ...]):
    """(model, dataset, is_transformers_model) with random but fixed data; nothing is downloaded."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n = batch_size * 4
    if name == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=384, d_model=256, d_ff=1024, d_kv=32, num_heads=8, num_layers=4, decoder_start_token_id=0
        )
        ids = torch.randint(3, 384, (n, seq_len), generator=g)
        data = [
            {"input_ids": ids[i], "attention_mask": torch.ones(seq_len, dtype=torch.long), "labels": ids[i]}
            for i in range(n)
        ]
        return T5ForConditionalGeneration(config), data, True
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=10, channels=channels)
    x = torch.randn(n, 3, image_size, image_size, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return model, [{"x": x[i], "labels": y[i]} for i in range(n)], False


def run(kind: str, base, masks, data, is_hf: bool, opts) -> tuple[list[float], list[float]]:
    model = copy.deepcopy(base)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            report_to="none",
            use_cpu=opts.device == "cpu",
            bf16=opts.bf16,
            disable_tqdm=True,
            save_strategy="no",
            logging_steps=opts.logging_steps,
            max_steps=opts.warmup + opts.steps,
            per_device_train_batch_size=opts.batch_size,
            optim=opts.optim,
            optim_args=opts.optim_args or None,
            learning_rate=opts.lr,
            weight_decay=opts.weight_decay,
            max_grad_norm=1.0,
            seed=0,
            dataloader_num_workers=0,
            label_names=None if is_hf else ["labels"],
        )
        extra = {} if is_hf else {"compute_loss_func": cross_entropy_loss}
        if kind == "sparse":
            trainer = SparseSoupTrainer(model, args, masks=masks, train_dataset=data, callbacks=[timer], **extra)
        else:
            trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer], **extra)
        trainer.remove_callback(PrinterCallback)  # keep the output to the timings
        trainer.train()
    if kind == "sparse":  # masks are exact after every step, autocast or not
        params = dict(model.named_parameters())
        revived = sum(int((params[n].detach()[~m.to(params[n].device)] != 0).sum()) for n, m in masks.items())
        if revived:
            raise AssertionError(f"{revived} pruned weights are nonzero after {kind} training")
    return timer.step_times(opts.warmup, 0), timer.step_times(opts.warmup, 1)


def bare(opts, base, masks, data) -> None:
    """A bare training loop three ways, interleaved: no masks, hf-sms's masking policy (ExactMasking: masked
    gradients, and the after-step passes only where the optimizer needs them), and torch.nn.utils.prune's
    reparametrisation (weight = weight_orig * mask in a forward pre-hook)."""
    from torch.nn.utils import prune as torch_prune

    from hf_sms.pruning import ExactMasking, MaskEnforcer

    x = torch.stack([d["x"] for d in data[: opts.batch_size]])
    y = torch.stack([torch.as_tensor(d["labels"]) for d in data[: opts.batch_size]])

    def make(kind):
        model = copy.deepcopy(base).train()
        policy = None
        if kind == "torch_prune":
            for name, mask in masks.items():
                module, attr = name.rsplit(".", 1)
                torch_prune.custom_from_mask(model.get_submodule(module), attr, mask)
        optimizer = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
        if kind == "hf_sms":
            policy = ExactMasking()
            policy.bind(MaskEnforcer(model, masks))
            policy.start(optimizer)
        return model, optimizer, policy

    def step(model, optimizer, policy):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if policy is not None:
            policy.before_step()
        optimizer.step()
        if policy is not None:
            policy.after_step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    kinds = ("plain", "hf_sms", "torch_prune")
    runs = {k: make(k) for k in kinds}
    times = {k: [] for k in kinds}
    for r in range(opts.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            for i in range(opts.warmup + opts.steps):
                start = time.perf_counter()
                step(*runs[kind])
                if i >= opts.warmup:
                    times[kind].append(time.perf_counter() - start)
    plain = statistics.median(times["plain"])
    for kind in kinds:
        t = statistics.median(times[kind])
        print(f"bare loop {kind:11s}: {t * 1e3:7.2f} ms/step, {t / plain:.3f}x plain")
    model, _, policy = runs["hf_sms"]
    params = dict(model.named_parameters())
    assert all(int((params[n].detach()[~m] != 0).sum()) == 0 for n, m in masks.items()), "hf-sms mask broken"
    torch.nn.functional.cross_entropy(model(x), y).backward()  # gradients to mask
    alone = []
    for _ in range(opts.rounds * opts.steps):
        start = time.perf_counter()
        policy.before_step()  # the masking a step does for SGD/Adam/AdamW: one pass over the gradients
        alone.append(time.perf_counter() - start)
    t = statistics.median(alone)
    print(f"hf-sms masking alone: {t * 1e3:.2f} ms/step, {t / plain:.1%} of a plain step")
    print("target: hf-sms <= 1.03x plain and ahead of torch.nn.utils.prune")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18", help="a timm model name, or 't5' for a 4+4 layer T5")
    p.add_argument("--batch-size", type=int, default=128, help="128: the paper's CIFAR batch size")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--channels", default="32,64,128,256", help="stage widths of the timm ResNet")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--optim", default="sgd", help="a TrainingArguments optim name")
    p.add_argument("--optim-args", default="momentum=0.9,nesterov=true", help="TrainingArguments.optim_args")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    p.add_argument("--rounds", type=int, default=8, help="A/B pairs")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the Trainer's GPU")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TrainingArguments.bf16)")
    p.add_argument("--bare", action="store_true", help="a bare loop: plain vs hf-sms's policy vs torch.nn.utils.prune")
    p.add_argument("--keep-denormals", action="store_true", help="do not flush denormal floats to zero")
    opts = p.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.set_flush_denormal(not opts.keep_denormals)
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()

    channels = tuple(int(c) for c in opts.channels.split(","))
    base, data, is_hf = build(opts.model, opts.batch_size, opts.image_size, opts.seq_len, channels)
    masks = compute_masks(base, opts.sparsity)
    apply_masks(base, masks)  # both trainers start from the same pruned weights
    n_params = sum(p.numel() for p in base.parameters())
    load, cores = os.getloadavg()[0], os.cpu_count()
    if load > 0.5 * cores:
        print(f"warning: load average {load:.1f} on {cores} cores; with other jobs running, try --threads 1")
    print(
        f"model={opts.model} params={n_params / 1e6:.2f}M sparsity={opts.sparsity} optim={opts.optim} "
        f"batch={opts.batch_size} threads={torch.get_num_threads()} steps/run={opts.steps} rounds={opts.rounds} "
        f"flush_denormal={not opts.keep_denormals} device={opts.device} bf16={opts.bf16}"
    )
    if opts.bare:
        return bare(opts, base, masks, data)
    # times[clock][kind]: per-step seconds of all runs; medians[clock][kind]: one median per run
    times = {c: {"plain": [], "sparse": []} for c in ("wall", "cpu")}
    medians = {c: {"plain": [], "sparse": []} for c in ("wall", "cpu")}
    t0 = time.perf_counter()
    for r in range(opts.rounds):
        order = ("plain", "sparse") if r % 2 == 0 else ("sparse", "plain")
        for kind in order:
            for clock, t in zip(("wall", "cpu"), run(kind, base, masks, data, is_hf, opts)):
                times[clock][kind] += t
                medians[clock][kind].append(statistics.median(t))
        a, b = medians["wall"]["plain"][-1], medians["wall"]["sparse"][-1]
        c, d = medians["cpu"]["plain"][-1], medians["cpu"]["sparse"][-1]
        print(
            f"round {r + 1}: wall plain {a * 1e3:.1f} / sparse {b * 1e3:.1f} ms/step ({b / a:.3f}); "
            f"cpu plain {c * 1e3:.1f} / sparse {d * 1e3:.1f} ms/step ({d / c:.3f})"
        )
    for clock in ("wall", "cpu"):
        plain, sparse = statistics.median(times[clock]["plain"]), statistics.median(times[clock]["sparse"])
        pairs = sorted(s / p for s, p in zip(medians[clock]["sparse"], medians[clock]["plain"]))
        q1, q3 = pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]
        mean_ratio = statistics.mean(times[clock]["sparse"]) / statistics.mean(times[clock]["plain"])
        print(
            f"{clock}: median s/step plain {plain:.4f}, sparse {sparse:.4f}; ratio sparse/plain "
            f"{sparse / plain:.3f} (median of all steps), {statistics.median(pairs):.3f} (median of per-round "
            f"ratios, quartiles {q1:.3f}-{q3:.3f}), {mean_ratio:.3f} (means, logging steps included)"
        )
    print(f"total {time.perf_counter() - t0:.0f} s; target ratio <= 1.05, goal 1.02; masks exact after every run")


if __name__ == "__main__":
    main()
