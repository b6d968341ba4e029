"""What the sparse runtime gives: dense vs ``to_sparse_runtime(layout="auto")`` latency, side by side in one run;
and what structured pruning gives: the pruned model vs ``hf_sms.shrink`` of it (``--only structured``).

    python benchmarks/inference.py                       # everything, 1 and 2 threads (413 s on 2 CPU cores)
    python benchmarks/inference.py --threads 1 --only t5 --quick

Every ratio is dense median / runtime median of interleaved repeats on the same input (machines are noisy: read
ratios, not times). Models have random weights pruned with ``allocation="uniform"`` (global magnitude pruning of
a random init is degenerate: the init scales decide which layers vanish); "auto" is tuned on the very workload
timed. Weight memory counts every tensor's bytes once (CSR values and indices included). The load section runs
each loader in a fresh process and reports time to the first forward and peak RSS.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

from hf_sms import apply_masks, compute_masks, save_sparse, to_sparse_runtime
from hf_sms.runtime import time_pair, weight_bytes

CPU = torch.device("cpu")


def pruned(model, sparsity, allocation="uniform"):
    apply_masks(model, compute_masks(model, sparsity, allocation))
    return model.eval()


def t5_small():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(  # t5-small's shape
        vocab_size=32128, d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64,
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config).eval()


def timm_model(name, **kwargs):
    import timm

    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **kwargs).eval()


def pspnet():
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    return smp.PSPNet(encoder_name="resnet50", encoder_weights=None, classes=19).eval()


def compare(dense, workload, repeats):
    """(dense ms, runtime ms, runtime model) with auto tuned on ``workload``."""
    runtime = to_sparse_runtime(copy.deepcopy(dense), "auto", workload)
    with torch.inference_mode():
        d, r = time_pair(lambda: workload(dense), lambda: workload(runtime), repeats, CPU)
    return d, r, runtime


def row(*cells):
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def bench_t5(sparsities, threads, repeats, quick):
    print(f"\n### T5-small shape (60.5M parameters), {threads} thread(s)\n")
    row("sparsity", "workload", "dense ms", "runtime ms", "speedup", "sparse layers", "weights MB dense", "runtime")
    print("|---" * 8 + "|")
    base = t5_small()
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 32)] if quick else [(1, 32), (8, 128)]
    for s in sparsities:
        dense = pruned(copy.deepcopy(base), s)
        work = {}
        for b, n in shapes:
            ids = torch.randint(2, 32000, (b, n), generator=g)
            work[f"forward {b}x{n}"] = lambda m, ids=ids: m(input_ids=ids, decoder_input_ids=ids)
        ids = torch.randint(2, 32000, (1, 32), generator=g)
        work["generate 32 tokens"] = lambda m, ids=ids: m.generate(
            input_ids=ids, max_new_tokens=32, min_new_tokens=32, do_sample=False
        )
        for name, fn in work.items():
            d, r, runtime = compare(dense, fn, repeats)
            report = runtime.hf_sms_runtime
            mb = weight_bytes(dense) / 2**20, weight_bytes(runtime) / 2**20
            row(f"{s:.0%}", name, f"{d:.1f}", f"{r:.1f}", f"**{d / r:.2f}x**",
                f"{len(report.sparse_layers)}/{len(report.layers)}", f"{mb[0]:.0f}",
                f"{mb[1]:.0f} ({mb[1] / mb[0]:.2f}x)")  # fmt: skip


def bench_vision(threads, repeats, quick):
    from hf_sms import shrink

    print(f"\n### Vision models, batch 1, {threads} thread(s)\n")
    row("model", "pruning", "dense ms", "runtime / shrunk ms", "speedup", "sparse layers", "weights MB dense", "now")
    print("|---" * 8 + "|")
    x224 = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    models = {"ResNet-50 224px": lambda: timm_model("resnet50")}
    if not quick:
        models["MaxViT-tiny 224px"] = lambda: timm_model("maxvit_tiny_tf_224")
        models["PSPNet (smp, ResNet-50) 256px"] = pspnet
    for name, make in models.items():
        x = torch.nn.functional.interpolate(x224, size=256) if "256" in name else x224
        base = make()
        for s in (0.9,) if quick else (0.9, 0.98):
            dense = pruned(copy.deepcopy(base), s)
            d, r, runtime = compare(dense, lambda m, x=x: m(x), repeats)
            rep = runtime.hf_sms_runtime
            mb = weight_bytes(dense) / 2**20, weight_bytes(runtime) / 2**20
            row(name, f"{s:.0%} unstructured, runtime", f"{d:.1f}", f"{r:.1f}", f"**{d / r:.2f}x**",
                f"{len(rep.sparse_layers)}/{len(rep.layers)}", f"{mb[0]:.0f}", f"{mb[1]:.0f}")  # fmt: skip
        if name.startswith("ResNet"):  # structured: whole filters removed, exported as a smaller dense model
            for s in (0.5,) if quick else (0.3, 0.5):
                masked = copy.deepcopy(base)
                apply_masks(masked, compute_masks(masked, s, structure="filters", example_inputs=x, fit_config=False))
                shrunk = shrink(masked, x, fit_config=False).eval()
                with torch.inference_mode():
                    d, r = time_pair(functools.partial(masked, x), functools.partial(shrunk, x), repeats, CPU)
                mb = weight_bytes(masked) / 2**20, weight_bytes(shrunk) / 2**20
                row(name, f"filters {s:.0%} of filters, shrink", f"{d:.1f}", f"{r:.1f}",
                    f"**{d / r:.2f}x**", "-", f"{mb[0]:.0f}", f"{mb[1]:.0f}")  # fmt: skip


_CHILD = r"""
import sys, time
import torch
torch.set_num_threads(1)
import hf_sms, transformers
mode, folder = sys.argv[1], sys.argv[2]
ids = torch.randint(2, 32000, (1, 32), generator=torch.Generator().manual_seed(0))
def peak_mb():  # VmHWM: this process's own peak (ru_maxrss survives exec, so a child would report its parent's)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    return int(line.split()[1]) / 1024
base = peak_mb()
start = time.perf_counter()
if mode == "transformers":
    model = transformers.T5ForConditionalGeneration.from_pretrained(folder)
