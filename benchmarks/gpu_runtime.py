"""The sparse runtime on a GPU: T5-small shapes in bf16, dense cuBLAS vs ``csr`` (cuSPARSE) vs 2:4
``semi_structured`` (CUTLASS/cuSPARSELt), per layer shape and for the whole model. Part of gpu_check.sh.

    python benchmarks/gpu_runtime.py             # a CUDA GPU of compute capability >= 8.0
    python benchmarks/gpu_runtime.py --dry-run   # CPU, fp32, small shapes, csr only: checks the script runs
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch
import torch.nn.functional as F

from hf_sms import apply_masks, compute_masks, to_sparse_runtime
from hf_sms.runtime import time_pair
from hf_sms.runtime.csr import to_csr


def two_four(weight: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest of every 4 consecutive inputs."""
    groups = weight.abs().reshape(-1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(2, dim=1).indices, True)
    return weight * keep.reshape(weight.shape)


def layer_table(device, dtype, rows_list, shapes, repeats, semi: bool) -> None:
    print("| weight (out x in) | rows | pruning | dense ms | sparse ms | speedup |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator(device="cpu").manual_seed(0)
    for out, inp in shapes:
        w = torch.randn(out, inp, generator=g).to(device, dtype)
        for rows in rows_list:
            x = torch.randn(rows, inp, generator=g).to(device, dtype)
            dense = functools.partial(F.linear, x, w)
            for sparsity in (0.9, 0.98):
                pruned = w * (torch.rand(w.shape, generator=g) >= sparsity).to(device, dtype)
                csr = to_csr(pruned)
                d, s = time_pair(dense, lambda csr=csr, x=x: torch.sparse.mm(csr, x.t()).t(), repeats, device)
                print(f"| {out}x{inp} | {rows} | {sparsity:.0%} csr | {d:.3f} | {s:.3f} | **{d / s:.2f}x** |")
            if semi:
                w24 = torch.sparse.to_sparse_semi_structured(two_four(w))
                d, s = time_pair(dense, functools.partial(F.linear, x, w24), repeats, device)
                print(f"| {out}x{inp} | {rows} | 2:4 semi_structured | {d:.3f} | {s:.3f} | **{d / s:.2f}x** |")


def t5_small(dry: bool):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    size = dict(vocab_size=384, d_model=64, d_ff=256, num_layers=2, num_heads=4, d_kv=16) if dry else {}
    config = T5Config(**{"vocab_size": 32128, "decoder_start_token_id": 0, **size})
    return T5ForConditionalGeneration(config).eval()


def model_table(device, dtype, repeats, semi: bool, dry: bool) -> None:
    print("\n| T5-small, forward 8x128 tokens | dense ms | runtime ms | speedup | sparse layers |")
    print("|---|---|---|---|---|")
    ids = torch.randint(2, 384 if dry else 32000, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)

    def workload(m):
        return m(input_ids=ids, decoder_input_ids=ids)

    settings = [("90% uniform, csr", 0.9, "uniform", "csr"), ("90% uniform, auto", 0.9, "uniform", "auto")]
    if semi:
        settings += [("2:4, semi_structured", 0.5, "2:4", "semi_structured"), ("2:4, auto", 0.5, "2:4", "auto")]
    for label, sparsity, allocation, layout in settings:
        dense = t5_small(dry)
        apply_masks(dense, compute_masks(dense, sparsity, allocation))
        dense = dense.to(device, dtype)
        runtime = to_sparse_runtime(copy.deepcopy(dense), layout, workload)
        with torch.inference_mode():
            d, r = time_pair(functools.partial(workload, dense), functools.partial(workload, runtime), repeats, device)
        rep = runtime.hf_sms_runtime
        print(f"| {label} | {d:.2f} | {r:.2f} | **{d / r:.2f}x** | {len(rep.sparse_layers)}/{len(rep.layers)} |")


def graphed(fn, device):
    """``fn`` captured once in a CUDA graph and replayed: the host work of each call (about 0.5 ms for 2:4) goes."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph, as torch's docs ask
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_table(device, dtype, repeats) -> None:
    """2:4 against dense on the layer widths where it can pay (LLaMA-7B's 4096 and 11008), both under CUDA graphs."""
    print("\n| weight (out x in), CUDA graphs | rows | dense ms | 2:4 ms | speedup |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device="cpu").manual_seed(0)
    for out, inp in [(4096, 4096), (11008, 4096), (4096, 11008)]:
        w = torch.randn(out, inp, generator=g).to(device, dtype)
        w24 = torch.sparse.to_sparse_semi_structured(two_four(w))
        for rows in (256, 1024, 4096, 16384):
            x = torch.randn(rows, inp, generator=g).to(device, dtype)
            try:
                dense = graphed(functools.partial(F.linear, x, w), device)
                sparse = graphed(functools.partial(F.linear, x, w24), device)
                d, s = time_pair(dense, sparse, repeats, device)
                print(f"| {out}x{inp} | {rows} | {d:.3f} | {s:.3f} | **{d / s:.2f}x** |")
            except Exception as e:  # noqa: BLE001 - one shape that cannot be captured must not end the check
                print(f"| {out}x{inp} | {rows} | - | - | failed: {type(e).__name__}: {str(e)[:80]} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, fp32, small shapes")
    parser.add_argument("--repeats", type=int, default=20)
    cli = parser.parse_args()
    if cli.dry_run:
        device, dtype, repeats = torch.device("cpu"), torch.float32, 2
        shapes, rows = [(512, 512), (2048, 512)], [32]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: run with --dry-run on a CPU")
        device, dtype, repeats = torch.device("cuda"), torch.bfloat16, cli.repeats
        shapes, rows = [(512, 512), (2048, 512), (512, 2048), (32128, 512)], [32, 1024]
    semi = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}, torch {torch.__version__}, {dtype}; semi_structured: {'yes' if semi else 'no (needs CUDA >= 8.0)'}\n"
    )
    layer_table(device, dtype, rows, shapes, repeats, semi)
    model_table(device, dtype, repeats, semi, cli.dry_run)
    if semi:
        graph_table(device, dtype, repeats)


if __name__ == "__main__":
    main()
