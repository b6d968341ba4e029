"""Quality of SMS by what a replica trains (``replica_params``), on a small causal LM trained here on real text.

    python benchmarks/replica_quality.py                      # the table in docs/results.md
    python benchmarks/replica_quality.py --quick              # a minute: fewer steps, one setting

The text is the docstrings of Python's standard library (English prose and code examples, on every machine with
CPython; split by position 90/5/5 into train, validation, test), read as bytes. A 4-layer LLaMA (about 1M
parameters) is pretrained dense, then for each sparsity and criterion (one shot to the target) SMS with m = 3 and a
uniform soup runs under each ``replica_params``, all at the same steps per replica, beside IMP and IMP_mx (which
train the same subset). Printed: test perplexity of the soup, the best candidate (by validation), the mean
candidate, IMP and IMP_mx, the run's wall time and the resident memory it added (each setting runs in a fresh
process that loads the pretrained model: its peak RSS minus its RSS before ``run_sms``). Learning rates are fixed
per kind, not tuned: AdamW at 1e-3 for full replicas and 5e-3 for the subsets (a few parameters move further per
step), cosine-free LLR.
"""

import argparse
import ast
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_sms import SparseSoupConfig, run_sms
from hf_sms.evaluation import NegativePerplexity

p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true")
p.add_argument("--sparsities", type=float, nargs="*", default=[0.5, 0.7])
p.add_argument("--criteria", nargs="*", default=["magnitude", "wanda"])
p.add_argument("--kinds", nargs="*", default=["all", "bias_norm", "mask_lora", "scale_lora"])
p.add_argument("--pretrain-steps", type=int, default=1500)
p.add_argument("--steps", type=int, default=150, help="retraining steps per replica")
p.add_argument("--json", default=None, help="write every run's rows here")
p.add_argument("--seed", type=int, default=0, help="the SMS runs' seed (replicas' streams); pretraining stays seed 0")
p.add_argument("--run", nargs=4, help=argparse.SUPPRESS)  # a child: DENSE_DIR SPARSITY CRITERION KIND
cli = p.parse_args()
if cli.quick:
    cli.sparsities, cli.criteria, cli.kinds = [0.5], ["magnitude"], ["mask_lora"]
    cli.pretrain_steps, cli.steps = 200, 20
torch.set_num_threads(2)
BLOCK = 128
LR = {"all": 1e-3, "bias_norm": 5e-3, "mask_lora": 5e-3, "scale_lora": 5e-3}


def corpus() -> bytes:
    stdlib = os.path.dirname(os.__file__)
    texts = []
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
        texts += [d for n in nodes if (d := ast.get_docstring(n))]
    return "\n\n".join(texts).encode("utf-8")


def blocks(data: bytes) -> list[dict]:
    ids = torch.tensor(list(data), dtype=torch.long)
    n = len(ids) // BLOCK
    cut = [ids[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]
    return [{"input_ids": c, "labels": c} for c in cut]


text = corpus()
a, b = int(0.9 * len(text)), int(0.95 * len(text))
train, val, test = blocks(text[:a]), blocks(text[a:b]), blocks(text[b:])
print(f"corpus: {len(text) / 1e6:.2f} MB of stdlib docstrings (Python {sys.version.split()[0]}); blocks of {BLOCK} "
      f"bytes: {len(train)} train, {len(val)} validation, {len(test)} test", flush=True)  # fmt: skip
metric = NegativePerplexity(batch_size=32)
common = dict(use_cpu=True, disable_tqdm=True, report_to="none", per_device_train_batch_size=16, seed=0,
              save_strategy="no", logging_strategy="no")  # fmt: skip


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


if cli.run:  # one setting in this fresh process: its memory is its own
    folder, sparsity, criterion, kind = cli.run[0], float(cli.run[1]), cli.run[2], cli.run[3]
    dense = LlamaForCausalLM.from_pretrained(folder)
    args = SparseSoupConfig(
        output_dir=tempfile.mkdtemp(), target_sparsity=sparsity, n_phases=1, num_replicas=3,
        merge_methods=["uniform"], baselines=["imp", "imp_mx"], criterion=criterion, replica_params=kind,
        max_steps=cli.steps, learning_rate=LR[kind], optim="adamw_torch", weight_decay=0.0,
        retrain_schedule="llr", lora_rank=8, lora_alpha=16, measure_speedup=False, per_device_eval_batch_size=32,
        **{**{k: v for k, v in common.items() if k != "save_strategy"}, "seed": cli.seed},
    )  # fmt: skip
    before, t0 = rss(), time.time()
    _, results = run_sms(dense, args, train, metric, eval_dataset=val, test_dataset=test)
    seconds = time.time() - t0
    added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    shutil.rmtree(args.output_dir, ignore_errors=True)  # a run's checkpoints: hundreds of MB each
    r = results["rows"]
    cells = [-r[m][-1]["test"] for m in ("sms_uniform", "best_candidate", "mean_candidate", "imp", "imp_mx")]
    print(json.dumps({"test_ppl": cells, "seconds": seconds, "added_rss": added}))
    sys.exit()

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=BLOCK)  # fmt: skip
dense = LlamaForCausalLM(config)
t0 = time.time()
Trainer(
    dense,
    TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=cli.pretrain_steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=50,
        weight_decay=0.0,
        **common,
    ),  # fmt: skip
    train_dataset=train,
).train()
print(f"dense: {sum(p.numel() for p in dense.parameters()) / 1e6:.2f}M parameters, pretrained {cli.pretrain_steps} "
      f"steps in {time.time() - t0:.0f} s; test perplexity {-metric(dense, test):.3f}", flush=True)  # fmt: skip

folder = tempfile.mkdtemp()
dense.save_pretrained(folder)  # every setting's process starts from these weights (safetensors)
rows = []
print("| sparsity | criterion | replica_params | soup | best candidate | mean candidate | IMP | IMP_mx | wall s | "
      "added RSS |")  # fmt: skip
print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
for sparsity in cli.sparsities:
    for criterion in cli.criteria:
        for kind in cli.kinds:
            argv = [sys.executable, __file__, "--run", folder, str(sparsity), criterion, kind]
            argv += ["--steps", str(cli.steps), "--seed", str(cli.seed)]
            out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True).stdout  # its errors show
            row = json.loads(out.strip().splitlines()[-1])
            rows.append({"sparsity": sparsity, "criterion": criterion, "replica_params": kind, **row, "seed": cli.seed})
            print(f"| {sparsity:.0%} | {criterion} | {kind} | " + " | ".join(f"{c:.3f}" for c in row["test_ppl"])
                  + f" | {row['seconds']:.0f} | {row['added_rss'] / 2**20:.0f} MiB |", flush=True)  # fmt: skip
shutil.rmtree(folder, ignore_errors=True)
if cli.json:
    with open(cli.json, "w") as f:
        json.dump(rows, f, indent=2)
