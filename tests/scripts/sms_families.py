"""A tiny SMS run of one model family, launched by the parallel tests: ``python sms_families.py FAMILY OUT
[--structure S]``.

FAMILY is ``t5`` (transformers), ``timm`` or ``smp``. Run it with ``torchrun --nproc_per_node N`` or plainly;
replicas are saved as the family's own checkpoint folders by whichever process owns them, and the main process
writes OUT/soup.safetensors.
"""

import argparse
import gc
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import make_image_dataset, make_pspnet, make_resnet, make_t5, sms_config  # noqa: E402

from hf_sms import run_sms  # noqa: E402
from hf_sms.batchnorm import forward_batch  # noqa: E402
from hf_sms.training.trainer import cross_entropy_loss  # noqa: E402

gc.collect()
gc.freeze()  # the imports leave the cyclic collector's scans: the loop collects after every replica


class NegativeLoss:
    """``-mean loss`` over the data set: continuous, so any difference between runs shows."""

    name = "negative loss"

    @torch.no_grad()
    def __call__(self, model, dataset) -> float:
        model.eval()
        batch = torch.utils.data.default_collate(list(dataset))
        out = forward_batch(model, batch, keep_labels=hasattr(model, "generate"))
        loss = out.loss if hasattr(out, "loss") and out.loss is not None else cross_entropy_loss(out, batch["labels"])
        return -float(loss)


def t5_data():
    from transformers import ByT5Tokenizer

    words = "sparse model soups prune merge train hello world phase mask seed copy mean soup sum keep dense zero one"
    enc = ByT5Tokenizer()(
        words.split() + ["two"], padding="max_length", max_length=8, truncation=True, return_tensors="pt"
    )
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    rows = zip(enc.input_ids, enc.attention_mask, labels)
    return [{"input_ids": i, "attention_mask": a, "labels": y} for i, a, y in rows]


def segmentation_data(n=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g)
    return [{"x": x[i], "labels": (x[i, 0] > 0).long()} for i in range(n)]


parser = argparse.ArgumentParser()
parser.add_argument("family", choices=["t5", "timm", "smp"])
parser.add_argument("output_dir")
parser.add_argument("--structure", default="unstructured")
cli = parser.parse_args()

torch.set_num_threads(1)
model, data = {
    "t5": lambda: (make_t5(), t5_data()),
    "timm": lambda: (make_resnet(), make_image_dataset(24)),
    "smp": lambda: (make_pspnet(), segmentation_data()),
}[cli.family]()
args = sms_config(
    None, output_dir=cli.output_dir, target_sparsity=0.5, max_steps=3, per_device_train_batch_size=4,
    learning_rate=0.01, merge_methods=["uniform"], structure=cli.structure,
)  # fmt: skip
soup, results = run_sms(model, args, data[:16], NegativeLoss(), eval_dataset=data[16:], test_dataset=data[16:])
if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
    save_file({k: v.clone() for k, v in soup.state_dict().items()}, os.path.join(cli.output_dir, "soup.safetensors"))
