"""Evaluation shared by a run's processes: wall time of evaluating one model on 1 vs 2 processes (torchrun, gloo,
one thread each), the values checked equal.

    python benchmarks/eval_scaling.py --rounds 3

Workloads: top-1 accuracy of a timm ResNet-18 on 2048 random 64-px images (batch 64), and BLEU of a small T5
generating 24 tokens for 1024 byte-level sentences (batch 32). Runs alternate 1 and 2 processes to share the
machine's noise; each time is measured inside the run after a barrier, so process start-up is excluded.
Target (issue 23): <= 0.6x on 2 processes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def worker(out: str) -> None:
    import timm
    from transformers import ByT5Tokenizer, T5Config, T5ForConditionalGeneration

    from hf_sms.evaluation import BleuMetric, ClassificationAccuracy, evaluate
    from hf_sms.loop.distributed import ReplicaWorld

    torch.set_num_threads(1)
    world = ReplicaWorld(num_replicas=1, cpu=True)
    g = torch.Generator().manual_seed(0)
    images = [{"x": torch.randn(3, 64, 64, generator=g), "labels": torch.tensor(i % 10)} for i in range(2048)]
    torch.manual_seed(0)
    resnet = timm.create_model("resnet18", pretrained=False, num_classes=10)
    tok = ByT5Tokenizer()
    enc = tok([f"sentence number {i} of the test set" for i in range(1024)], padding="max_length", max_length=48,
              truncation=True, return_tensors="pt")  # fmt: skip
    pairs = [{"input_ids": enc.input_ids[i], "attention_mask": enc.attention_mask[i], "labels": enc.input_ids[i]}
             for i in range(1024)]  # fmt: skip
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=384, d_model=128, d_ff=512, num_layers=2, num_heads=4, d_kv=32,
                                             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))  # fmt: skip
    work = {
        "accuracy, ResNet-18, 2048 images": (ClassificationAccuracy(batch_size=64), resnet, images),
        "BLEU, T5 generate, 1024 sentences": (BleuMetric(tok, max_new_tokens=24, batch_size=32), t5, pairs),
    }
    record = {}
    for name, (metric, model, data) in work.items():
        world.barrier()
        start = time.perf_counter()
        value = evaluate(metric, model, data, world)
        record[name] = {"seconds": time.perf_counter() - start, "value": value}
    if world.is_main:
        with open(os.path.join(out, "eval.json"), "w") as f:
            json.dump(record, f)


def run(nproc: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="hf-sms-eval-") as out:
        cmd = [os.path.abspath(__file__), "--worker", out]
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
        subprocess.run([sys.executable, *launcher, *cmd], env=env, check=True, capture_output=True)
        with open(os.path.join(out, "eval.json")) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    cli = p.parse_args()
    if cli.worker:
        return worker(cli.worker)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": root}
    times: dict = {1: [], 2: []}
    for r in range(cli.rounds):
        for n in (1, 2):
            times[n].append(run(n, env))
        print(f"round {r + 1}: " + "; ".join(f"{n} process(es) " + ", ".join(
            f"{v['seconds']:.2f} s" for v in times[n][-1].values()) for n in (1, 2)), flush=True)  # fmt: skip
    print("\n| workload | 1 process s | 2 processes s | ratio | values equal |\n|---|---|---|---|---|")
    for name in times[1][0]:
        one, two = (statistics.median(t[name]["seconds"] for t in times[n]) for n in (1, 2))
        same = all(t[name]["value"] == times[1][0][name]["value"] for n in (1, 2) for t in times[n])
        print(f"| {name} | {one:.2f} | {two:.2f} | **{two / one:.2f}x** | {same} |")


if __name__ == "__main__":
    main()
