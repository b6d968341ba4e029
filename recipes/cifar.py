"""Sparse Model Soups on CIFAR-10/100 and CelebA with ResNet-18 and WRN-20: dense pretraining, then SMS.

    # ResNet-18 on CIFAR-10: pretrain 200 epochs, then SMS to 98% in 3 phases beside IMP and IMP_3x
    python recipes/cifar.py --config recipes/configs/resnet18_cifar10.yaml
    # WRN-20 on CIFAR-100 (Table 1), with OOD accuracy on the published CIFAR-100-C
    python recipes/cifar.py --config recipes/configs/wrn20_cifar100.yaml --ood --ood_dir data/CIFAR-100-C
    # CelebA: accuracy, balanced accuracy and subgroup recall (gender predicted per Blond_Hair), One Shot to 90%
    python recipes/cifar.py --config recipes/configs/resnet18_celeba.yaml
    # 3 GPUs train the 3 replicas of each phase at once, from an earlier run's dense model
    accelerate launch --num_processes 3 recipes/cifar.py --config recipes/configs/wrn20_cifar100.yaml \\
        --model_name_or_path runs/wrn20-cifar100-sms-dense --output_dir runs/wrn20-cifar100-sms-3gpu
    python recipes/cifar.py --smoke --output_dir smoke  # a tiny model on tiny data, CPU, seconds

Without ``--model_name_or_path`` the dense model is pretrained first (``hf_sms.cli.scripts.pretrain``, from the
``pretrain_*`` fields ALLR reads) into ``--dense_dir``, which a rerun reuses. Soups are selected on
``validation_fraction`` of train; the test split, ``--ood`` and ``--group_column`` are only reported.
"""

import json
import os
from dataclasses import dataclass, field

import timm
import torch.nn.functional as F
import torchvision.transforms as T
from torch import nn

from hf_sms import SparseModelSoup, SparseSoupConfig, load_sparse
from hf_sms.cli.scripts import (
    DataArguments,
    OODArguments,
    finish,
    load_splits,
    parse_args,
    prepared_splits,
    pretrain,
    stack_collate,
)
from hf_sms.cli.smoke import smoke_classification
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.evaluation.subgroups import binary_attribute

DATA_DEFAULTS = dict(dataset_name="uoft-cs/cifar10", test_split="test")


@dataclass
class ModelArguments:
    model_name: str = field(default="resnet18", metadata={"help": "wrn20, or a timm ResNet (resnet18, resnet34)."})
    model_kwargs: str | None = field(default=None, metadata={"help": "timm ResNets: JSON for timm.create_model."})
    cifar_stem: bool = field(default=True, metadata={"help": "timm ResNets: 3x3 stride-1 first conv, no max-pool."})
    depth: int = field(default=22, metadata={"help": "wrn20: depth 6n+4 (22, n=3: the paper's WRN-20)."})
    widen_factor: int = field(default=10, metadata={"help": "wrn20: width multiplier."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "A saved dense model: no pretraining."})
    dense_dir: str | None = field(default=None, metadata={"help": "Pretraining's folder (<output_dir>-dense)."})
    image_size: int = field(default=32, metadata={"help": "Images are resized and center-cropped to this square."})
    crop_padding: int = field(default=4, metadata={"help": "Training: random crop with this padding, then flip."})
    mean: list[float] = field(default_factory=lambda: [0.4914, 0.4822, 0.4465], metadata={"help": "Mean (CIFAR-10)."})
    std: list[float] = field(default_factory=lambda: [0.2470, 0.2435, 0.2616], metadata={"help": "Std (CIFAR-10)."})


class WideBlock(nn.Module):
    """Pre-activation wide block with biases and dropout, stride on the second conv, as the paper's code."""

    def __init__(self, c_in: int, c_out: int, stride: int, dropout: float):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(c_in), nn.Conv2d(c_in, c_out, 3, 1, 1)
        self.bn2, self.conv2 = nn.BatchNorm2d(c_out), nn.Conv2d(c_out, c_out, 3, stride, 1)
        self.dropout = nn.Dropout(dropout)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x):
        out = self.dropout(self.conv1(F.relu(self.bn1(x))))
        return self.conv2(F.relu(self.bn2(out))) + self.shortcut(x)


