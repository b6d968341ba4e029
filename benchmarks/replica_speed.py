"""Seconds per training step of one replica by what it trains, beside peft LoRA and a plain ``Trainer`` (issue 53).

One decoder layer of LLaMA-7B's shape (hidden 4096, intermediate 11008, 32 heads; vocabulary 512 so that >= 95% of
the parameters sit in linear layers), pruned to 50% once and saved: every variant starts from that file, each in a
fresh process on 2 threads, timed from each step's begin to its end (forward, backward, optimizer step, the mask
hooks), the first ``--warmup`` steps left out, median over the rest. Variants:

- hf-sms ``SparseSoupTrainer`` replicas: ``mask_lora``, ``scale_lora``, ``bias_norm``, ``mask_lora_norms``, ``all``
  (full fine-tuning with the masks kept);
- ``peft_lora``: peft's plain LoRA (same rank, alpha and target modules as mask_lora) under transformers' ``Trainer``;
- ``trainer``: a plain transformers ``Trainer``, full fine-tuning, no masks.

    python benchmarks/replica_speed.py --dtypes bf16 --tokens 128 512
    python benchmarks/replica_speed.py --dtypes bf16 fp32 --tokens 128 512 2048 --old ../old

``--old DIR`` runs the hf-sms variants also with the hf-sms of another checkout, interleaved in the same rounds.
Ratios printed: mask_lora over full fine-tuning and over peft LoRA, ``all`` over the plain ``Trainer``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, statistics, sys, time
import torch
s = json.loads(sys.argv[1])
torch.set_num_threads(s["threads"])
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

dtype = torch.bfloat16 if s["dtype"] == "bf16" else torch.float32
torch.set_default_dtype(dtype)
config = LlamaConfig(vocab_size=512, hidden_size=4096, intermediate_size=11008, num_hidden_layers=1,
                     num_attention_heads=32, num_key_value_heads=32, pad_token_id=0)
model = LlamaForCausalLM(config)  # its buffers (rotary frequencies) as built; its weights the pruned start's
model.load_state_dict(load_file(s["start"]))
torch.set_default_dtype(torch.float32)
g = torch.Generator().manual_seed(0)
seq = s["tokens"] // 2
rows = [{"input_ids": (x := torch.randint(1, 512, (seq,), generator=g)), "labels": x.clone()} for _ in range(64)]
common = dict(output_dir=s["out"], max_steps=s["warmup"] + s["steps"], per_device_train_batch_size=2,
              learning_rate=1e-4, optim=s["optim"], report_to="none", use_cpu=True, disable_tqdm=True,
              save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0)

class Clock(TrainerCallback):
    times = []
    def on_step_begin(self, *a, **k):
        self.t = time.perf_counter()
    def on_step_end(self, *a, **k):
        self.times.append(time.perf_counter() - self.t)

kind = s["kind"]
if kind in ("trainer", "peft_lora"):
    if kind == "peft_lora":
        from peft import LoraConfig, get_peft_model
        from hf_sms import SparseSoupConfig
        from hf_sms.adapters.replica import lora_targets
        plan = SparseSoupConfig(output_dir=s["out"], target_sparsity=0.5, use_cpu=True).plan
        targets = lora_targets(model, plan)  # the layers mask_lora adapts: the decoder's linears, not lm_head
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, bias="none"))
    trainer = Trainer(model, TrainingArguments(**common), train_dataset=rows, callbacks=[Clock()])
else:
    from hf_sms import SparseSoupConfig, SparseSoupTrainer
    args = SparseSoupConfig(**common, target_sparsity=0.5, replica_params=kind, lora_rank=16, lora_alpha=32,
                            retrain_schedule="llr")
    trainer = SparseSoupTrainer(model, args, train_dataset=rows, callbacks=[Clock()])
trainer.train()
times = Clock.times[s["warmup"]:]
print(json.dumps({"median": statistics.median(times), "times": times}))
"""

VARIANTS = ["mask_lora", "scale_lora", "bias_norm", "mask_lora_norms", "peft_lora", "trainer", "all"]
HF_SMS = {"mask_lora", "scale_lora", "bias_norm", "mask_lora_norms", "all"}


