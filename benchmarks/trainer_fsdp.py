"""transformers' FSDP path with hf-sms's masks (issue 35 item 5): SparseSoupTrainer trained with the Trainer's own
`fsdp` arguments (FSDP2 through accelerate, which enables it only on accelerators: this runs on a GPU), beside the
same training without FSDP. Each check prints OK or FAIL and the script goes on, so one lease gives every answer
(it exits 1 if any failed):

- the step time and peak CUDA memory with and without FSDP (bf16 autocast);
- every pruned weight exactly zero after training, read from the full state dict accelerate gathers;
- `trainer.save_model` writes a folder `hf_sms.load_sparse` loads, with the mask exactly.

    torchrun --nproc_per_node 1 benchmarks/trainer_fsdp.py              # on a GPU machine (gpu_check.sh step i)
    python benchmarks/trainer_fsdp.py --no-fsdp --device cpu --steps 2   # the same checks without FSDP, any machine
"""

import argparse
import os
import sys
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_sms import SparseSoupConfig, SparseSoupTrainer, compute_masks, load_sparse

p = argparse.ArgumentParser()
p.add_argument("--no-fsdp", action="store_true", help="only the run without FSDP")
p.add_argument("--forms", nargs="*", default=["string", "bool"], choices=["string", "bool"],
               help="the fsdp argument forms to run")  # fmt: skip
p.add_argument("--device", default="cuda")
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--seq", type=int, default=128)
cli = p.parse_args()
cuda = cli.device == "cuda"
rank = int(os.environ.get("RANK", "0"))


def say(*parts):
    if rank == 0:
        print(*parts, flush=True)


def model_and_masks():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=cli.hidden, intermediate_size=cli.hidden * 8 // 3,
                         num_hidden_layers=cli.layers, num_attention_heads=cli.hidden // 64,
                         num_key_value_heads=cli.hidden // 64, pad_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(config)
    return model, compute_masks(model, 0.5)


failed = []


def check(name, fn):
    try:
        detail = fn()
        say(f"  OK   {name}{': ' + detail if detail else ''}")
    except Exception as e:  # noqa: BLE001 - report every check, whatever fails
        say(f"  FAIL {name}: {type(e).__name__}: {str(e)[:300]}")
        failed.append(name)


# transformers' two ways to ask for FSDP2: the string form the H200 ran (transformers 5.17), deprecated (removal
# announced for 5.20; 5.24 still takes it), and the form that replaces it
WRAP = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
FORMS = {
    None: {},  # no FSDP
    "string": {"fsdp": "full_shard", "fsdp_config": WRAP},
    "bool": {"fsdp": True, "fsdp_config": {"version": 2, **WRAP}},
}


def run(form: str | None):
    model, masks = model_and_masks()
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(1, 32000, (cli.seq,), generator=g)), "labels": ids} for _ in range(64)]
    name = f"FSDP ({form} form)" if form else "no FSDP"
    try:
        args = SparseSoupConfig(output_dir=tempfile.mkdtemp(), max_steps=cli.steps, per_device_train_batch_size=4,
                                learning_rate=1e-4, optim="adamw_torch", report_to="none", disable_tqdm=True,
                                bf16=cuda, use_cpu=not cuda, save_strategy="no", **FORMS[form])  # fmt: skip
    except Exception as e:  # noqa: BLE001 - this transformers does not take the form: a failed check, on with the rest
        say(f"  FAIL {name}: arguments: {type(e).__name__}: {str(e)[:300]}")
        failed.append(f"{name}: arguments")
        return
    trainer = SparseSoupTrainer(model, args, masks=masks, train_dataset=rows)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    trainer.train()
    seconds = (time.perf_counter() - t) / cli.steps
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    say(f"{name}: {seconds * 1000:.1f} ms/step (first steps included), peak {peak:.0f} MiB")

    def exact():
        state = trainer.accelerator.get_state_dict(trainer.model)  # the full tensors (rank 0 for FSDP)
        if rank != 0:
            return "checked on rank 0"
        wrong = {n: int((state[n].float().cpu()[~m.cpu()] != 0).sum()) for n, m in masks.items() if n in state}
        missing = [n for n in masks if n not in state]
        assert not missing, f"{len(missing)} masked tensors not in the gathered state, e.g. {missing[:3]}"
        assert not any(wrong.values()), f"pruned weights changed: {[n for n, w in wrong.items() if w][:5]}"
        return f"{len(masks)} tensors, every pruned weight 0"

    def saved():
        folder = tempfile.mkdtemp()
        trainer.save_model(folder)
        if rank != 0:
            return "saved"
        loaded = load_sparse(folder)
        changed = [n for n, m in masks.items() if (loaded.state_dict()[n][~m.cpu()] != 0).any()]
        assert not changed, f"the saved model revived pruned weights in {changed[:5]}"
        return f"load_sparse: {len(masks)} masks exact"

    check(f"{name}: masks exact after training", exact)
    check(f"{name}: save_model -> load_sparse", saved)


world = os.environ.get("WORLD_SIZE", 1)
say(f"torch {torch.__version__}, LLaMA {cli.hidden}x{cli.layers}, {cli.steps} steps, {world} process(es)")
run(None)
for form in [] if cli.no_fsdp else cli.forms:
    run(form)
sys.exit(1 if failed else 0)  # gpu_check names the step as failed
