"""What the recipes share: YAML-aware argument parsing, data loading, and the end of a run."""

from __future__ import annotations

import dataclasses
import sys

import torch
import yaml
from transformers import HfArgumentParser

from .results import format_table
from .sms import SparseModelSoup


def parse_args(*dataclass_types, argv: list[str] | None = None) -> tuple:
    """``HfArgumentParser`` that also takes ``--config file.yaml``: the YAML gives defaults, flags override."""
    parser = HfArgumentParser(dataclass_types)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ValueError("--config needs a path to a YAML file")
        path = argv[i + 1]
        del argv[i : i + 2]
        with open(path) as f:
            defaults = yaml.safe_load(f) or {}
        known = {f.name for t in dataclass_types for f in dataclasses.fields(t)}
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; see --help for the accepted fields")
        parser.set_defaults(**defaults)
    return parser.parse_args_into_dataclasses(args=argv)


def load_splits(
    dataset_name: str | None,
    dataset_config: str | None = None,
    dataset_path: str | None = None,
    data_dir: str | None = None,
):
    """A ``DatasetDict`` from the Hub (or a builder such as ``imagefolder``), or from ``save_to_disk`` output."""
    import datasets

    if dataset_path:
        return datasets.load_from_disk(dataset_path)
    if not dataset_name:
        raise ValueError("give --dataset_name (a Hub dataset or a builder such as imagefolder) or --dataset_path")
    return datasets.load_dataset(dataset_name, dataset_config, data_dir=data_dir)


def prepared_splits(raw, prepare, args, test_split: str | None, validation_split: str | None = None) -> tuple:
    """``(train, validation, test)`` from a ``DatasetDict``, each from ``prepare(dataset, training)``.

    Validation is ``raw[validation_split]`` when that split exists, else ``args.validation_fraction`` of
    ``raw["train"]`` split off with ``args.seed`` (as ``SparseModelSoup`` does). The split happens on the raw
    data so that validation, used to pick soups, gets the evaluation transform (``training=False``) and
    not the random augmentation. Test (reported only) is None when ``raw`` has no ``test_split``.
    """
    if validation_split is not None and validation_split == test_split:
        raise ValueError(f"the {test_split!r} split is the test set; it cannot also be the validation set")
    train = raw["train"]
    if validation_split in raw:
        val = raw[validation_split]
    else:
        split = train.train_test_split(test_size=args.validation_fraction, seed=args.seed)
        train, val = split["train"], split["test"]
    test = prepare(raw[test_split], False) if test_split in raw else None
    return prepare(train, True), prepare(val, False), test


def stack_collate(items: list[dict]) -> dict:
    """Batch items such as ``{"x": tensor, "labels": int or tensor}`` by stacking each key."""
    return {k: torch.stack([torch.as_tensor(item[k]) for item in items]) for k in items[0]}


def finish(runner: SparseModelSoup) -> None:
    """Print the table of the test metric per phase (main process)."""
    if runner.world.is_main:
        print("\nTest metric after each phase:\n" + format_table([runner.results], "test"), flush=True)
