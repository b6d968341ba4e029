"""What a structured soup gives: the pruned model (dense shapes) against ``hf_sms.shrink`` of it, side by side.

    python benchmarks/structured.py                    # T5-small and GPT-2 small shapes, ResNet-50; 1 thread
    python benchmarks/structured.py --quick            # one sparsity, fewer repeats (a check that it runs)
    python benchmarks/structured.py --device cuda --dtype bfloat16 --batch 256  # a busy GPU (benchmarks/gpu_check.sh)
    python benchmarks/structured.py --device cuda --dtype bfloat16 --batch 64 --compile   # CUDA graphs

Models have random weights pruned with ``structure="neurons+heads"`` (T5; GPT-2's config cannot say fewer heads of
the same size, so GPT-2 prunes ``neurons``) or ``"filters"`` (ResNet-50, MaxViT, EfficientNet-B0, smp PSPNet), at
Li et al.'s L2 norm: timing depends on the shapes only. Convnets are pruned and shrunk twice: the units their
library's arguments state (the default, what a structured run saves; EfficientNet-B0 has none) and with
``fit_config=False`` (every unit the graph has, cut in place). ``--compile`` times both models under
``torch.compile(mode="reduce-overhead")`` (CUDA graphs on a GPU). Every ratio is the median of interleaved repeats of
the same input (machines are noisy: read ratios). ``shrink`` checks on the timed input that the smaller model's
outputs equal the pruned one's (relative 1e-4 in float32).
"""

from __future__ import annotations

import argparse
import copy
from functools import partial

import torch

from hf_sms import apply_masks, compute_masks, shrink
from hf_sms.runtime import time_pair
from hf_sms.shrinking import parameter_count

DRY = False  # --dry-run: every model a few layers wide (a check on a CPU that each step runs)


def t5_small():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    tiny = dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16) if DRY else {}
    shape = dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, **{"vocab_size": VOCAB["t5"]})
    config = T5Config(**{**shape, "decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, **tiny})
    return T5ForConditionalGeneration(config)


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tiny = dict(n_embd=64, n_layer=2, n_head=4) if DRY else {}
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB["gpt2"], **tiny))  # 124M: n_embd 768, 12 layers, 12 heads


def resnet50():
    import timm

    torch.manual_seed(0)
    return timm.create_model("resnet18" if DRY else "resnet50", pretrained=False)


def timm_model(name, **kwargs):
    def make():
        import timm

        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, **kwargs)

    return make


def pspnet(encoder):
    def make():
        import segmentation_models_pytorch as smp

        torch.manual_seed(0)  # smp's default depth 3 (PSP on stride-8 features); tu-: timm's encoder, stated widths
        name = encoder.replace("50", "18") if DRY else encoder
        return smp.PSPNet(encoder_name=name, encoder_weights=None, classes=21)

    return make


VOCAB = {"t5": 32128, "gpt2": 50257}


def row(*cells):
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def tokens(batch, length, vocab, device, seq2seq):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (batch, length), generator=g).to(device)
    out = {"input_ids": ids}
    if seq2seq:
        out["decoder_input_ids"] = torch.randint(2, vocab, (batch, length), generator=g).to(device)
    return out


