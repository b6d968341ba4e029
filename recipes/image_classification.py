"""Sparse Model Soups for timm image classifiers: ResNet-50 and MaxViT on ImageNet, or any timm model.

    accelerate launch --num_processes 5 recipes/image_classification.py --config recipes/configs/resnet50_imagenet.yaml
    accelerate launch recipes/image_classification.py --config recipes/configs/maxvit_imagenet.yaml
    # a local folder of class subfolders (datasets' imagefolder builder)
    python recipes/image_classification.py --output_dir out --dataset_name imagefolder --data_dir ./images

Items reach the model as ``{"x": image tensor, "labels": class}``, the argument name of timm's forward.
Soups are selected on ``validation_fraction`` of the train split (fixed seed) under the evaluation transform;
``--test_split`` is only reported.
"""

import json
from dataclasses import dataclass, field

import timm
import torch

from hf_sms import SparseModelSoup, SparseSoupConfig
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.scripts import finish, load_splits, parse_args, prepared_splits, stack_collate


@dataclass
class ScriptArguments:
    model_name: str = field(default="resnet50", metadata={"help": "timm model name, or hf-hub:/local-dir: path."})
    pretrained: bool = field(default=True, metadata={"help": "Load timm's pretrained weights (the dense model)."})
    num_classes: int | None = field(default=None, metadata={"help": "Default: the number of dataset labels."})
    model_kwargs: str | None = field(
        default=None, metadata={"help": 'JSON for timm.create_model, e.g. {"img_size": 224}'}
    )
    image_size: int | None = field(default=None, metadata={"help": "Input size (default: the model's)."})
    dataset_name: str | None = field(default="imagenet-1k", metadata={"help": "Hub dataset or builder name."})
    dataset_config: str | None = None
    dataset_path: str | None = field(default=None, metadata={"help": "A DatasetDict saved with save_to_disk."})
    data_dir: str | None = None
    image_column: str = "image"
    label_column: str = "label"
    test_split: str = field(default="validation", metadata={"help": "Reported only (ImageNet's val set)."})
    label_smoothing: float = 0.0


def main(script_args: ScriptArguments, args: SparseSoupConfig):
    raw = load_splits(
        script_args.dataset_name, script_args.dataset_config, script_args.dataset_path, script_args.data_dir
    )
    num_classes = script_args.num_classes or raw["train"].features[script_args.label_column].num_classes
    kwargs = json.loads(script_args.model_kwargs) if script_args.model_kwargs else {}
    if script_args.image_size and "maxvit" in script_args.model_name:
        kwargs.setdefault("img_size", script_args.image_size)  # MaxViT fixes its window grid at construction
    model = timm.create_model(
        script_args.model_name, pretrained=script_args.pretrained, num_classes=num_classes, **kwargs
    )
    data_cfg = timm.data.resolve_data_config(model=model)
    if script_args.image_size:
        data_cfg["input_size"] = (3, script_args.image_size, script_args.image_size)

    def transform(training):
        tf = timm.data.create_transform(**data_cfg, is_training=training)

        def apply(batch):
            x = [tf(img.convert("RGB")) for img in batch[script_args.image_column]]
            return {"x": x, "labels": batch[script_args.label_column]}

        return apply

    train, val, test = prepared_splits(
        raw, lambda data, training: data.with_transform(transform(training)), args, script_args.test_split
    )
    args.remove_unused_columns = False  # the transform makes the columns forward() takes
    loss = None
    if script_args.label_smoothing:

        def loss(outputs, labels, num_items_in_batch=None):
            return torch.nn.functional.cross_entropy(outputs, labels, label_smoothing=script_args.label_smoothing)

    accuracy = ClassificationAccuracy(collate_fn=stack_collate)
    runner = SparseModelSoup(
        model,
        args,
        train,
        accuracy,
        eval_dataset=val,
        test_dataset=test,
        data_collator=stack_collate,
        compute_loss_func=loss,
        model_card={"base_model": f"timm/{script_args.model_name}", "datasets": [script_args.dataset_name]},
    )
    runner.run()
    finish(runner)
    return runner


if __name__ == "__main__":
    main(*parse_args(ScriptArguments, SparseSoupConfig))
