"""m replicas of one pruned model, each sharded by FSDP2 over every process (gloo), trained with hf-sms' mask
enforcement (the policy SparseSoupTrainer runs), souped shard by shard and saved from the shards.

    torchrun --nproc_per_node 2 tests/scripts/fsdp_replicas.py OUT_DIR OPTIM

Each process trains on its half of every batch (FSDP's data parallelism), so one process training on whole batches
computes the same replicas (tests/test_sharding.py). Writes OUT_DIR/soup (the soup's folder) and OUT_DIR/checks.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared task
from sharded_task import OPTIMS, REPLICAS, STEPS, batch, build, pruned_start  # noqa: E402

from hf_sms.pruning.enforcement import ExactMasking, MaskEnforcer  # noqa: E402
from hf_sms.pruning.masks import masks_from_model  # noqa: E402
from hf_sms.training.sharding import local_state, save_sharded, sharded_soup  # noqa: E402

out, optim = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
start, masks = pruned_start()


def sharded():
    model = build()
    model.load_state_dict(start.state_dict())
    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


checks = {"exact_after_every_step": True, "mask_shard_shapes": True}
candidates = []
for i in range(REPLICAS):
    model = sharded()
    enforcer = MaskEnforcer(model, masks)
    checks["mask_shard_shapes"] &= all(
        m.to_local().shape == p.to_local().shape for m, p in zip(enforcer._device_masks, enforcer.params)
    )
    policy = ExactMasking()
    policy.bind(enforcer)
    opt = OPTIMS[optim](model.parameters())
    policy.start(opt)
    for step in range(STEPS):
        x, y = batch(i, step)
        half = len(x) // world
        x, y = x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]
        torch.nn.functional.mse_loss(model(x), y).backward()
        policy.before_step()
        opt.step()
        policy.after_step(opt)
        opt.zero_grad()
        for p, m in zip(enforcer.params, enforcer._device_masks):
            checks["exact_after_every_step"] &= bool((p.to_local()[m.to_local() == 0] == 0).all())
    checks[f"logged_sparsity{i}"] = policy.sparsity()  # what the trainer logs, over the sharded weights
    candidates.append(local_state(model))
soup = sharded_soup(sharded(), candidates)
with torch.device("meta"):
    template = build()
save_sharded(soup, os.path.join(out, "soup"), template, "bitmask", recipe={"m": REPLICAS})
full_masks = masks_from_model(template) if rank == 0 else None
if rank == 0:
    checks["soup_mask_is_the_mask"] = all(torch.equal(full_masks[k], masks[k]) for k in masks)
    with open(os.path.join(out, "checks.json"), "w") as f:
        json.dump(checks, f)
dist.barrier()
dist.destroy_process_group()
# Leave without the interpreter's finalization: gloo's worker threads may still hold work whose tensors it would free
# without the GIL, which aborts the process ("terminate called without an active exception"; pytorch/pytorch#179291)
# after everything here succeeded. Every result is written and flushed above.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