def bench_model(name, make, structure, sparsities, workloads, args, fit_config=(True,)):
    """Rows for ``make()`` pruned to each sparsity: forward (and generate) dense-shaped vs shrunk (``fit_config``
    True: the units its library's arguments state; False: every unit, cut in place)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    base = make().to(device=device, dtype=dtype).eval()
    dense_params = parameter_count(base)
    check = workloads[0][1]  # units are traced, and shrink checks outputs, on the first input
    for sparsity in sparsities:
        for fit in fit_config:
            pruned = copy.deepcopy(base)
            try:
                masks = compute_masks(pruned, sparsity, structure=structure, example_inputs=check, fit_config=fit)
            except ValueError as e:  # e.g. a family whose arguments state no unit
                row(name, f"{sparsity:.0%} {structure}", "-", "-", "-", "-", str(e).splitlines()[0][:90])
                continue
            apply_masks(pruned, masks)
            small = shrink(pruned, check, rtol=1e-4 if dtype == torch.float32 else 2e-2, fit_config=fit).eval()
            ratio, how = parameter_count(small) / dense_params, "" if fit else " (fit_config=False)"
            if args.compile:
                pruned, small = (torch.compile(m, mode="reduce-overhead") for m in (pruned, small))
            for label, batch, call in workloads:
                if args.compile and call is not forward:
                    continue  # generate() recompiles per length: CUDA graphs time the forward only
                with torch.inference_mode():
                    d, s = time_pair(partial(call, pruned, batch), partial(call, small, batch), args.repeats, device)
                what = f"{label}{' compiled' if args.compile else ''}"
                row(name, f"{sparsity:.0%} {structure}{how}", what, f"{d:.1f}", f"{s:.1f}", f"**{d / s:.2f}x**",
                    f"{ratio:.3f}")  # fmt: skip
            del small, pruned


def forward(model, batch):
    return model(**batch) if isinstance(batch, dict) else model(batch)


def generate(new_tokens):
    def call(model, batch):
        return model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=8, help="the larger batch (the smaller is 1)")
    parser.add_argument("--compile", action="store_true", help='torch.compile(mode="reduce-overhead") both models')
    models = ["t5", "gpt2", "resnet50", "maxvit", "efficientnet", "pspnet"]
    parser.add_argument("--only", nargs="*", default=models, choices=models)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="tiny models, 64 px, 2 repeats: checks it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick or args.dry_run:
        args.repeats = 3
    if args.dry_run:
        global DRY
        DRY, args.repeats = True, 2
        VOCAB.update(t5=256, gpt2=256)
    sparsities = [0.5] if args.quick or args.dry_run else [0.5, 0.75]
    device, b = torch.device(args.device), args.batch
    print(f"\n### Structured: pruned (dense shapes) vs shrunk, {args.device} {args.dtype}, {args.threads} thread(s)\n")
    row("model", "pruned", "workload", "pruned ms", "shrunk ms", "speedup", "parameters shrunk/dense")
    print("|---" * 7 + "|")
    if "t5" in args.only:
        small, large = tokens(1, 32, VOCAB["t5"], device, True), tokens(b, 128, VOCAB["t5"], device, True)
        prompt = {"input_ids": small["input_ids"]}
        work = [("forward 1x32", small, forward), (f"forward {b}x128", large, forward)]
        work.append(("generate 1x32 -> 32", prompt, generate(32)))
        work.append((f"generate {b}x32 -> 32", {"input_ids": large["input_ids"][:, :32]}, generate(32)))
        bench_model("T5-small", t5_small, "neurons+heads", sparsities, work, args)
    if "gpt2" in args.only:
        small, large = tokens(1, 32, VOCAB["gpt2"], device, False), tokens(b, 128, VOCAB["gpt2"], device, False)
        work = [("forward 1x32", small, forward), (f"forward {b}x128", large, forward)]
        work.append(("generate 1x32 -> 32", small, generate(32)))
        bench_model("GPT-2 small", gpt2_small, "neurons", sparsities, work, args)
    if "resnet50" in args.only:
        g = torch.Generator().manual_seed(0)
        px = 64 if args.dry_run else 224
        images = [torch.randn(n, 3, px, px, generator=g).to(device, getattr(torch, args.dtype)) for n in (1, b)]
        work = [(f"forward {n}x{px}px", x, forward) for n, x in zip((1, b), images)]
        bench_model("ResNet-50", resnet50, "filters", [0.5], work, args, fit_config=(True, False))
    for key, label, arch, kinds in (
        ("maxvit", "MaxViT-tiny", "maxvit_tiny_tf_224", "filters+neurons"),
        ("efficientnet", "EfficientNet-B0", "efficientnet_b0", "filters"),
    ):
        if key in args.only:
            g = torch.Generator().manual_seed(0)
            px = 64 if args.dry_run else 224
            images = [torch.randn(n, 3, px, px, generator=g).to(device, getattr(torch, args.dtype)) for n in (1, b)]
            work = [(f"forward {n}x{px}px", x, forward) for n, x in zip((1, b), images)]
            kwargs = {"img_size": px} if key == "maxvit" else {}
            bench_model(label, timm_model(arch, **kwargs), kinds, [0.5], work, args, fit_config=(True, False))
    if "pspnet" in args.only:
        g = torch.Generator().manual_seed(0)
        px = 64 if args.dry_run else 256
        images = [torch.randn(n, 3, px, px, generator=g).to(device, getattr(torch, args.dtype)) for n in (1, b)]
        work = [(f"forward {n}x{px}px", x, forward) for n, x in zip((1, b), images)]
        for encoder in ("tu-resnet50", "resnet50"):
            make = pspnet(encoder)
            bench_model(f"PSPNet ({encoder})", make, "filters", [0.5], work, args, fit_config=(True, False))


if __name__ == "__main__":
    main()
