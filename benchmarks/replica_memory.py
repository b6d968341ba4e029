"""Memory of one SMS phase (uniform soup, one process) by what a replica trains (``replica_params``), each setting in
a fresh process, interleaved over rounds.

Two shapes:

- ``--shape llama7b`` (issue 50): LLaMA-7B's decoder layer (hidden 4096, intermediate 11008, 32 heads) in a causal
  LM whose vocabulary (512) leaves >= 95% of the parameters in linear layers, as in a real LLM; scored by
  perplexity. ``--layers 1 2`` prints what one decoder layer more adds, ``--replicas 1 3`` what one replica more adds.
- ``--shape small`` (issue 35): a LLaMA-shaped sequence classifier, 81.2M parameters, 30% of them in the embedding.

    python benchmarks/replica_memory.py --shape llama7b --layers 1 2 --kinds all bias_norm mask_lora
    python benchmarks/replica_memory.py --shape llama7b --layers 1 2 --kinds mask_lora --dtype bf16
    python benchmarks/replica_memory.py --shape llama7b --kinds mask_lora --replicas 1 3 --defaults
    python benchmarks/replica_memory.py --shape small --rounds 2

Printed per setting: the resident memory the phase adds over the process once the model is built (peak RSS minus RSS
before ``run_sms``; ``--device cuda``: the peak CUDA memory), as a multiple of the model's bytes in its dtype, and its
ratio to full replicas. The benchmark's settings turn the soup's speed measurement and BatchNorm recalibration off;
``--defaults`` adds a row with the run's defaults for them. ``--timeline`` prints, for the first setting, every
hf-sms log line and phase step with the RSS at that moment and the peak so far (where the peak is reached).
``--old DIR`` runs every setting also with the hf-sms of another checkout (``DIR``), side by side in the same rounds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import functools, json, logging, os, resource, sys, tempfile, threading, time
import torch
s = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(2)
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from hf_sms import SparseSoupConfig, run_sms
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.evaluation.metrics import NegativePerplexity

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024

g = torch.Generator().manual_seed(0)
# a bf16 model is built in bf16: built in fp32 and cast, the process's peak (ru_maxrss) would be that cast's
torch.set_default_dtype(torch.bfloat16 if s["dtype"] == "bf16" else torch.float32)
if s["shape"] == "llama7b":
    config = LlamaConfig(vocab_size=512, hidden_size=4096, intermediate_size=11008, num_hidden_layers=s["layers"],
                         num_attention_heads=32, num_key_value_heads=32, pad_token_id=0)
    model, metric = LlamaForCausalLM(config), NegativePerplexity()
    ids = [torch.randint(1, 512, (s["seq"],), generator=g) for _ in range(64)]
    rows = [{"input_ids": x, "labels": x.clone()} for x in ids]
else:
    h = s["hidden"]
    config = LlamaConfig(vocab_size=32000, hidden_size=h, intermediate_size=h * 8 // 3, num_hidden_layers=s["layers"],
                         num_attention_heads=h // 64, num_key_value_heads=h // 64, num_labels=4, pad_token_id=0)
    model, metric = LlamaForSequenceClassification(config), ClassificationAccuracy()
    rows = [{"input_ids": torch.randint(1, 32000, (s["seq"],), generator=g), "labels": i % 4} for i in range(64)]
cuda = s["device"] == "cuda"
torch.set_default_dtype(torch.float32)
params = sum(p.numel() for p in model.parameters())
linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
if cuda:
    model = model.cuda()
before, peak, t0 = rss(), [0], time.perf_counter()
peak[0] = before
def show(what):
    if s["timeline"]:
        now, top = (rss() - before) / 2**30, (peak[0] - before) / 2**30
        print(f"{time.perf_counter() - t0:7.1f}s  rss +{now:5.2f}  peak +{top:5.2f} GiB  {what}", flush=True)
if s["timeline"]:
    def sample():
        while True:
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    class Lines(logging.Handler):
        def emit(self, record):
            show(record.getMessage()[:110])
    logging.getLogger("hf_sms").addHandler(Lines())
    import hf_sms.loop.rounds as rounds, hf_sms.loop.sms as sms, hf_sms.loop.recorder as recorder
    import hf_sms.loop.replica_training as training
    watch = [(rounds, "_prune"), (training, "fit"), (rounds, "subset_weights"), (rounds, "replica_distances"),
             (rounds, "build_subset_soup"), (recorder.Recorder, "candidate_scores"), (recorder.Recorder, "measure"),
             (sms, "save_final_soup")]
    for owner, name in watch:
        def watched(fn, name=name):
            @functools.wraps(fn)
            def call(*a, **k):
                show(f"> {name}")
                try:
                    return fn(*a, **k)
                finally:
                    show(f"< {name}")
            return call
        if hasattr(owner, name):
            setattr(owner, name, watched(getattr(owner, name)))
settings = dict(output_dir=tempfile.mkdtemp(), target_sparsity=0.5, n_phases=1, num_replicas=s["replicas"],
                max_steps=s["steps"], per_device_train_batch_size=s["batch"], per_device_eval_batch_size=8,
                learning_rate=1e-4,
                optim="adamw_torch", disable_tqdm=True, report_to="none", seed=0, replica_params=s["kind"],
                retrain_schedule="llr", lora_rank=16, lora_alpha=32, use_cpu=not cuda,
                bf16=cuda and s["dtype"] != "bf16",
                gradient_checkpointing=s["checkpointing"])
if not s["defaults"]:
    settings.update(measure_speedup=False, recalibrate_bn=False)
args = SparseSoupConfig(**settings)
if cuda:
    torch.cuda.reset_peak_memory_stats()
run_sms(model, args, rows[:48], metric, eval_dataset=rows[48:56], test_dataset=rows[56:])
show("run_sms returned")
seconds = time.perf_counter() - t0
import shutil; shutil.rmtree(args.output_dir, ignore_errors=True)  # its checkpoints, measured already
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
added = torch.cuda.max_memory_allocated() - nbytes if cuda else peak - before
print(json.dumps({"params": params, "linear": linear, "bytes": nbytes, "added": added, "seconds": seconds}))
"""

