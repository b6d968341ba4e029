"""Sparse Model Soups for semantic segmentation with segmentation_models_pytorch's PSPNet (mean IoU).

    accelerate launch --num_processes 3 recipes/pspnet_segmentation.py --config recipes/configs/pspnet_cityscapes.yaml
    # a DatasetDict saved with save_to_disk, with `image` and `mask` columns
    python recipes/pspnet_segmentation.py --output_dir out --dataset_path ./my_segmentation --num_classes 19
    python recipes/pspnet_segmentation.py --smoke --output_dir smoke  # a small ResNet-18 PSPNet on 24 px images, CPU

Needs the `seg` extra (``pip install hf-sms[seg]``). Mask pixels equal to ``--ignore_label`` are ignored.
Soups are selected on ``validation_fraction`` of the train split (fixed seed), not flipped; ``--test_split``
(the validation split by default, as Cityscapes' test labels are hidden) is only reported. The data fields
(``hf_sms.cli.scripts.DataArguments``) are shared by all recipes; ``DATA_DEFAULTS`` fills those left unset.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from hf_sms import SparseModelSoup, SparseSoupConfig
from hf_sms.cli.scripts import (
    DataArguments,
    finish,
    load_splits,
    parse_args,
    prepared_splits,
    public_weights_note,
    stack_collate,
)
from hf_sms.cli.smoke import smoke_segmentation
from hf_sms.evaluation import MeanIoU

DATA_DEFAULTS = dict(test_split="validation")
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


@dataclass
class ModelArguments:
    # The paper's PSPNet (68M weights: Zhao et al.'s, a dilated ResNet-101 and a 3x3 bottleneck) as close as smp builds
    # it: a ResNet-101 encoder of all five stages, dilated to output stride 8, 8x upsampling (48.9M weights).
    encoder_name: str = field(default="resnet101", metadata={"help": "smp encoder of the PSPNet."})
    encoder_depth: int = field(default=5, metadata={"help": "Encoder stages used (smp's default 3 drops two)."})
    output_stride: int = field(default=8, metadata={"help": "Encoder output stride (8: dilated, as Zhao et al.)."})
    encoder_weights: str | None = field(default="imagenet", metadata={"help": "Pretrained encoder weights."})
    model_path: str | None = field(default=None, metadata={"help": "A dense PSPNet saved with save_pretrained."})
    num_classes: int = field(default=19, metadata={"help": "Number of classes (Cityscapes: 19)."})
    crop_size: int = field(default=512, metadata={"help": "Images and masks are resized to this square."})
    ignore_label: int = field(default=255, metadata={"help": "Mask value that the loss and mean IoU ignore."})


def smoke(folder: str) -> dict:
    """--smoke: a PSPNet on 3 stages of timm's ResNet-18 without pretrained weights, two classes, 32 px crops
    (smp's own ``resnet18`` keeps its unused stages: 11M weights where 0.8M are used)."""
    model = {"encoder_name": "tu-resnet18", "encoder_weights": None, "model_path": None, "num_classes": 2}
    model |= {"encoder_depth": 3, "output_stride": 32}  # small and fast: the smoke checks the path, not the size
    return {**model, "crop_size": 32, **smoke_segmentation(folder)}


def main(model_args: ModelArguments, data_args: DataArguments, args: SparseSoupConfig):
    import segmentation_models_pytorch as smp

    data_args = data_args.with_defaults(**DATA_DEFAULTS)
    raw = load_splits(data_args)
    if model_args.model_path:
        model = smp.from_pretrained(model_args.model_path)
    else:
        model = smp.PSPNet(
            model_args.encoder_name,
            encoder_weights=model_args.encoder_weights,
            encoder_depth=model_args.encoder_depth,
            classes=model_args.num_classes,
            output_stride=model_args.output_stride,
        )
    weights = sum(p.numel() for p in model.parameters()) / 1e6
    size_note = f"PSPNet of {weights:.1f}M weights (smp, {model_args.encoder_name}); the paper's has 68M"
    size = (model_args.crop_size, model_args.crop_size)

    def transform(training):
        def apply(batch):
            xs, ys = [], []
            for img, mask in zip(batch[data_args.image_column], batch[data_args.mask_column]):
                x = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
                y = torch.from_numpy(np.asarray(mask, dtype=np.int64))
                x = F.interpolate(x[None], size, mode="bilinear", align_corners=False)[0]
                y = F.interpolate(y[None, None].float(), size, mode="nearest")[0, 0].long()
                if training and torch.rand(()) < 0.5:
                    x, y = x.flip(-1), y.flip(-1)
                xs.append((x - MEAN) / STD)
                ys.append(y.masked_fill(y == model_args.ignore_label, -100))
            return {"x": xs, "labels": ys}

        return apply

    train, val, test = prepared_splits(
        raw, lambda data, training: data.with_transform(transform(training)), args, data_args
    )
    args.remove_unused_columns = False  # the transform makes the columns forward() takes
    miou = MeanIoU(model_args.num_classes, batch_size=args.per_device_eval_batch_size, collate_fn=stack_collate)
    card = {"datasets": data_args.hub_datasets, "notes": [size_note]}  # said at the start, in results.json and card
    if model_args.encoder_weights and not model_args.model_path:  # ImageNet weights never saw the segmentation data
        encoder = f"{model_args.encoder_name} encoder ({model_args.encoder_weights})"
        card["notes"].append(public_weights_note(encoder, saw_validation=False))
    runner = SparseModelSoup(
        model, args, train, miou, eval_dataset=val, test_dataset=test, data_collator=stack_collate, model_card=card
    )
    runner.run()
    finish(runner)
    return runner


if __name__ == "__main__":
    main(*parse_args(ModelArguments, DataArguments, SparseSoupConfig, smoke=smoke))
