"""Peak memory of the learned soup's fit (issue 38 item 2) against its target: at most (m + 2) times one model's
weights plus one model's training activations. Each measurement in a fresh process, interleaved over rounds, on a
LLaMA-shaped sequence classifier (50% pruned candidates that share the mask):

- ``train``: one plain training step of one model (forward, backward: its gradients and activations), the memory
  it adds over the model itself;
- ``fit``: ``hf_sms.soup.learned.fit_mixing`` over m candidates already in memory, the memory it adds over them.

The target holds when ``fit`` adds at most one model's weights plus what ``train`` adds (``train`` already counts one
model of gradients): ratio = fit / (weights + train) <= 1.

    python benchmarks/learned_soup_memory.py --rounds 3          # CPU: resident memory (VmHWM, reset first)
    python benchmarks/learned_soup_memory.py --device cuda       # peak CUDA memory
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import copy, json, sys
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification
from hf_sms import compute_masks, apply_masks
from hf_sms.soup.learned import FitData, fit_mixing

what, device = sys.argv[1], sys.argv[6]
m, hidden, layers, seq, n_rows = (int(a) for a in sys.argv[2:6] + sys.argv[7:8])
torch.manual_seed(0)
torch.set_num_threads(2)
config = LlamaConfig(vocab_size=8000, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                     num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, num_labels=4, pad_token_id=0)
model = LlamaForSequenceClassification(config).to(device)
masks = compute_masks(model, 0.5)
apply_masks(model, masks)
weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
g = torch.Generator().manual_seed(0)
rows = [{"input_ids": torch.randint(1, 8000, (seq,), generator=g), "labels": i % 4} for i in range(32)]
loss = lambda mdl, b: mdl(**{k: v.to(device) for k, v in b.items()}).loss
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024
states = []
if what == "fit":
    for i in range(m):  # candidates: the pruned model moved a little, the mask kept
        c = copy.deepcopy(model)
        with torch.no_grad():
            for p in c.parameters():
                p.add_(0.01 * torch.randn_like(p) * (p != 0))
        states.append(c.state_dict())
tiny = torch.nn.Linear(4, 4).to(device)  # warm-up: load the code paths (autograd, torch.func) before measuring
torch.func.functional_call(tiny, dict(tiny.named_parameters()), (torch.ones(2, 4, device=device),)).sum().backward()
cuda = device == "cuda"
if cuda:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
if not cuda:  # the peak so far (pruning's scores, the copies) is not this step's: reset VmHWM to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
before = torch.cuda.memory_allocated() if cuda else status("VmRSS")
if what == "train":
    batch = torch.utils.data.default_collate(rows[:8])
    loss(model, batch).backward()
else:
    data = FitData(rows[:n_rows], 8, torch.utils.data.default_collate, loss)
    fit_mixing(states, model, data, {"lr": 0.05, "steps": n_rows // 8, "per_module": 0}, seed=0)
peak = torch.cuda.max_memory_allocated() if cuda else status("VmHWM")
print(json.dumps({"weights": weights, "added": peak - before}))
"""


# every allocation over 64 KiB its own mapping, returned on free: the resident peak is then the peak of live tensors
# (glibc's default keeps freed blocks and moves its threshold, which made the same step vary by 1.5x of the weights)
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--m", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=32, help="examples the fit reads (batches of 8)")
    cli = p.parse_args()
    got: dict[str, list[dict]] = {"train": [], "fit": []}
    for _ in range(cli.rounds):
        for what in got:
            argv = [what, cli.m, cli.hidden, cli.layers, cli.seq, cli.device, cli.rows]
            cmd = [sys.executable, "-c", CHILD, *map(str, argv)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            got[what].append(json.loads(out.stdout.strip().splitlines()[-1]))
    weights = got["fit"][0]["weights"]
    train, fit = (statistics.median(r["added"] for r in got[w]) for w in ("train", "fit"))
    memory = "added RSS" if cli.device == "cpu" else "CUDA peak added"
    print(f"model: {weights / 2**20:.1f} MiB of weights, m = {cli.m}, batch 8 x {cli.seq} tokens, {cli.device}")
    print(
        f"{memory}, medians of {cli.rounds} rounds: one training step {train / 2**20:.1f} MiB "
        f"({train / weights:.2f}x weights); the fit over m candidates {fit / 2**20:.1f} MiB ({fit / weights:.2f}x)"
    )
    ratio = fit / (weights + train)
    print(f"fit / (weights + one training step) = {ratio:.2f} (target <= 1: peak <= (m + 2) x weights + activations)")


if __name__ == "__main__":
    main()
