"""What the recipes share: YAML-aware argument parsing, the data arguments and loading, and the end of a run."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import field

import torch
import yaml
from transformers import HfArgumentParser

from .results import format_table, test_names
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


@dataclasses.dataclass
class DataArguments:
    """The data fields every recipe takes: where the data comes from, which split does what, how much of it.

    A field left None takes the recipe's default: each recipe passes its ``DATA_DEFAULTS`` (for example
    ``test_split="test"`` for WMT16 but ``"validation"`` for ImageNet, whose test labels are hidden) to
    :meth:`with_defaults` at the top of ``main``. Recipe defaults for ``dataset_name``/``dataset_config`` apply
    only when no local data (``dataset_path``, ``train_file``) is given.
    """

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset, or a datasets builder such as imagefolder. Default: the recipe's."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration of the dataset, e.g. de-en."})
    dataset_path: str | None = field(
        default=None, metadata={"help": "A DatasetDict saved with save_to_disk, instead of dataset_name."}
    )
    data_dir: str | None = field(
        default=None, metadata={"help": "data_dir of load_dataset, e.g. a folder of class subfolders (imagefolder)."}
    )
    train_file: str | None = field(
        default=None, metadata={"help": "Local JSON-lines (or .csv/.parquet) train file, instead of dataset_name."}
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "Local file for the validation_split (default name: validation)."}
    )
    test_file: str | None = field(
        default=None, metadata={"help": "Local file for the test_split (default name: test)."}
    )
    validation_split: str | None = field(
        default=None,
        metadata={
            "help": "Split that selects the soups. When None or absent from the data, validation_fraction of "
            "train is split off (seeded). Default: the recipe's."
        },
    )
    test_split: str | None = field(
        default=None, metadata={"help": "Split that is only reported, never used to select. Default: the recipe's."}
    )
    image_column: str = field(default="image", metadata={"help": "Column of the input images (image recipes)."})
    label_column: str = field(default="label", metadata={"help": "Column of the class labels (classification)."})
    mask_column: str = field(default="mask", metadata={"help": "Column of the label masks (segmentation)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N train examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N validation examples."})
    max_test_samples: int | None = field(default=None, metadata={"help": "Keep the first N test examples."})

    def __post_init__(self):
        if self.validation_file and self.validation_split is None:
            self.validation_split = "validation"
        if self.test_file and self.test_split is None:
            self.test_split = "test"

    def with_defaults(self, **recipe_defaults) -> DataArguments:
        """A copy whose None fields take ``recipe_defaults`` (the dataset ones only when no local data is given)."""
        local = self.dataset_path or self.train_file
        filled = {
            name: value
            for name, value in recipe_defaults.items()
            if getattr(self, name) is None and not (local and name in ("dataset_name", "dataset_config"))
        }
        return dataclasses.replace(self, **filled)

    @property
    def hub_datasets(self) -> list[str]:
        """The Hub dataset the model card names: ``dataset_name`` unless the data is local."""
        local = self.dataset_path or self.train_file or self.data_dir
        return [self.dataset_name] if self.dataset_name and not local else []


def load_splits(data: DataArguments):
    """A ``DatasetDict`` from ``save_to_disk`` output, local files, or the Hub (or a builder such as imagefolder)."""
    import datasets

    if data.dataset_path:
        return datasets.load_from_disk(data.dataset_path)
    if data.train_file:
        files = {"train": data.train_file, data.validation_split: data.validation_file, data.test_split: data.test_file}
        builder = {"csv": "csv", "parquet": "parquet"}.get(data.train_file.rsplit(".", 1)[-1], "json")
        return datasets.load_dataset(builder, data_files={k: v for k, v in files.items() if v})
    if not data.dataset_name:
        raise ValueError("give --dataset_name (a Hub dataset or a builder such as imagefolder) or --dataset_path")
    return datasets.load_dataset(data.dataset_name, data.dataset_config, data_dir=data.data_dir)


def prepared_splits(raw, prepare, args, data: DataArguments) -> tuple:
    """``(train, validation, test)`` from a ``DatasetDict``, each cut to its ``max_*_samples`` and then
    passed through ``prepare(dataset, training)``.

    Validation is ``raw[data.validation_split]`` when that split exists, else ``args.validation_fraction`` of
    ``raw["train"]`` split off with ``args.seed`` (as ``SparseModelSoup`` does). The split happens on the raw
    data so that validation, used to pick soups, gets the evaluation transform (``training=False``) and
    not the random augmentation. Test (reported only) is None when ``raw`` has no ``data.test_split``.
    """
    if data.validation_split is not None and data.validation_split == data.test_split:
        raise ValueError(f"the {data.test_split!r} split is the test set; it cannot also be the validation set")
    train = raw["train"]
    if data.validation_split in raw:
        val = raw[data.validation_split]
    else:
        split = train.train_test_split(test_size=args.validation_fraction, seed=args.seed)
        train, val = split["train"], split["test"]
    test = raw[data.test_split] if data.test_split in raw else None

    def first(dataset, limit):
        return dataset if limit is None else dataset.select(range(min(limit, len(dataset))))

    train, val = first(train, data.max_train_samples), first(val, data.max_eval_samples)
    test = None if test is None else prepare(first(test, data.max_test_samples), False)
    return prepare(train, True), prepare(val, False), test


def stack_collate(items: list[dict]) -> dict:
    """Batch items such as ``{"x": tensor, "labels": int or tensor}`` by stacking each key."""
    return {k: torch.stack([torch.as_tensor(item[k]) for item in items]) for k in items[0]}


def finish(runner: SparseModelSoup) -> None:
    """Print, for every test set, the table of the metric per phase beside the dense model (main process)."""
    if runner.world.is_main:
        for name in test_names(runner.results):
            print(f"\n{name} after each phase:\n" + format_table([runner.results], name), flush=True)
