"""A tiny SMS run on digits, launched by the parallel tests: ``python sms_digits.py OUT [--replicas M]``.

Run it with ``torchrun --nproc_per_node N`` or plainly; the main process writes OUT/soup.safetensors.
"""

import argparse
import atexit
import gc
import json
import os

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

from hf_sms import SparseSoupConfig, run_sms
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy, MeanOverSets, SubgroupRecall
from hf_sms.pruning.masks import is_sharded

gc.collect()
gc.freeze()  # the imports leave the cyclic collector's scans: the loop collects after every replica

parser = argparse.ArgumentParser()
parser.add_argument("output_dir")
parser.add_argument("--replicas", type=int, default=2)
parser.add_argument("--phases", type=int, default=2)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--baselines", nargs="*", default=[])
parser.add_argument("--per-phase", type=int, nargs="*", default=None, help="m of each phase")
parser.add_argument("--pruning-method", default="imp", help="imp, or gmp/dpf (then --steps is the whole budget)")
parser.add_argument("--merge-methods", nargs="*", default=None, help="soup methods (default: greedy; DPF: uniform)")
parser.add_argument("--share", action="store_true", help="share_idle_groups: a lone last job over idle groups")
parser.add_argument("--replica-params", default="all", help="what a replica trains (all, bias_norm, mask_lora, ...)")
parser.add_argument("--pairwise", action="store_true", help="pairwise_soups: score every pair's soup")
parser.add_argument("--sharding", default="none", help="replica_sharding: none, or fsdp (a replica over its group)")
parser.add_argument("--learned-steps", type=int, default=None, help="the learned soup's fit length (default: 500)")
parser.add_argument("--eval-copies", type=int, default=1, help="validation and test sets repeated (benchmarks)")
cli = parser.parse_args()

torch.set_num_threads(1)
train, val, test = load_digits_splits(seed=0)
train = TensorDictDataset(train.x[:256], train.labels[:256], train.augment)
k = cli.eval_copies
val, test = (TensorDictDataset(d.x.repeat(k, 1, 1, 1), d.labels.repeat(k)) for d in (val, test))
torch.manual_seed(0)
model = DigitsResNet(width=4)
accuracy = ClassificationAccuracy()
args = SparseSoupConfig(
    output_dir=cli.output_dir,
    target_sparsity=0.8,
    n_phases=cli.phases,
    num_replicas=cli.replicas,
    max_steps=cli.steps,
    per_device_train_batch_size=32,
    learning_rate=0.05,
    optim="sgd",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
    baselines=cli.baselines,
    pruning_method=cli.pruning_method,
    pruning_steps=2,
    merge_methods=cli.merge_methods or (["uniform"] if cli.pruning_method == "dpf" else ["greedy"]),  # DPF: the mean
    replicas_per_phase=cli.per_phase,
    share_idle_groups=cli.share,
    replica_params=cli.replica_params,
    lora_rank=2,
    pairwise_soups=cli.pairwise,
    replica_sharding=cli.sharding,
    soup_options={"learned": {"steps": cli.learned_steps}} if cli.learned_steps else {},
)
noisy = TensorDictDataset(
    test.x + 0.3 * torch.randn(test.x.shape, generator=torch.Generator().manual_seed(0)), test.labels
)
grouped = [{**test[i], "group": i % 2} for i in range(len(test))]
tests = {  # named test sets reach every row in the parallel path too
    "test": test,
    "ood": ({("noise", 1): noisy, ("noise", 2): TensorDictDataset(noisy.x * 2, test.labels)}, MeanOverSets(accuracy)),
    "groups": (grouped, SubgroupRecall()),
}
# registered before run_sms, so it runs after hf-sms's own exit handler: the group must be closed by then
# (one file per rank: the ranks share stdout, where their lines can interleave; RANK is read now, as hf-sms
# hides the launcher's variables once its replica groups exist)
exit_file = os.path.join(cli.output_dir, f"exit-rank{os.environ.get('RANK', 0)}.txt")
atexit.register(lambda: open(exit_file, "w").write("open" if torch.distributed.is_initialized() else "closed"))
rank = os.environ.get("RANK", "0")


class HeldByThisProcess(TrainerCallback):
    """After each training step: the elements of the replica's parameters this process holds, of how many
    (``--sharding fsdp``: a shard of each; OUT/held-rank{R}.json)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        params = list(model.parameters())
        local = [p.to_local() if is_sharded(p) else p for p in params]
        sharded = all(is_sharded(p) for p in params)
        record = {"sharded": sharded, "held": sum(t.numel() for t in local), "of": sum(p.numel() for p in params)}
        with open(os.path.join(cli.output_dir, f"held-rank{rank}.json"), "a") as f:
            f.write(json.dumps(record) + "\n")


callbacks = [HeldByThisProcess()] if cli.sharding != "none" else None
soup, results = run_sms(model, args, train, accuracy, eval_dataset=val, test_dataset=tests, callbacks=callbacks)
with open(os.path.join(cli.output_dir, f"env-rank{rank}.txt"), "w") as f:  # the launcher's variables, back
    f.write(" ".join(f"{k}={os.environ.get(k)}" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")))
if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
    save_file(
        {k: v.contiguous() for k, v in soup.state_dict().items()}, os.path.join(cli.output_dir, "soup.safetensors")
    )