p = argparse.ArgumentParser()
p.add_argument("--shape", choices=["llama7b", "small"], default="llama7b")
p.add_argument("--rounds", type=int, default=1)
p.add_argument("--hidden", type=int, default=768, help="--shape small: hidden size")
p.add_argument("--layers", type=int, nargs="+", default=None, help="decoder layers (default: 1 for llama7b, 8 small)")
p.add_argument("--replicas", type=int, nargs="+", default=[3], help="m")
p.add_argument("--steps", type=int, default=None, help="steps per replica (default: 2 for llama7b, 4 small)")
p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 16 for llama7b, 64 small)")
p.add_argument("--batch", type=int, default=4, help="sequences a training step")
p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the dtype the model is loaded in")
p.add_argument("--device", default="cpu", help="cpu (resident memory) or cuda (peak CUDA memory beyond the model)")
p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in the backward")
p.add_argument("--kinds", nargs="*", default=["all", "bias_norm", "mask_lora"])
p.add_argument("--defaults", action="store_true", help="also each setting with the run's defaults (speed, BN)")
p.add_argument("--timeline", action="store_true", help="RSS at every phase step of the first setting")
p.add_argument("--old", default=None, help="a checkout of hf-sms to run beside this one (its root folder)")
cli = p.parse_args()
small = cli.shape == "small"
layers = cli.layers or [8 if small else 1]
steps, seq = cli.steps or (4 if small else 2), cli.seq or (64 if small else 16)
script = os.path.join(tempfile.mkdtemp(), "phase.py")
with open(script, "w") as f:
    f.write(CHILD)
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
codes = {"new": here, **({"old": os.path.abspath(cli.old)} if cli.old else {})}

