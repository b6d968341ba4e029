"""Peak memory of one SMS phase (m = 3 replicas, uniform soup, one process) by what a replica trains
(``replica_params``): full replicas vs biases and norms vs MaskLoRA vs ScaleLoRA, on a LLaMA-shaped sequence
classifier (81.2M parameters by default: issue 35 asks for 50-100M), each setting in a fresh process, interleaved
over rounds.

    python benchmarks/replica_memory.py --rounds 2

Printed per setting: the resident memory the phase adds over the process after the model is built (peak RSS minus
RSS before ``run_sms``; ``--device cuda``: the peak CUDA memory in bf16 mixed precision), as a multiple of the
model's fp32 bytes, and its ratio to full replicas (medians over the rounds). Targets (issue 35): mask_lora
<= 0.35x, bias_norm <= 0.3x of full; full replicas <= 9x the model's bytes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys, tempfile
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification
from hf_sms import SparseSoupConfig, run_sms
from hf_sms.evaluation import ClassificationAccuracy

kind, hidden, layers, steps, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
cuda, checkpointing = sys.argv[6] == "cuda", sys.argv[7] == "1"
torch.manual_seed(0)
torch.set_num_threads(2)
config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                     num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, num_labels=4, pad_token_id=0)
model = LlamaForSequenceClassification(config)
params = sum(p.numel() for p in model.parameters())
g = torch.Generator().manual_seed(0)
rows = [{"input_ids": torch.randint(1, 32000, (seq,), generator=g), "labels": int(i % 4)} for i in range(64)]
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
before = rss()
args = SparseSoupConfig(output_dir=tempfile.mkdtemp(), target_sparsity=0.5, n_phases=1, num_replicas=3, max_steps=steps,
                        per_device_train_batch_size=4, per_device_eval_batch_size=8, learning_rate=1e-4,
                        optim="adamw_torch", disable_tqdm=True, report_to="none", seed=0,
                        replica_params=kind, measure_speedup=False, recalibrate_bn=False, retrain_schedule="llr",
                        lora_rank=16, lora_alpha=32, use_cpu=not cuda, bf16=cuda, gradient_checkpointing=checkpointing)
if cuda:
    torch.cuda.reset_peak_memory_stats()
import time; t = time.perf_counter()
run_sms(model, args, rows[:48], ClassificationAccuracy(), eval_dataset=rows[48:56], test_dataset=rows[56:])
seconds = time.perf_counter() - t
import shutil; shutil.rmtree(args.output_dir, ignore_errors=True)  # its checkpoints, measured already
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
added = torch.cuda.max_memory_allocated() if cuda else peak - before  # the model starts on the CPU
print(json.dumps({"params": params, "added": added, "seconds": seconds}))
"""

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--hidden", type=int, default=768)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--device", default="cpu", help="cpu (resident memory) or cuda (peak CUDA memory, bf16)")
p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in the backward")
p.add_argument("--kinds", nargs="*", default=["all", "bias_norm", "mask_lora", "scale_lora"])
cli = p.parse_args()
env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
script = os.path.join(tempfile.mkdtemp(), "phase.py")
with open(script, "w") as f:
    f.write(CHILD)

runs = {k: [] for k in cli.kinds}
for _ in range(cli.rounds):
    for kind in cli.kinds:  # interleaved: the rounds share the machine's noise
        argv = [
            sys.executable,
            script,
            kind,
            str(cli.hidden),
            str(cli.layers),
            str(cli.steps),
            str(cli.seq),
            cli.device,
            str(int(cli.gradient_checkpointing)),
        ]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        runs[kind].append(json.loads(out.strip().splitlines()[-1]))

params = runs[cli.kinds[0]][0]["params"]
model_bytes = 4 * params
print(
    f"LLaMA-shaped classifier: {params / 1e6:.1f}M parameters ({model_bytes / 2**20:.0f} MiB fp32), m = 3, "
    f"{cli.steps} steps per replica, sequence {cli.seq}, {cli.rounds} rounds (median)"
    + (", gradient checkpointing" if cli.gradient_checkpointing else "")
)
memory = "added RSS" if cli.device == "cpu" else "CUDA peak"
print(f"{'replica_params':>14} {memory:>10} {'x model':>8} {'vs all':>7} {'seconds':>8}")
full = statistics.median(x["added"] for x in runs["all"]) if "all" in runs else None
for kind, xs in runs.items():
    added = statistics.median(x["added"] for x in xs)
    ratio = f"{added / full:.2f}x" if full else "-"
    seconds = statistics.median(x["seconds"] for x in xs)
    print(f"{kind:>14} {added / 2**30:>8.2f} GiB {added / model_bytes:>7.1f}x {ratio:>7} {seconds:>8.1f}")
