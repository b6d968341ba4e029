"""Data helpers: the validation split (docs/method.md §4) and the offline digits data set of the demo."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from .seeding import derive_seed

# The validation split never depends on a run's seed (the paper's code splits with a fixed seed): a dense model
# trained once and reused by runs of several seeds never sees any of those runs' validation examples.
VALIDATION_SEED = 0


def split_validation(train_dataset, fraction: float, seed: int = VALIDATION_SEED):
    """Split ``fraction`` of ``train_dataset`` off for validation with a fixed seed: ``(train, validation)``."""
    if not hasattr(train_dataset, "train_test_split") and not hasattr(train_dataset, "__len__"):
        raise ValueError(
            "a streaming (iterable) training set cannot be split for validation: pass eval_dataset= (a held-out "
            "set that picks the soups)"
        )
    if hasattr(train_dataset, "train_test_split"):  # datasets.Dataset
        split = train_dataset.train_test_split(test_size=fraction, seed=seed)
        return split["train"], split["test"]
    n = len(train_dataset)
    n_val = max(1, round(n * fraction))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(train_dataset, perm[n_val:]), Subset(train_dataset, perm[:n_val])


def peek(dataset, index: int):
    """``dataset[index]`` under fixed seeds, leaving every global random generator as it was: reading an
    item with random augmentation neither changes the caller's randomness nor depends on it."""
    state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(index), random.seed(index), np.random.seed(index)
            return dataset[index]
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


class SeededItems(Dataset):
    """``dataset`` read in batches of ``batch_size`` consecutive items, each batch under seeds derived from
    ``(seed, its first item)``: its random augmentation is the same whichever process or loader worker reads it, so a
    pass shared by processes equals one process's. The global generators are left seeded: save them around a pass
    (:func:`kept_randomness`)."""

    def __init__(self, dataset, seed: int, batch_size: int):
        self.dataset, self.seed, self.batch_size = dataset, seed, batch_size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        if i % self.batch_size == 0:  # a loader (or worker) reads a batch's items in order, from its first
            s = derive_seed(self.seed, i)
            torch.default_generator.manual_seed(s), random.seed(s), np.random.seed(s)
        return self.dataset[i]


@contextlib.contextmanager
def kept_randomness():
    """Python's, numpy's and torch's CPU generators as they were before the block (also on error)."""
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


class TensorDictDataset(Dataset):
    """Items ``{"x": image, "labels": label}``: the layout timm, smp and plain models take."""

    def __init__(self, x: torch.Tensor, labels: torch.Tensor, augment=None):
        self.x, self.labels, self.augment = x, labels, augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        x = self.x[i] if self.augment is None else self.augment(self.x[i])
        return {"x": x, "labels": self.labels[i]}


def random_shift(max_shift: int = 1):
    """Random translation by up to ``max_shift`` pixels with zero padding: cheap augmentation for 8x8 digits."""

    def shift(x: torch.Tensor) -> torch.Tensor:
        dy, dx = torch.randint(-max_shift, max_shift + 1, (2,)).tolist()
        padded = torch.nn.functional.pad(x, (max_shift,) * 4)
        h, w = x.shape[-2:]
        return padded[..., max_shift + dy : max_shift + dy + h, max_shift + dx : max_shift + dx + w]

    return shift


def load_digits_splits(val_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0, augment: bool = True):
    """scikit-learn's 8x8 digits (1797 real images, shipped with scikit-learn): ``(train, validation, test)``.

    Validation is ``val_fraction`` of the training part, split with a fixed seed and never augmented.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(y) * test_fraction)
    n_val = round((len(y) - n_test) * val_fraction)
    test, val, train = perm[:n_test], perm[n_test : n_test + n_val], perm[n_test + n_val :]
    return (
        TensorDictDataset(x[train], y[train], random_shift() if augment else None),
        TensorDictDataset(x[val], y[val]),
        TensorDictDataset(x[test], y[test]),
    )
