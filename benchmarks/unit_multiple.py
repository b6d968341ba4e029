"""Do widths at multiples of 8 run faster? The choice behind ``SparseSoupConfig(unit_multiple=...)``'s default.

    python benchmarks/unit_multiple.py                                   # CPU, float32, 1 thread
    python benchmarks/unit_multiple.py --device cuda --dtype bfloat16    # a GPU (benchmarks/gpu_check.sh)

Times a T5-small-shaped FFN (512 -> width -> 512, batch x 128 tokens) at every width from 1017 to 1032, each against
the width 1024 in the same interleaved repeats, and prints the ratio time(width) / time(1024): a width that is
not a multiple of 8 costs what its ratio says above the widths that are.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from hf_sms.runtime import time_pair


def ffn(width: int, device, dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, width), torch.nn.ReLU(), torch.nn.Linear(width, 512)).to(
        device, dtype
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=8, help="sequences of 128 tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="four widths, 3 repeats: a check that it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    x = torch.randn(args.batch * 128, 512, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    reference = ffn(1024, device, dtype)
    widths = [1020, 1021, 1023, 1032] if args.quick else range(1017, 1033)
    repeats = 3 if args.quick else args.repeats
    where = f"{args.device} {args.dtype}, {args.threads} thread(s)"
    print(f"\n### FFN 512 -> width -> 512, {args.batch}x128 tokens, {where}\n")
    print("| width | multiple of 8 | ms | ms at 1024 | time / time at 1024 |")
    print("|---|---|---|---|---|")
    for width in widths:
        model = ffn(width, device, dtype)
        with torch.inference_mode():
            t, t0 = time_pair(partial(model, x), partial(reference, x), repeats, device)
        print(f"| {width} | {'yes' if width % 8 == 0 else 'no'} | {t:.3f} | {t0:.3f} | {t / t0:.3f} |", flush=True)


if __name__ == "__main__":
    main()
