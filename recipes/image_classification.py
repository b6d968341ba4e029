"""Sparse Model Soups for timm image classifiers: ResNet-50 and MaxViT on ImageNet, or any timm model.

    accelerate launch --num_processes 5 recipes/image_classification.py --config recipes/configs/resnet50_imagenet.yaml
    accelerate launch recipes/image_classification.py --config recipes/configs/maxvit_imagenet.yaml
    # class subfolders in ./images/train and ./images/validation (reported), read by datasets' imagefolder
    python recipes/image_classification.py --output_dir out --dataset_name imagefolder --data_dir ./images
    python recipes/image_classification.py --smoke --output_dir smoke  # a tiny ResNet on PNGs, CPU, seconds
    # OOD accuracy per corruption and severity on ImageNet-C (<corruption>/<severity>/<wnid>/*.JPEG)
    accelerate launch recipes/image_classification.py --config recipes/configs/resnet50_imagenet.yaml \
        --ood --ood_dir data/ImageNet-C

Items reach the model as ``{"x": image tensor, "labels": class}``, the argument name of timm's forward.
Soups are selected on ``validation_fraction`` of the train split (fixed seed) under the evaluation transform;
``--test_split`` (ImageNet's validation set by default) is only reported. The data fields
(``hf_sms.cli.scripts.DataArguments``) are shared by all recipes; ``DATA_DEFAULTS`` fills those left unset.
"""

import json
from dataclasses import dataclass, field

import timm
import torch

from hf_sms import SparseModelSoup, SparseSoupConfig
from hf_sms.cli.scripts import (
    DataArguments,
    OODArguments,
    finish,
    load_splits,
    parse_args,
    prepared_splits,
    public_weights_note,
    stack_collate,
)
from hf_sms.cli.smoke import smoke_imagefolder, smoke_imagenet_c
from hf_sms.evaluation import ClassificationAccuracy

DATA_DEFAULTS = dict(dataset_name="imagenet-1k", test_split="validation")


@dataclass
class ModelArguments:
    model_name: str = field(default="resnet50", metadata={"help": "timm model name, or hf-hub:/local-dir: path."})
    pretrained: bool = field(default=True, metadata={"help": "Load timm's pretrained weights (the dense model)."})
    num_classes: int | None = field(default=None, metadata={"help": "Default: the number of dataset labels."})
    model_kwargs: str | None = field(
        default=None, metadata={"help": 'JSON for timm.create_model, e.g. {"img_size": 224}'}
    )
    image_size: int | None = field(default=None, metadata={"help": "Input size (default: the model's)."})
    label_smoothing: float = field(default=0.0, metadata={"help": "Label smoothing of the cross-entropy loss."})


def smoke(folder: str) -> dict:
    """--smoke: a ResNet-18 layout with one narrow block per stage, no pretrained weights, on 32 px PNGs; with
    --ood, an ImageNet-C-shaped tree of noisy copies of the validation images."""
    tiny = json.dumps({"layers": [1, 1, 1, 1], "channels": [8, 16, 16, 16]})
    model = {"model_name": "resnet18", "pretrained": False, "model_kwargs": tiny, "image_size": 32}
    data = smoke_imagefolder(folder)
    ood = {"ood_dir": smoke_imagenet_c(data["data_dir"], folder), "ood_severities": [1, 2]}
    return {**model, **data, **ood}


def main(model_args: ModelArguments, data_args: DataArguments, ood_args: OODArguments, args: SparseSoupConfig):
    data_args = data_args.with_defaults(**DATA_DEFAULTS)
    raw = load_splits(data_args)
    num_classes = model_args.num_classes or raw["train"].features[data_args.label_column].num_classes
    kwargs = json.loads(model_args.model_kwargs) if model_args.model_kwargs else {}
    if model_args.image_size and "maxvit" in model_args.model_name:
        kwargs.setdefault("img_size", model_args.image_size)  # MaxViT fixes its window grid at construction
    model = timm.create_model(
        model_args.model_name, pretrained=model_args.pretrained, num_classes=num_classes, **kwargs
    )
    data_cfg = timm.data.resolve_data_config(model=model)
    if model_args.image_size:
        data_cfg["input_size"] = (3, model_args.image_size, model_args.image_size)

    def transform(training):
        tf = timm.data.create_transform(**data_cfg, is_training=training)

        def apply(batch):
            x = [tf(img.convert("RGB")) for img in batch[data_args.image_column]]
            return {"x": x, "labels": batch[data_args.label_column]}

        return apply

    train, val, test = prepared_splits(
        raw, lambda data, training: data.with_transform(transform(training)), args, data_args
    )
    args.remove_unused_columns = False  # the transform makes the columns forward() takes
    loss = None
    if model_args.label_smoothing:

        def loss(outputs, labels, num_items_in_batch=None):
            return torch.nn.functional.cross_entropy(outputs, labels, label_smoothing=model_args.label_smoothing)

    accuracy = ClassificationAccuracy(collate_fn=stack_collate)
    tests = {"test": test}
    if ood_args.ood:  # ImageNet-C (--ood_dir) or corruptions made on the fly: accuracy per corruption and severity
        evaluate = timm.data.create_transform(**data_cfg, is_training=False)
        tests["ood"] = ood_args.test_set(raw[data_args.test_split], data_args, evaluate, accuracy, args.seed)
    notes = {"notes": [public_weights_note(f"timm/{model_args.model_name}")]} if model_args.pretrained else {}
    runner = SparseModelSoup(
        model,
        args,
        train,
        accuracy,
        eval_dataset=val,
        test_dataset=tests,
        data_collator=stack_collate,
        compute_loss_func=loss,
        model_card={"base_model": f"timm/{model_args.model_name}", "datasets": data_args.hub_datasets, **notes},
    )
    runner.run()
    finish(runner)
    return runner


if __name__ == "__main__":
    main(*parse_args(ModelArguments, DataArguments, OODArguments, SparseSoupConfig, smoke=smoke))
