"""A whole SMS phase of a LLaMA-2-7B-shaped model on this project's CPU machine (2 cores, 24 GiB), issue 53 item 5.

LLaMA-2-7B's shape (32 layers, hidden 4096, intermediate 11008, 32 heads, vocabulary 32,000: 6.74B parameters),
random weights built directly in bf16; one SMS phase at 50% (the decoder's linear layers, the causal-LM default)
with m = 3 MaskLoRA replicas and the run's defaults otherwise, ``--steps`` steps per replica at 2 x 64 tokens a step
(``--tokens``), a uniform soup, saved. Then plain peft LoRA (same rank, alpha and targets) trains the soup for the
same steps under transformers' ``Trainer``, for seconds per step side by side.

Printed: every hf-sms log line with the time and resident memory at that moment (the stages: build, prune, each
replica, soup, save), seconds per step of each replica and of peft LoRA, and the process's peak RSS (weights
included), which must stay under 24 GB here.

    python benchmarks/llm7b_phase.py                   # ~25 minutes on the 2-core CPU
    python benchmarks/llm7b_phase.py --layers 2        # the same with 2 decoder layers (a minute)
"""

import argparse
import logging
import os
import resource
import shutil
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_sms import SparseSoupConfig, run_sms
from hf_sms.adapters.replica import lora_targets
from hf_sms.evaluation.metrics import NegativePerplexity

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=32)
p.add_argument("--tokens", type=int, default=128, help="tokens a step (2 sequences)")
p.add_argument("--steps", type=int, default=2, help="steps per replica (and for peft LoRA)")
p.add_argument("--replicas", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--output-dir", default=None, help="where the run writes (default: a temporary folder, removed)")
cli = p.parse_args()
torch.set_num_threads(cli.threads)
t0 = time.perf_counter()


def rss() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20  # GiB


def peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is in KiB)


def show(what: str) -> None:
    print(f"{time.perf_counter() - t0:8.1f} s  rss {rss():6.2f} GiB  peak {peak():6.2f} GiB  {what}", flush=True)


class Timeline(logging.Handler):
    def emit(self, record):
        show(record.getMessage()[:150])


logging.getLogger("hf_sms").addHandler(Timeline())
logging.getLogger("hf_sms").setLevel(logging.INFO)  # hf-sms sets it only where no handler is installed


class Clock(TrainerCallback):
    """Seconds of every training step (forward, backward, optimizer step, mask hooks)."""

    def __init__(self):
        self.times = []

    def on_step_begin(self, *args, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.times.append(time.perf_counter() - self.start)


config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=cli.layers,
                     num_attention_heads=32, num_key_value_heads=32, pad_token_id=0)  # fmt: skip
show("start")
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)  # built in bf16: an fp32 build would need twice the memory
model = LlamaForCausalLM(config)
torch.set_default_dtype(torch.float32)
params = sum(p.numel() for p in model.parameters())
size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
show(f"built: {params / 1e9:.2f}B parameters, {size:.2f} GiB")

g = torch.Generator().manual_seed(0)
seq = cli.tokens // 2
rows = [{"input_ids": (x := torch.randint(1, 32000, (seq,), generator=g)), "labels": x.clone()} for _ in range(24)]
out = cli.output_dir or tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(__file__)) + "/..")
args = SparseSoupConfig(output_dir=out, target_sparsity=0.5, n_phases=1, num_replicas=cli.replicas,
                        replica_params="mask_lora", max_steps=cli.steps, per_device_train_batch_size=2,
                        per_device_eval_batch_size=2, learning_rate=1e-4, report_to="none", use_cpu=True,
                        disable_tqdm=True, seed=0)  # fmt: skip
clock = Clock()
soup, results = run_sms(model, args, rows[:16], NegativePerplexity(), eval_dataset=rows[16:20],
                        test_dataset=rows[20:24], callbacks=[clock])  # fmt: skip
show("run_sms returned (soup saved)")
sms_peak = peak()
print(f"hf-sms mask_lora seconds per step (each replica's {cli.steps}): {[round(t, 1) for t in clock.times]}")
targets = lora_targets(soup, args.plan)  # the linear layers the run prunes (and MaskLoRA adapts)
modules = dict(soup.named_modules())
weights = [modules[n].weight for n in targets]
zero = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
print(f"soup: {zero:.4f} of the decoder's linear weights are zero (measured on the soup)")

from peft import LoraConfig, get_peft_model  # noqa: E402

lora = get_peft_model(soup, LoraConfig(r=16, lora_alpha=32, target_modules=targets, bias="none"))
clock_lora = Clock()
plain = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=cli.steps, per_device_train_batch_size=2,
                          learning_rate=1e-4, report_to="none", use_cpu=True, disable_tqdm=True,
                          save_strategy="no")  # fmt: skip
Trainer(lora, plain, train_dataset=rows[:16], callbacks=[clock_lora]).train()
show("peft LoRA trained")
print(f"peft LoRA seconds per step ({cli.steps}): {[round(t, 1) for t in clock_lora.times]}")
print(f"peak RSS of the hf-sms phase, weights included: {sms_peak:.2f} GiB ({sms_peak * 2**30 / 1e9:.2f} GB)")
if not cli.output_dir:
    shutil.rmtree(out, ignore_errors=True)
