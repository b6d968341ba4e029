"""SparseSoupTrainer on a model sharded in place after the trainer was built, as accelerate's FSDP2 shards it when
training starts under transformers' ``fsdp`` arguments (accelerate enables FSDP only on accelerators: on 2 CPU
processes with gloo this stands in for it; benchmarks/trainer_fsdp.py runs the real path on a GPU). Rank 0 writes
checks.json and saves the gathered model as ``SparseSoupTrainer.save_model`` does. argv: the output folder."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hf_sms import SparseSoupConfig, SparseSoupTrainer, compute_masks, save_sparse
from hf_sms.loop.launcher import hide_launcher_env
from hf_sms.pruning.masks import is_sharded
from hf_sms.training.sharding import full_model, full_state_dict, shard_replica

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
hide_launcher_env(False, 0)  # each Trainer runs as one process: FSDP2 averages the gradients over the two
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
model = LlamaForCausalLM(config)
masks = compute_masks(model, 0.5)
start = {k: v.clone() for k, v in model.state_dict().items()}
g = torch.Generator().manual_seed(rank)  # each process its own share of the data
rows = [{"input_ids": (ids := torch.randint(1, 64, (16,), generator=g)), "labels": ids} for _ in range(32)]
args = SparseSoupConfig(output_dir=str(out / f"train{rank}"), max_steps=4, per_device_train_batch_size=4,
                        learning_rate=1e-2, optim="adamw_torch", report_to="none", disable_tqdm=True, use_cpu=True,
                        save_strategy="no")  # fmt: skip
trainer = SparseSoupTrainer(model, args, masks=masks, train_dataset=rows)
shard_replica(trainer.model, dist.group.WORLD, "cpu")  # new DTensor parameters, after the masks were bound
trainer.train()
bound_sharded = all(is_sharded(p) for p in trainer.enforcer.params)
state = full_state_dict(trainer.model)
plain = full_model(trainer.model)  # every process takes part; rank 0 gets the model
if rank == 0:
    checks = {
        "masks_bound_to_the_sharded_parameters": bound_sharded,
        "exact": all(not state[n][~m].any() for n, m in masks.items()),
        "trained": any(not torch.equal(state[n], start[n]) for n in masks),
        "plain_is_the_gathered_model": all(torch.equal(plain.state_dict()[k], v) for k, v in state.items()),
        "plain_is_not_sharded": not any(is_sharded(p) for p in plain.parameters()),
        "ties_tied": plain.lm_head.weight is plain.model.embed_tokens.weight,
        "plain_class": type(plain).__name__,
    }
    save_sparse(plain, str(out / "saved"))
    (out / "checks.json").write_text(json.dumps(checks))
else:
    assert plain is None
dist.barrier()
dist.destroy_process_group()
# Leave without the interpreter's finalization: gloo's worker threads may still hold work whose tensors it would free
# without the GIL, which aborts the process ("terminate called without an active exception"; pytorch/pytorch#179291)
# after everything here succeeded. Every result is written and flushed above.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
