"""Evaluation shared by N processes (torchrun, gloo) or one (plain python): every built-in metric, an ``evaluate``
module and BatchNorm recalibration over augmented data, on fixed models and data; each rank writes its values and
how many examples it read.

    python eval_shards.py OUT METRIC_SCRIPT            # one process
    torchrun --nproc_per_node 3 eval_shards.py OUT METRIC_SCRIPT
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import load_digits_splits
from hf_sms.evaluation import (
    BleuMetric,
    ClassificationAccuracy,
    MeanIoU,
    MeanOverSets,
    SubgroupRecall,
    evaluate,
    measure,
)
from hf_sms.evaluation.metrics import EvaluateMetric
from hf_sms.evaluation.sharded import recalibrate_shared
from hf_sms.loop.distributed import ReplicaWorld

torch.set_num_threads(1)
out, script = Path(sys.argv[1]), sys.argv[2]
world = ReplicaWorld(num_replicas=1, cpu=True)
reads = {"n": 0}


class Counted(torch.utils.data.Dataset):
    """A dataset that counts the examples this process reads."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        reads["n"] += 1
        return self.items[i]


torch.manual_seed(0)
train, val, test = load_digits_splits(seed=0)
digits = Counted([val[i] for i in range(len(val))])
cnn = DigitsResNet(width=4).eval()
values = {"accuracy": evaluate(ClassificationAccuracy(batch_size=32), cnn, digits, world)}

ood = {("noise", 1): Counted([test[i] for i in range(50)]), ("noise", 2): Counted([test[i] for i in range(50, 130)])}
grouped = Counted([{**val[i], "group": i % 3} for i in range(len(val))])
values["groups"] = measure(SubgroupRecall(batch_size=32), cnn, grouped, world)  # value and every subgroup's recall
values["ood"] = measure(MeanOverSets(ClassificationAccuracy(batch_size=16)), cnn, ood, world)[0]


class Seg(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 3, 1)

    def forward(self, x):  # batch keys are forward's argument names
        return self.b(torch.relu(self.a(x)))


seg = Seg().eval()
g = torch.Generator().manual_seed(1)
pixels = Counted([{"x": torch.randn(3, 8, 8, generator=g), "labels": torch.randint(0, 3, (8, 8), generator=g)}
                  for _ in range(37)])  # fmt: skip
values["miou"] = evaluate(MeanIoU(num_classes=3, batch_size=4), seg, pixels, world)

from transformers import ByT5Tokenizer  # noqa: E402


class Echo(nn.Module):
    """A seq2seq stand-in whose generation is its input with one word dropped in every third sentence."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, attention_mask, **kwargs):
        out = input_ids.clone()
        out[::3, 4:8] = tok.pad_token_id
        return torch.cat([torch.zeros_like(out[:, :1]), out], 1)  # the decoder start token, as generate gives


tok = ByT5Tokenizer()
words = [f"the cat {i} sat on a mat" for i in range(21)]
enc = tok(words, padding="max_length", max_length=32, truncation=True, return_tensors="pt")
pairs = Counted([{"input_ids": enc.input_ids[i], "attention_mask": enc.attention_mask[i], "labels": enc.input_ids[i]}
                 for i in range(len(words))])  # fmt: skip
t5 = Echo()
values["bleu"] = evaluate(BleuMetric(tok, max_new_tokens=6, batch_size=4), t5, pairs, world)

import evaluate as hf_evaluate  # noqa: E402

module = EvaluateMetric(hf_evaluate.load(script), key="accuracy", batch_size=32)
values["evaluate"] = evaluate(module, cnn, digits, world)
values["plain"] = evaluate(lambda model, data: float(len(data)) + world.rank * 1000, cnn, digits, world)

# BatchNorm statistics over 11 batches of 16 randomly shifted images (the augmentation draws torch's generator)
bn = recalibrate_shared(DigitsResNet(width=4), Counted(train), 16, world, seed=3, max_batches=11)
values["batchnorm"] = {k: v.tolist() for k, v in bn.state_dict().items() if "running" in k or "batches" in k}


class DropoutBeforeBN(nn.Module):
    """Dropout feeding a BatchNorm (the WRN recipe's block): its statistics depend on the dropout draws."""

    def __init__(self):
        super().__init__()
        self.conv, self.drop, self.bn = nn.Conv2d(1, 6, 3), nn.Dropout(0.5), nn.BatchNorm2d(6)

    def forward(self, x):
        return self.bn(self.drop(self.conv(x)))


# loader workers read the items; the dropout draws happen in the process that runs the forward
net = DropoutBeforeBN()
torch.manual_seed(5 + world.rank)  # each process's generator elsewhere: the pass must not depend on it
workers = {"num_workers": 2}
bn = recalibrate_shared(net, train, 16, world, seed=3, max_batches=7, loader_kwargs=workers)
values["dropout_bn"] = {k: v.tolist() for k, v in bn.state_dict().items() if "running" in k}

(out / f"rank{world.rank}.json").write_text(json.dumps({"values": values, "reads": reads["n"], "size": world.size}))