settings = [
    dict(kind=k, layers=n, replicas=m, defaults=d)
    for k in cli.kinds
    for n in layers
    for m in cli.replicas
    for d in ([False, True] if cli.defaults else [False])
]
runs = {}
for r in range(cli.rounds):
    for i, setting in enumerate(settings):  # interleaved: the rounds share the machine's noise
        for code, root in codes.items():
            spec = {
                **setting,
                "shape": cli.shape,
                "hidden": cli.hidden,
                "steps": steps,
                "seq": seq,
                "batch": cli.batch,
                "dtype": cli.dtype,
                "device": cli.device,
                "checkpointing": cli.gradient_checkpointing,
                "timeline": cli.timeline and r == 0 and i == 0 and code == "new",
            }
            env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "PYTHONPATH": root}
            out = subprocess.run([sys.executable, script, json.dumps(spec)], env=env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{code} {setting} failed:\n{out.stderr[-3000:]}")
            lines = out.stdout.strip().splitlines()
            if spec["timeline"]:
                print("\n".join(lines[:-1]))
            runs.setdefault((code, *setting.values()), []).append(json.loads(lines[-1]))

first = next(iter(runs.values()))[0]
share = 100 * first["linear"] / first["params"]
print(
    f"{cli.shape}: {first['params'] / 1e6:.1f}M parameters at {layers[0]} layer(s), {share:.1f}% in linear layers; "
    f"{cli.dtype}; {steps} steps per replica, {seq} tokens, {cli.rounds} round(s) (median)"
    + (", gradient checkpointing" if cli.gradient_checkpointing else "")
)
memory = "added RSS" if cli.device == "cpu" else "CUDA peak"
head = f"{'code':>4} {'replica_params':>14} {'layers':>6} {'m':>2} {'settings':>9} {memory:>10} {'x model':>8}"
print(f"{head} {'vs all':>7} {'s':>6}")
med = {key: statistics.median(x["added"] for x in xs) for key, xs in runs.items()}
for key, xs in runs.items():
    code, kind, n, m, defaults = key
    full = med.get((code, "all", n, m, defaults))
    ratio = f"{med[key] / full:.2f}" if full else "-"
    seconds = statistics.median(x["seconds"] for x in xs)
    print(
        f"{code:>4} {kind:>14} {n:>6} {m:>2} {'defaults' if defaults else 'bench':>9} {med[key] / 2**30:>6.2f} GiB "
        f"{med[key] / xs[0]['bytes']:>7.2f}x {ratio:>7} {seconds:>6.0f}"
    )
for code in codes:  # the slopes: one decoder layer more, one replica more
    for kind in cli.kinds:
        pairs = [(n, med.get((code, kind, n, cli.replicas[-1], False))) for n in layers]
        if len(layers) > 1 and all(v is not None for _, v in pairs):
            (n0, a0), (n1, a1) = pairs[0], pairs[-1]
            per = (a1 - a0) / (n1 - n0)
            layer_bytes = (
                runs[(code, kind, n1, cli.replicas[-1], False)][0]["bytes"]
                - runs[(code, kind, n0, cli.replicas[-1], False)][0]["bytes"]
            ) / (n1 - n0)
            fixed = a0 - per * n0
            print(
                f"{code} {kind}: one decoder layer more adds {per / layer_bytes:.2f}x its bytes "
                f"({per / 2**30:.2f} GiB); what does not grow with depth: {fixed / 2**30:.2f} GiB"
            )
        if len(cli.replicas) > 1:
            n = layers[-1]
            a, b = med.get((code, kind, n, cli.replicas[0], False)), med.get((code, kind, n, cli.replicas[-1], False))
            if a is not None and b is not None:
                each = (b - a) / (cli.replicas[-1] - cli.replicas[0])
                size = runs[(code, kind, n, cli.replicas[-1], False)][0]["bytes"]
                print(
                    f"{code} {kind}: one replica more adds {each / size:.3f}x the model ({each / 2**30:.2f} GiB) "
                    f"at {n} layer(s)"
                )
    if cli.defaults:
        for kind in cli.kinds:
            n, m = layers[0], cli.replicas[-1]
            a, b = med.get((code, kind, n, m, False)), med.get((code, kind, n, m, True))
            size = runs[(code, kind, n, m, False)][0]["bytes"]
            print(f"{code} {kind}: the run's defaults add {(b - a) / size:.2f}x the model over the benchmark settings")
