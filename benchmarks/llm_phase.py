"""One SMS phase of a LLaMA-2-7B-shaped model on one GPU (issue 50 item 7): peak CUDA memory, seconds per step
beside plain peft LoRA on the same model, and the soup's mask, for MaskLoRA and bias_norm replicas.

The model is LLaMA-2-7B's config (hidden 4096, intermediate 11008, 32 layers, 32 heads, vocabulary 32000), random
weights built in bf16 on the GPU; gradient checkpointing; batches of 4 x 2048 tokens; m = 3 replicas of --steps steps
each, uniform soup, 50% (the decoder's linear layers: embeddings and lm_head stay dense, the default).

    python benchmarks/llm_phase.py                       # a CUDA GPU with >= 24 GB
    python benchmarks/llm_phase.py --layers 40 --hidden 5120 --intermediate 13824 --heads 40   # 13B's shape
    python benchmarks/llm_phase.py --dry-run             # a tiny model on the CPU: checks that it runs
"""

import argparse
import json
import math
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_sms import SparseSoupConfig, run_sms
from hf_sms.evaluation.metrics import NegativePerplexity
from hf_sms.pruning.selection import ModuleSelection

p = argparse.ArgumentParser()
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--intermediate", type=int, default=11008)
p.add_argument("--layers", type=int, default=32)
p.add_argument("--heads", type=int, default=32)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--kinds", nargs="*", default=["mask_lora", "bias_norm"])
p.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
cli = p.parse_args()
if cli.dry_run:
    cli.hidden, cli.intermediate, cli.layers, cli.heads, cli.seq, cli.batch, cli.steps = 64, 128, 2, 4, 32, 2, 1
cuda = torch.cuda.is_available() and not cli.dry_run
device = "cuda" if cuda else "cpu"


def build() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=32000 if not cli.dry_run else 256, hidden_size=cli.hidden,
                         intermediate_size=cli.intermediate, num_hidden_layers=cli.layers,
                         num_attention_heads=cli.heads, num_key_value_heads=cli.heads, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)


g = torch.Generator().manual_seed(0)
vocab = 32000 if not cli.dry_run else 256
rows = [{"input_ids": (x := torch.randint(1, vocab, (cli.seq,), generator=g)), "labels": x.clone()} for _ in range(16)]
common = dict(per_device_train_batch_size=cli.batch, per_device_eval_batch_size=cli.batch, max_steps=cli.steps,
              learning_rate=1e-4, gradient_checkpointing=True, bf16=cuda, use_cpu=not cuda, report_to="none",
              disable_tqdm=True, save_strategy="no", logging_steps=1)  # fmt: skip


def lora_seconds_per_step() -> float:
    """Plain peft LoRA (rank 16, the same targets) on the same model: the gated product's cost is against this."""
    from peft import LoraConfig, get_peft_model

    model = build()
    targets = sorted({t.name.rsplit(".", 2)[-2] for t in ModuleSelection().tensors(model)})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), **common)
    trainer = Trainer(model, args, train_dataset=rows[:8])
    trainer.train()
    times = [h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h]
    del trainer, model
    torch.cuda.empty_cache() if cuda else None
    return times[-1] / cli.steps


lora = lora_seconds_per_step()
print(f"plain peft LoRA: {lora:.2f} s per step ({cli.batch} x {cli.seq} tokens)")
for kind in cli.kinds:
    model = build()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    args = SparseSoupConfig(output_dir=tempfile.mkdtemp(), target_sparsity=0.5, n_phases=1, num_replicas=3,
                            replica_params=kind, lora_rank=16, lora_alpha=32, measure_speedup=False,
                            **common)  # fmt: skip
    start = time.perf_counter()
    soup, results = run_sms(model, args, rows[:8], NegativePerplexity(), eval_dataset=rows[8:12],
                            test_dataset=rows[12:])  # fmt: skip
    seconds = time.perf_counter() - start
    pruned = ModuleSelection().tensors(soup)
    zeros = sum(t.param.numel() - int(torch.count_nonzero(t.param)) for t in pruned)
    total = sum(t.param.numel() for t in pruned)
    exact = zeros == round(0.5 * total)
    peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
    steps = [r for r in results["world"]["jobs"] if r.get("kind") == "train"]
    per_step = sum(r["end"] - r["start"] for r in steps) / max(len(steps) * cli.steps, 1)  # setup included
    print(json.dumps({"replica_params": kind, "parameters_B": round(sum(p.numel() for p in soup.parameters()) / 1e9, 2),
                      "weights_GiB": round(weights / 2**30, 2), "cuda_peak_GiB": round(peak / 2**30, 2),
                      "peak_beyond_weights": round(peak / weights - 1, 3) if not math.isnan(peak) else None,
                      "seconds_per_step": round(per_step, 2), "vs_plain_lora": round(per_step / lora, 2),
                      "phase_seconds": round(seconds, 1), "soup_mask_exact": exact}))  # fmt: skip
    del soup, model
    if cuda:
        torch.cuda.empty_cache()