def make_start(path: str, dtype: str) -> None:
    """The pruned start every variant loads: one LLaMA-7B-shaped decoder layer, 50% magnitude-pruned."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_sms

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)
    config = LlamaConfig(vocab_size=512, hidden_size=4096, intermediate_size=11008, num_hidden_layers=1,
                         num_attention_heads=32, num_key_value_heads=32, pad_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    hf_sms.prune(model, 0.5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["bf16"])
    p.add_argument("--tokens", nargs="+", type=int, default=[128, 512], help="tokens a step (batch of 2 sequences)")
    p.add_argument("--kinds", nargs="+", choices=VARIANTS, default=VARIANTS)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="steps left out first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--optim",
        default="adamw_torch",
        help="transformers' optim for every variant (its default: "
        "adamw_torch_fused; adamw_torch, the foreach one, in the tables of docs/benchmarks.md)",
    )
    p.add_argument("--rounds", type=int, default=1, help="each variant this many times, interleaved (median)")
    p.add_argument("--old", default=None, help="a checkout of hf-sms to run the hf-sms variants with too")
    cli = p.parse_args()
    tmp = tempfile.mkdtemp()
    script = os.path.join(tmp, "step.py")
    with open(script, "w") as f:
        f.write(CHILD)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    codes = {"new": here, **({"old": os.path.abspath(cli.old)} if cli.old else {})}
    results = {}
    for dtype in cli.dtypes:
        start = os.path.join(tmp, f"start-{dtype}.safetensors")
        make_start(start, dtype)
        for round_ in range(cli.rounds):
            for tokens in cli.tokens:
                runs = [(k, c) for k in cli.kinds for c in codes if c == "new" or k in HF_SMS]
                # every other round in reverse: a process right after a large one runs measurably slower (the
                # kernel still reclaiming its memory), so each variant takes each position as often
                for kind, code in runs[:: -1 if round_ % 2 else 1]:
                    root = codes[code]
                    time.sleep(3)  # the previous process's memory given back before the next one starts
                    spec = dict(kind=kind, dtype=dtype, tokens=tokens, start=start, steps=cli.steps, optim=cli.optim,
                                warmup=cli.warmup, threads=cli.threads, out=tempfile.mkdtemp(dir=tmp))  # fmt: skip
                    env = {**os.environ, "OMP_NUM_THREADS": str(cli.threads), "HF_HUB_OFFLINE": "1",
                           "PYTHONPATH": root}  # fmt: skip
                    out = subprocess.run([sys.executable, script, json.dumps(spec)], env=env, capture_output=True,
                                         text=True)  # fmt: skip
                    if out.returncode:
                        sys.exit(f"{code} {kind} {dtype} {tokens} failed:\n{out.stderr[-3000:]}")
                    value = json.loads(out.stdout.strip().splitlines()[-1])["median"]
                    results.setdefault((dtype, tokens, kind, code), []).append(value)
                    print(f"{dtype} {tokens:>5} tokens {kind:>16} {code}: {value:.3f} s/step", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nseconds per step, median of {cli.steps} steps after {cli.warmup} ({cli.threads} threads, "
          f"{cli.rounds} round(s)); one LLaMA-7B decoder layer, 50% pruned")  # fmt: skip
    shown = [(k, c) for k in cli.kinds for c in codes if c == "new" or k in HF_SMS]
    print("| dtype | tokens | " + " | ".join(f"{k} ({c})" if c == "old" else k for k, c in shown) + " |")
    print("|---|---|" + "---|" * len(shown))
    for dtype in cli.dtypes:
        for tokens in cli.tokens:
            cells = [f"{med[(dtype, tokens, k, c)]:.2f}" if (dtype, tokens, k, c) in med else "-" for k, c in shown]
            print(f"| {dtype} | {tokens} | " + " | ".join(cells) + " |")
    for dtype in cli.dtypes:
        for tokens in cli.tokens:
            for code in codes:
                get = med.get
                m, full = get((dtype, tokens, "mask_lora", code)), get((dtype, tokens, "trainer", "new"))
                lora, all_ = get((dtype, tokens, "peft_lora", "new")), get((dtype, tokens, "all", code))
                parts = []
                if m and full:
                    parts.append(f"mask_lora / full fine-tuning {m / full:.2f}x")
                if m and lora:
                    parts.append(f"mask_lora / peft LoRA {m / lora:.2f}x")
                if all_ and full:
                    parts.append(f"all / Trainer {all_ / full:.2f}x")
                if parts:
                    print(f"{code} {dtype} {tokens} tokens: " + ", ".join(parts))


if __name__ == "__main__":
    main()
