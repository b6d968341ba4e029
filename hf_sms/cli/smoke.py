"""``--smoke`` for the recipes: the settings that run a whole recipe on CPU in seconds, and tiny data written in
the forms users give their own (JSON lines, image folders, ``save_to_disk``), so the same loading code runs."""

from __future__ import annotations

import json
import os

import numpy as np

from ..atomic import atomic_write

# What --smoke sets on top of the YAML (flags still override): the whole pipeline on CPU in seconds.
SMOKE_ARGS = dict(
    output_dir="smoke-output",
    use_cpu=True,
    bf16=False,
    fp16=False,
    target_sparsity=0.5,
    n_phases=2,
    num_replicas=2,
    max_steps=2,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    dataloader_num_workers=0,
    baselines=["imp", "imp_mx"],
    push_to_hub=False,
    disable_tqdm=True,
    report_to="none",
    seed=0,
)


def _smoke_images(n: int, size: int = 32, num_classes: int = 4, seed: int = 0) -> tuple[list, list[int]]:
    """``n`` RGB images whose class ``y`` brightens colour channel ``y`` (class 3 stays dark), and the classes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    labels = [i % num_classes for i in range(n)]
    images = []
    for y in labels:
        pixels = rng.normal(60, 25, (size, size, 3))
        if y < 3:
            pixels[..., y] += 140
        images.append(Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)))
    return images, labels


def smoke_translation(folder: str) -> dict:
    """JSON-lines pairs ``{"translation": {"en", "de", "ro"}}`` (train, validation, test); the data fields."""
    files = {}
    for split, n in (("train", 40), ("validation", 6), ("test", 8)):
        path = files[f"{split}_file"] = os.path.join(folder, f"{split}.jsonl")
        with atomic_write(path) as f:
            for i in range(n):
                pair = {"en": f"the house {i}", "de": f"das Haus {i}", "ro": f"casa {i}"}
                f.write(json.dumps({"translation": pair}) + "\n")
    return files


def smoke_text(folder: str) -> dict:
    """JSON-lines ``{"text": ...}`` (train, validation, test) of counting sentences a tiny LM can learn a little
    of; the data fields."""
    files = {}
    for split, (start, n) in {"train": (0, 60), "validation": (60, 10), "test": (70, 10)}.items():
        path = files[f"{split}_file"] = os.path.join(folder, f"{split}.jsonl")
        with atomic_write(path) as f:
            for i in range(start, start + n):
                f.write(json.dumps({"text": f"count {i}: {i + 1}, {i + 2}, {i + 3}. "}) + "\n")
    return files


def smoke_imagefolder(folder: str) -> dict:
    """Class subfolders of PNGs in ``train/`` and ``validation/`` (datasets' imagefolder); the data fields."""
    root = os.path.join(folder, "images")
    for split, n, seed in (("train", 40, 0), ("validation", 16, 1)):
        for i, (image, y) in enumerate(zip(*_smoke_images(n, seed=seed))):
            os.makedirs(os.path.join(root, split, f"class{y}"), exist_ok=True)
            image.save(os.path.join(root, split, f"class{y}", f"{i}.png"))
    return {"dataset_name": "imagefolder", "data_dir": root}


def smoke_imagenet_c(imagefolder: str, folder: str) -> str:
    """ImageNet-C's layout (``<corruption>/<severity>/<class>/<file>``) of noisy copies of ``imagefolder``'s
    validation images, in ``folder``; returns its root."""
    import numpy as np
    from PIL import Image

    root = os.path.join(folder, "imagenet-c")
    source = os.path.join(imagefolder, "validation")
    rng = np.random.default_rng(0)
    for severity in (1, 2):
        for label in sorted(os.listdir(source)):
            out = os.path.join(root, "gaussian_noise", str(severity), label)
            os.makedirs(out, exist_ok=True)
            for name in sorted(os.listdir(os.path.join(source, label))):
                image = np.asarray(Image.open(os.path.join(source, label, name)).convert("RGB"), dtype=np.float32)
                noisy = np.clip(image + rng.normal(0, 20 * severity, image.shape), 0, 255).astype(np.uint8)
                Image.fromarray(noisy).save(os.path.join(out, name))
    return root


def smoke_classification(folder: str) -> dict:
    """A ``DatasetDict`` (train, test) saved with ``save_to_disk``, with the columns of CIFAR-10 (``img``,
    ``label``), CIFAR-100 (``fine_label``) and CelebA (``image``, ``Blond_Hair``, ``Male``), so that any of their
    configs runs on it; the data fields."""
    import datasets

    def split(n: int, seed: int):
        images, labels = _smoke_images(n, seed=seed)
        male = np.random.default_rng(seed).random(n) < 0.5
        classes = datasets.ClassLabel(names=[f"class{c}" for c in range(4)])
        features = datasets.Features(
            img=datasets.Image(),
            image=datasets.Image(),
            label=classes,
            fine_label=classes,
            Blond_Hair=datasets.Value("bool"),
            Male=datasets.Value("bool"),
        )
        columns = dict(img=images, image=images, label=labels, fine_label=labels)
        columns.update(Blond_Hair=[y >= 2 for y in labels], Male=male.tolist())
        return datasets.Dataset.from_dict(columns, features=features)

    path = os.path.join(folder, "classification")
    datasets.DatasetDict(train=split(48, 0), test=split(16, 1)).save_to_disk(path)
    return {"dataset_path": path}


def smoke_segmentation(folder: str) -> dict:
    """A ``DatasetDict`` (train, validation) of ``image`` and ``mask`` (the bright right half is class 1, one
    pixel is the ignore label 255) saved with ``save_to_disk``; the data fields."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)

    def split(n: int):
        images, masks = [], []
        for _ in range(n):
            mask = np.zeros((24, 24), dtype=np.uint8)
            mask[:, 12:], mask[0, 0] = 1, 255
            pixels = rng.random((24, 24, 3)) * 50 + mask[..., None].clip(0, 1) * 150
            images.append(Image.fromarray(pixels.astype(np.uint8)))
            masks.append(Image.fromarray(mask))
        return datasets.Dataset.from_dict({"image": images, "mask": masks}).cast_column("image", datasets.Image())

    path = os.path.join(folder, "segmentation")
    datasets.DatasetDict(train=split(8), validation=split(4)).save_to_disk(path)
    return {"dataset_path": path}
