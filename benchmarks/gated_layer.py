"""One MaskLoRA / ScaleLoRA layer's forward and backward against its floor, by LLaMA-7B's linear shapes (issue 53).

For each shape (the MLP's up/gate and down projections, an attention projection), 50% pruned, in one process,
interleaved over repetitions (medians after two left out), milliseconds for:

- ``products``: the three dense products a gated layer cannot avoid (``x W^T``, ``grad W``, ``grad^T x``), whole;
- ``lora``: peft LoRA's layer (the base product and the rank-r path, forward and backward);
- ``gated``: hf-sms's gated layer (``_GatedLinear``, with its base), forward and backward;
- ``gated (old)``: the same from another checkout's hf-sms (``--old DIR``), checked bit for bit against ``gated``.

What ``gated`` costs beyond ``products`` is its elementwise passes over the weight (gate, effective weight, the
gated update gradient) and the rank-r products; ``gated / lora`` is the layer's share of mask_lora / peft LoRA.

    python benchmarks/gated_layer.py --tokens 128 512
    python benchmarks/gated_layer.py --tokens 512 --gating scale --old ../old
"""

import argparse
import functools
import importlib.util
import os
import statistics
import time

import torch


def load_old(root: str):
    """``hf_sms/adapters/lora.py`` of another checkout, as a module of its own."""
    spec = importlib.util.spec_from_file_location("old_lora", os.path.join(root, "hf_sms", "adapters", "lora.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(layers: dict, weight, a, b, tokens: int, gating: str, reps: int, gen) -> dict[str, float]:
    """Median milliseconds of each variant at ``tokens`` rows, interleaved; the gated layers' results compared."""
    dtype = weight.dtype
    x = torch.randn(tokens, weight.shape[1], generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(tokens, weight.shape[0], generator=gen).to(dtype)
    x_, grad_t = x.detach(), grad.T.contiguous()

    def products():
        return x_ @ weight.T, grad @ weight, grad_t @ x_

    def lora_layer():  # peft's Linear: the frozen base's product, dropout off, the update in float32
        (x @ weight.T + ((x.float() @ a.T) @ b.T * 2.0).to(dtype)).backward(grad)

    def gated(layer):
        y = layer.apply(x, weight, None, a, b, 2.0, gating, True)
        y.backward(grad)
        return y

    runs = {"products": products, "lora": lora_layer, **{k: functools.partial(gated, f) for k, f in layers.items()}}
    times, outputs = {k: [] for k in runs}, {}
    for _ in range(reps + 2):
        for name, run in runs.items():
            x.grad = a.grad = b.grad = None
            start = time.perf_counter()
            y = run()
            times[name].append(time.perf_counter() - start)
            if name in layers:
                outputs[name] = (y, x.grad, a.grad, b.grad)
    if "old" in outputs and not all(torch.equal(u, v) for u, v in zip(outputs["new"], outputs["old"])):
        print(f"note: old and new differ at {tuple(weight.shape)}, {tokens} tokens (rounding)")
    return {k: statistics.median(v[2:]) * 1e3 for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", nargs="+", type=int, default=[128, 512])
    p.add_argument("--gating", choices=["mask", "scale"], default="mask")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--old", default=None, help="a checkout of hf-sms whose gated layer runs beside this one")
    cli = p.parse_args()
    torch.set_num_threads(cli.threads)
    from hf_sms.adapters import lora

    layers = {"new": lora._GatedLinear, **({"old": load_old(cli.old)._GatedLinear} if cli.old else {})}
    dtype = torch.bfloat16 if cli.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    old = " gated (old) |" if cli.old else ""
    print(f"ms per forward and backward, {cli.dtype}, rank {cli.rank}, {cli.threads} threads, {cli.gating} gating")
    print(f"| shape (out x in) | tokens | products | lora | gated |{old} gated / lora |")
    print("|---|---|---|---|---|" + ("---|" if cli.old else "") + "---|")
    for out_f, in_f in [(11008, 4096), (4096, 11008), (4096, 4096)]:
        weight = torch.randn(out_f, in_f, generator=gen).to(dtype)
        weight[torch.rand(out_f, in_f, generator=gen) < 0.5] = 0
        a = (torch.randn(cli.rank, in_f, generator=gen) * 0.01).requires_grad_()
        b = (torch.randn(out_f, cli.rank, generator=gen) * 0.01).requires_grad_()
        for tokens in cli.tokens:
            ms = measure(layers, weight, a, b, tokens, cli.gating, cli.reps, gen)
            cells = [ms["products"], ms["lora"], ms["new"]] + ([ms["old"]] if cli.old else [])
            row = " | ".join(f"{v:.0f}" for v in cells)
            print(f"| {out_f} x {in_f} | {tokens} | {row} | {ms['new'] / ms['lora']:.2f}x |")


if __name__ == "__main__":
    main()
