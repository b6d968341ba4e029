"""Sparse checkpoints of a 60M-parameter T5 (t5-small shape, random init): size, load time, merge memory.

    python benchmarks/checkpoints.py [--threads 1] [--repeats 5]

For fp32 and bf16 at 90% and 98% sparsity (magnitude pruning with uniform allocation, every prunable
tensor at the target; bf16 models are the pruned fp32 ones cast):

- bytes on disk of the weights vs dense, and vs the entropy bound summed over tensors:
  ``nnz * bytes_per_value + numel * H(s) / 8`` for each sparse tensor (H: binary entropy of its
  sparsity), ``numel * bytes_per_value`` for the others. Target: <= 1.15x the bound.
- ``AutoModelForSeq2SeqLM.from_pretrained`` time (best of N, warm page cache, runs interleaved) of the
  bitmask folder vs the dense one. transformers maps a dense safetensors file lazily (mmap: weights are
  read on first use), so the dense load is also timed with ``disable_mmap=True`` (weights read into
  memory, as a sparse load must). Target: <= 1.5x dense.
- ``hf-sms merge`` of 5 checkpoints (fp32, 90%) in a subprocess: peak RSS vs one model loaded and
  touched in a subprocess (each measured by a fresh wrapper process's ``RUSAGE_CHILDREN`` max RSS), and
  merge time vs reading the input files. Target: <= 2x one model.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=3, help="load-time repetitions (best is reported)")
p.add_argument("--replicas", type=int, default=5, help="checkpoints to merge")
p.add_argument("--threads", type=int, default=None, help="torch threads here and in the subprocesses")
cli = p.parse_args()
if cli.threads:  # on a shared machine, OpenMP threads spinning on busy cores slow every op down
    os.environ["OMP_NUM_THREADS"] = str(cli.threads)

from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import hf_sms  # noqa: E402
from hf_sms import apply_masks, compute_masks, save_sparse  # noqa: E402
from hf_sms.checkpoint import SparseCheckpoint, eligible  # noqa: E402

if cli.threads:
    torch.set_num_threads(cli.threads)
hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
ROOT = tempfile.mkdtemp(prefix="hf-sms-ckpt-bench-")
CONFIG = T5Config(d_model=512, d_ff=2048, d_kv=64, num_heads=8, num_layers=6, vocab_size=32128)


def entropy(s: float) -> float:
    return 0.0 if s <= 0 or s >= 1 else -(s * math.log2(s) + (1 - s) * math.log2(1 - s))


def weights_bytes(directory: str) -> int:
    return sum(os.path.getsize(f.path) for f in SparseCheckpoint(directory).files)


def entropy_bound(dense_dir: str) -> tuple[float, float]:
    """(bound, plain-bitmask size) in bytes over the tensors of a dense folder."""
    bound = bitmask = 0.0
    ckpt = SparseCheckpoint(dense_dir)
    for name in ckpt.names():
        t = ckpt.read(name)
        bpv, numel = t.element_size(), t.numel()
        if eligible(name, t.shape, t.dtype):
            nnz = int(torch.count_nonzero(t))
            bound += nnz * bpv + numel * entropy(1 - nnz / numel) / 8
            bitmask += nnz * bpv + numel / 8
        else:
            bound += numel * bpv
            bitmask += numel * bpv
    return bound, bitmask


def best_time(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def peak_rss_mb(code: str) -> float:
    """Peak RSS of ``python -c code``, read by a fresh wrapper process from RUSAGE_CHILDREN."""
    wrapper = (
        "import resource, subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", wrapper, code], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1]) / 1024  # Linux reports KiB


def pruned_t5(sparsity: float, seed: int = 0) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(CONFIG)
    apply_masks(model, compute_masks(model, sparsity, "uniform"))
    return model


print(f"hf-sms {hf_sms.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, files in {ROOT}")
n_params = sum(p.numel() for p in T5ForConditionalGeneration(CONFIG).parameters())
print(f"model: T5ForConditionalGeneration (t5-small shape, random init), {n_params / 1e6:.1f}M parameters\n")


# -- 1. size and load time ----------------------------------------------------------------------
def size_and_load(model: T5ForConditionalGeneration, sparsity: float) -> None:
    dense_dir, sparse_dir = os.path.join(ROOT, "dense"), os.path.join(ROOT, "bitmask")
    save_sparse(model, dense_dir, "dense")
    save_sparse(model, sparse_dir, "bitmask")
    dense_b, sparse_b = weights_bytes(dense_dir), weights_bytes(sparse_dir)
    bound, bitmask = entropy_bound(dense_dir)
    loads = {
        "dense": lambda: AutoModelForSeq2SeqLM.from_pretrained(dense_dir),
        "dense_ram": lambda: AutoModelForSeq2SeqLM.from_pretrained(dense_dir, disable_mmap=True),
        "bitmask": lambda: AutoModelForSeq2SeqLM.from_pretrained(sparse_dir),
        "load_sparse": lambda: hf_sms.load_sparse(sparse_dir),
    }
    times = {k: math.inf for k in loads}
    for _ in range(cli.repeats):  # interleaved, so all share the machine's noise
        for k, load in loads.items():
            times[k] = min(times[k], best_time(load, 1))
    loaded = loads["bitmask"]()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    t = times
    print(
        f"| {str(model.dtype).split('.')[-1]} | {sparsity:.0%} | {dense_b / 1e6:.1f} | {sparse_b / 1e6:.2f} | "
        f"{sparse_b / dense_b:.3f} | {bound / 1e6:.2f} | **{sparse_b / bound:.3f}** | {bitmask / bound:.3f} | "
        f"{t['dense']:.3f} | {t['dense_ram']:.3f} | {t['bitmask']:.3f} | **{t['bitmask'] / t['dense']:.2f}** | "
        f"{t['bitmask'] / t['dense_ram']:.2f} | {t['load_sparse']:.3f} |",
        flush=True,
    )
    shutil.rmtree(dense_dir)
    shutil.rmtree(sparse_dir)


print(
    "| dtype | sparsity | dense MB | bitmask MB | vs dense | entropy bound MB | vs bound | plain bitmask vs bound "
    "| load dense (mmap) s | load dense (in RAM) s | load bitmask s | vs dense (mmap) | vs dense (in RAM) "
    "| load_sparse s |"
)
print("|---" * 14 + "|")
for sparsity in (0.9, 0.98):
    pruned = pruned_t5(sparsity)
    size_and_load(pruned, sparsity)
    size_and_load(copy.deepcopy(pruned).to(torch.bfloat16), sparsity)
    if sparsity == 0.9:
        base_model = pruned


# -- 2. streaming merge -------------------------------------------------------------------------
def merge_bench(fmt: str, base: T5ForConditionalGeneration) -> None:
    from hf_sms.checkpoint import merge_checkpoints

    inputs = []
    for i in range(cli.replicas):
        torch.manual_seed(100 + i)
        with torch.no_grad():
            replica = T5ForConditionalGeneration(CONFIG)
            replica.load_state_dict(base.state_dict())
            for p in replica.parameters():
                p.add_(torch.randn_like(p) * 0.01 * (p != 0))  # retrained under the same mask
        inputs.append(save_sparse(replica, os.path.join(ROOT, f"{fmt}-r{i}"), fmt))
        del replica
    out = os.path.join(ROOT, f"{fmt}-soup")
    rss_base = peak_rss_mb("import hf_sms.checkpoint.merge, transformers.modeling_utils")  # what both import
    rss_one = peak_rss_mb(  # one model loaded and every weight touched (a dense load maps the file lazily)
        "import hf_sms, transformers as t; "
        f"m = t.AutoModelForSeq2SeqLM.from_pretrained({inputs[0]!r}); [float(p.sum()) for p in m.parameters()]"
    )
    argv = ["merge", *inputs, "--output", out, "--format", fmt]
    rss_merge = peak_rss_mb(f"from hf_sms.cli import main; raise SystemExit(main({argv!r}))")

    def read_inputs():
        for d in inputs:
            for f in SparseCheckpoint(d).files:
                for k in f.keys():
                    f.read(k)

    t_read = best_time(read_inputs, cli.repeats)
    t_merge = best_time(lambda: merge_checkpoints(inputs, out, format=fmt, overwrite=True), cli.repeats)
    in_mb = sum(weights_bytes(d) for d in inputs) / 1e6
    net = (rss_merge - rss_base) / (rss_one - rss_base)
    print(
        f"- {fmt} inputs -> {fmt} output ({in_mb:.0f} MB of inputs): peak RSS merge {rss_merge:.0f} MB, one model "
        f"{rss_one:.0f} MB -> {rss_merge / rss_one:.2f}x (above the {rss_base:.0f} MB of the imports: "
        f"{rss_merge - rss_base:.0f} vs {rss_one - rss_base:.0f} MB, {net:.2f}x); "
        f"merge {t_merge:.2f} s vs reading the inputs {t_read:.2f} s ({t_merge / t_read:.1f}x)",
        flush=True,
    )
    for d in [*inputs, out]:
        shutil.rmtree(d, ignore_errors=True)


print(f"\nmerge of {cli.replicas} checkpoints (fp32, 90%, same mask, different values):")
for fmt in ("bitmask", "dense"):
    merge_bench(fmt, base_model)
shutil.rmtree(ROOT, ignore_errors=True)