class WideResNet(nn.Module):
    """WideResNet (Zagoruyko & Komodakis 2016); the paper's WRN-20 is depth 22 (3 blocks per stage), widen 10."""

    def __init__(self, num_classes: int, depth: int = 22, widen_factor: int = 10, dropout: float = 0.3):
        super().__init__()
        n, widths = (depth - 4) // 6, [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        blocks = [
            WideBlock(widths[s] if b == 0 else widths[s + 1], widths[s + 1], stride if b == 0 else 1, dropout)
            for s, stride in enumerate((1, 2, 2))
            for b in range(n)
        ]
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), *blocks, nn.BatchNorm2d(widths[3]), nn.ReLU())
        self.fc = nn.Linear(widths[3], num_classes)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def build_model(model_args: ModelArguments, num_classes: int) -> nn.Module:
    """The freshly initialised model; also the template ``load_sparse(folder, model=...)`` loads a soup into."""
    if model_args.model_name == "wrn20":
        return WideResNet(num_classes, model_args.depth, model_args.widen_factor)
    kwargs = json.loads(model_args.model_kwargs) if model_args.model_kwargs else {}
    model = timm.create_model(model_args.model_name, pretrained=False, num_classes=num_classes, **kwargs)
    if model_args.cifar_stem:  # timm would rebuild its ImageNet stem from pretrained_cfg: save as plain torch
        model.conv1, model.maxpool = nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False), nn.Identity()
        del model.pretrained_cfg, model.default_cfg
    return model


def smoke(folder: str) -> dict:
    """--smoke: one narrow block per stage (ResNet) or a width-1 WRN-10, pretrained for one epoch."""
    tiny = {"model_kwargs": '{"layers": [1, 1, 1, 1], "channels": [8, 16, 16, 16]}', "depth": 10, "widen_factor": 1}
    ood = {"ood_corruptions": ["gaussian_noise", "fog"], "ood_severities": [1, 5]}
    dense = {"image_size": 32, "pretrain_epochs": 1, "dense_dir": os.path.join(folder, "dense")}
    return {**tiny, **ood, **dense, **smoke_classification(folder)}


def main(model_args: ModelArguments, data_args: DataArguments, ood_args: OODArguments, args: SparseSoupConfig):
    data_args = data_args.with_defaults(**DATA_DEFAULTS)
    raw = load_splits(data_args)
    label = raw["train"].features[data_args.label_column]  # a ClassLabel, else a binary attribute (CelebA)
    to_label = int if hasattr(label, "num_classes") else binary_attribute
    model = build_model(model_args, getattr(label, "num_classes", 2))
    size, group = model_args.image_size, data_args.group_column

    def transform(training):
        augment = [T.RandomCrop(size, padding=model_args.crop_padding), T.RandomHorizontalFlip()] if training else []
        normalize = T.Normalize(model_args.mean, model_args.std)
        return T.Compose([T.Resize(size), T.CenterCrop(size), *augment, T.ToTensor(), normalize])

    def prepare(data, training):
        tf = transform(training)

        def apply(batch):
            out = {"x": [tf(img.convert("RGB")) for img in batch[data_args.image_column]]}
            out["labels"] = [to_label(y) for y in batch[data_args.label_column]]
            return {**out, "group": [binary_attribute(g) for g in batch[group]]} if group else out

        return data.with_transform(apply)

    train, val, test = prepared_splits(raw, prepare, args, data_args)
    args.remove_unused_columns = False  # the transform makes the columns forward() takes
    accuracy = ClassificationAccuracy(collate_fn=stack_collate)  # stack_collate leaves the group attribute out
    tests = {"test": test}
    if group:  # worst-group recall and balanced accuracy (the paper's CelebA table)
        tests["subgroups"] = (test, data_args.subgroup_metric(stack_collate))
        tests["balanced"] = (test, data_args.subgroup_metric(stack_collate, score="balanced"))
    if ood_args.ood:
        tests["ood"] = ood_args.test_set(raw[data_args.test_split], data_args, transform(False), accuracy, args.seed)
    if model_args.model_name_or_path:
        model = load_sparse(model_args.model_name_or_path, model).train()
    else:
        dense_dir = model_args.dense_dir or args.output_dir.rstrip("/") + "-dense"
        model = pretrain(model, args, train, dense_dir, data_collator=stack_collate)
    card = {"datasets": data_args.hub_datasets}
    runner = SparseModelSoup(
        model, args, train, accuracy, eval_dataset=val, test_dataset=tests, data_collator=stack_collate, model_card=card
    )
    runner.run()
    finish(runner)
    return runner


if __name__ == "__main__":
    main(*parse_args(ModelArguments, DataArguments, OODArguments, SparseSoupConfig, smoke=smoke))