elif mode == "load_sparse":
    model = hf_sms.load_sparse(folder)
else:
    model = hf_sms.load_sparse(folder, runtime="csr", mmap=mode == "runtime-mmap")
with torch.inference_mode():
    model(input_ids=ids, decoder_input_ids=ids)
seconds = time.perf_counter() - start
print(seconds, base, peak_mb())
"""


def bench_load(sparsity, rounds):
    print(f"\n### Loading T5-small at {sparsity:.0%} and its first forward (1x32 tokens), fresh process each\n")
    with tempfile.TemporaryDirectory(prefix="hf-sms-inference-") as folder:  # 250 MB of checkpoints: never left
        _bench_load(folder, sparsity, rounds)


def _bench_load(folder, sparsity, rounds):
    model = pruned(t5_small(), sparsity)
    save_sparse(model, os.path.join(folder, "dense"), "dense")
    save_sparse(model, os.path.join(folder, "bitmask"))
    del model
    runs = {
        "transformers from_pretrained (dense file, lazy mmap)": ("transformers", "dense"),
        "load_sparse (bitmask file, dense model)": ("load_sparse", "bitmask"),
        "load_sparse(runtime='csr') (bitmask file)": ("runtime", "bitmask"),
        "load_sparse(runtime='csr', mmap=True) (bitmask file)": ("runtime-mmap", "bitmask"),
    }
    results = {name: [] for name in runs}
    for _ in range(rounds):  # interleaved rounds, medians
        for name, (mode, sub) in runs.items():
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, mode, os.path.join(folder, sub)],
                capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            results[name].append([float(v) for v in out.stdout.split()[-3:]])
    row("loader", "to first forward s", "peak RSS MB", "above imports MB")
    print("|---" * 4 + "|")
    for name, values in results.items():
        med = [sorted(v[i] for v in values)[len(values) // 2] for i in range(3)]
        row(name, f"{med[0]:.2f}", f"{med[2]:.0f}", f"{med[2] - med[1]:.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parts = ["t5", "vision", "load", "structured"]
    parser.add_argument("--only", nargs="*", default=parts, choices=parts)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and sparsities (a check that it runs)")
    cli = parser.parse_args()
    start = time.time()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for threads in cli.threads:
        torch.set_num_threads(threads)
        if "t5" in cli.only:
            bench_t5((0.9,) if cli.quick else (0.9, 0.95, 0.98), threads, cli.repeats, cli.quick)
        if "vision" in cli.only:
            bench_vision(threads, cli.repeats, cli.quick)
        if "structured" in cli.only:  # whole units removed: the smaller dense model (benchmarks/structured.py)
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "structured.py")
            quick = ["--quick"] if cli.quick else []
            subprocess.run([sys.executable, script, "--threads", str(threads), "--repeats", str(cli.repeats), *quick])
    if "load" in cli.only:
        bench_load(0.9, 1 if cli.quick else 7)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n{time.time() - start:.0f} s, this process's peak RSS {peak:.0f} MB", json.dumps({"threads": cli.threads}))


if __name__ == "__main__":
    main()
