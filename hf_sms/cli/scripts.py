"""What the recipes share: YAML-aware argument parsing with ``--smoke``, the data arguments and loading, dense
pretraining, and the end of a run."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import field

import numpy as np
import torch
import yaml
from accelerate.utils import broadcast
from transformers import HfArgumentParser, TrainingArguments, set_seed

from ..checkpoint import load_sparse, save_sparse
from ..checkpoint.folder import read_sparsity
from ..data import VALIDATION_SEED
from ..evaluation.corruptions import (
    CORRUPTIONS,
    SEVERITIES,
    ArrayImages,
    ImageFiles,
    corrupted_dataset,
    imagenet_c_files,
    load_cifar_c,
)
from ..evaluation.named import MeanOverSets
from ..evaluation.subgroups import SubgroupRecall
from ..loop.distributed import launched_world_size
from ..loop.run_directory import lock_folder
from ..loop.sms import SparseModelSoup
from ..records.results import format_table, reported_tests, speedup_report
from ..training.trainer import SparseSoupTrainer
from .smoke import SMOKE_ARGS

logger = logging.getLogger("hf_sms")

_EPILOG = (
    "--config FILE.yaml gives defaults (flags override them). --smoke runs the recipe end to end on CPU with a tiny "
    "model and tiny data written to a temporary folder (on top of --config, under flags)."
)


def parse_args(*dataclass_types, argv: list[str] | None = None, smoke: Callable[[str], dict] | None = None) -> tuple:
    """``HfArgumentParser`` that also takes ``--config file.yaml`` and ``--smoke``.

    The YAML gives defaults and flags override them. With ``--smoke`` (recipes that pass ``smoke``),
    ``smoke(folder)`` writes a tiny model and data into a temporary folder (removed at exit) and returns the
    fields that point at them (``dataset_path``, the model's size, ...); those and :data:`SMOKE_ARGS` override
    the YAML, and flags still override everything, e.g. ``--smoke --output_dir out``.
    """
    parser = HfArgumentParser(dataclass_types, epilog=_EPILOG)
    argv = list(sys.argv[1:] if argv is None else argv)
    known = {f.name for t in dataclass_types for f in dataclasses.fields(t)}
    defaults: dict = {}
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ValueError("--config needs a path to a YAML file")
        path = argv[i + 1]
        del argv[i : i + 2]
        with open(path) as f:
            defaults = yaml.safe_load(f) or {}
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; see --help for the accepted fields")
    if "--smoke" in argv:
        argv.remove("--smoke")
        if smoke is None:
            raise ValueError("this script has no --smoke")
        folder = tempfile.mkdtemp(prefix="hf-sms-smoke-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        overrides = {**SMOKE_ARGS, **smoke(folder)}
        defaults.update({k: v for k, v in overrides.items() if k in known})
    parser.set_defaults(**defaults)
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:
        if "bf16" not in str(e) or "--bf16" in argv:
            raise
        raise ValueError(  # the LLM configs train in bf16 on a GPU; transformers' own advice (use_cpu) is not enough
            f"{e} This config trains in bf16 mixed precision, which needs a GPU here: on a CPU add --bf16 false "
            "(and --torch_dtype float32, or bfloat16 to keep the weights in bf16)"
        ) from None
    seed = next((a.seed for a in parsed if isinstance(a, TrainingArguments)), None)
    if seed is not None:  # before the recipe builds its model: every process initialises the same weights
        set_seed(seed)
    return parsed


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
    group_column: str | None = field(
        default=None,
        metadata={
            "help": "Column of a binary group attribute (CelebA: Blond_Hair): adds subgroup-recall test sets "
            "(worst group, and balanced accuracy)."
        },
    )
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

    def subgroup_metric(self, collate_fn: Callable | None = None, score: str = "worst"):
        """Recall of every (``group_column``, ``label_column``) pair, both binary, e.g. "Blond_Hair,not Male"; its
        score is the worst one, or with ``score="balanced"`` their mean (balanced accuracy)
        (:class:`~hf_sms.evaluation.subgroups.SubgroupRecall`, items carry ``group``)."""
        group, target = self.group_column, self.label_column
        names = {"group_names": {0: f"not {group}", 1: group}, "class_names": {0: f"not {target}", 1: target}}
        return SubgroupRecall(collate_fn=collate_fn, score=score, **names)

    @property
    def hub_datasets(self) -> list[str]:
        """The Hub dataset the model card names: ``dataset_name`` unless the data is local."""
        local = self.dataset_path or self.train_file or self.data_dir
        return [self.dataset_name] if self.dataset_name and not local else []


@dataclasses.dataclass
class OODArguments:
    """Out-of-distribution accuracy: the mean accuracy over corrupted copies of the test set (docs/method.md §8)."""

    ood: bool = field(default=False, metadata={"help": "Report accuracy on corrupted test sets as test set 'ood'."})
    ood_dir: str | None = field(
        default=None,
        metadata={
            "help": "The published corrupted test sets: CIFAR-10-C / CIFAR-100-C (a folder of .npy) or ImageNet-C "
            "(<corruption>/<severity>/<wnid>/*.JPEG). Without it the corruptions are made on the fly with ImageNet-C's "
            "parameters (pip install 'hf-sms[ood]'), harsher on 32 px than CIFAR-C's."
        },
    )
    ood_corruptions: list[str] | None = field(
        default=None, metadata={"help": "Corruptions (default: every .npy in ood_dir, or the 15 of ImageNet-C)."}
    )
    ood_severities: list[int] | None = field(default=None, metadata={"help": "Severities (default: 1 2 3 4 5)."})
    ood_samples: int | None = field(
        default=None, metadata={"help": "On the fly only: corrupt the first N test images (default: all)."}
    )

    def test_set(self, raw_test, data: DataArguments, transform: Callable, metric, seed: int = 0) -> tuple:
        """``({(corruption, severity): dataset}, MeanOverSets(metric))``, a named test set for SparseModelSoup.

        Args:
            raw_test: the raw test split (read only without ``ood_dir``).
            data: its columns.
            transform: the evaluation transform, PIL image to tensor.
            metric: the accuracy each corrupted set is scored with.
            seed: seeds the on-the-fly corruptions (each image's own seed derives from it).
        """

        severities = self.ood_severities or SEVERITIES
        if self.ood_dir and not os.path.isfile(os.path.join(self.ood_dir, "labels.npy")):  # ImageNet-C's tree
            files = imagenet_c_files(self.ood_dir, self.ood_corruptions, severities)
            classes = sorted({wnid for items in files.values() for _, wnid in items})
            return {key: ImageFiles(items, classes, transform) for key, items in files.items()}, MeanOverSets(metric)
        if self.ood_dir:
            sets = load_cifar_c(self.ood_dir, self.ood_corruptions, severities)
        else:
            test = raw_test.select(range(min(self.ood_samples or len(raw_test), len(raw_test))))
            images = [np.asarray(img.convert("RGB")) for img in test[data.image_column]]
            sets = {}
            for name in self.ood_corruptions or CORRUPTIONS:
                for s in severities:
                    items = corrupted_dataset(images, test[data.label_column], name, s, seed)
                    sets[name, s] = np.stack([i["image"] for i in items]), np.array([i["labels"] for i in items])
        return {key: ArrayImages(x, y, transform) for key, (x, y) in sets.items()}, MeanOverSets(metric)


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
    ``raw["train"]`` split off with a fixed seed, whatever ``args.seed`` (as ``SparseModelSoup`` does). The split
    happens on the raw data so that validation, used to pick soups, gets the evaluation transform
    (``training=False``) and not the random augmentation. Test (reported only) is None when ``raw`` has no
    ``data.test_split``.
    """
    if data.validation_split is not None and data.validation_split == data.test_split:
        raise ValueError(f"the {data.test_split!r} split is the test set; it cannot also be the validation set")
    column = data.group_column  # checked before any pretraining or training
    lacking = [name for name, split in raw.items() if column and column not in split.column_names]
    if lacking:
        columns = raw[lacking[0]].column_names
        raise ValueError(f"--group_column {column!r} is not a column of the {lacking[0]!r} split (it has {columns})")
    train = raw["train"]
    if data.validation_split in raw:
        val = raw[data.validation_split]
    else:
        split = train.train_test_split(test_size=args.validation_fraction, seed=VALIDATION_SEED)  # not the run's seed
        train, val = split["train"], split["test"]
    test = raw[data.test_split] if data.test_split in raw else None

    def first(dataset, limit):
        return dataset if limit is None else dataset.select(range(min(limit, len(dataset))))

    train, val = first(train, data.max_train_samples), first(val, data.max_eval_samples)
    test = None if test is None else prepare(first(test, data.max_test_samples), False)
    return prepare(train, True), prepare(val, False), test


def stack_collate(items: list[dict]) -> dict:
    """Batch items such as ``{"x": tensor, "labels": int or tensor}`` by stacking each key.

    A ``group`` key (the attribute :class:`~hf_sms.evaluation.SubgroupRecall` reads) is left out: it is never an
    input of the model.
    """
    return {k: torch.stack([torch.as_tensor(item[k]) for item in items]) for k in items[0] if k != "group"}


_PRETRAINING = ("pretrain_epochs", "pretrain_schedule", "learning_rate", "per_device_train_batch_size")
_PRETRAINING += ("weight_decay", "optim", "optim_args", "seed")


def pretrain(model: torch.nn.Module, args, train_dataset, folder: str, **trainer_kwargs) -> torch.nn.Module:
    """The dense model SMS starts from, trained as the run's ``pretrain_*`` fields describe it, or loaded.

    Trains ``model`` in place for ``args.pretrain_epochs`` epochs from peak LR ``args.eta_max`` along
    ``PRETRAIN_SHAPES[args.pretrain_schedule]`` (the very shape LRW, SLR and ALLR then assume), with the run's
    optimizer, batch size and weight decay (the paper retrains with its pretraining's batch size and weight decay),
    data-parallel over all N processes with ``per_device_train_batch_size / N`` each, so the global batch is the
    run's batch size (the paper's 128) whatever N is; ``max_steps`` does not apply. The result is saved with
    ``save_sparse`` to ``folder`` (plain torch models load back with ``load_sparse(folder, model=template)``). A
    folder that holds a finished pretraining with the same settings is loaded instead; one with other settings is
    an error.

    Args:
        model: the freshly initialised model.
        args: the run's :class:`~hf_sms.SparseSoupConfig`.
        train_dataset: the (augmented) training split, without the validation examples.
        folder: where the dense model is saved; keep it outside ``args.output_dir``, which the SMS run owns.
        **trainer_kwargs: passed to the trainer, e.g. ``data_collator``.
    """
    n = launched_world_size()
    if args.per_device_train_batch_size % n:
        raise ValueError(
            f"pretraining keeps the global batch per_device_train_batch_size={args.per_device_train_batch_size} "
            f"on {n} processes: launch a number of processes that divides it"
        )
    pre = dataclasses.replace(
        args,
        output_dir=folder,
        per_device_train_batch_size=args.per_device_train_batch_size // n,
        num_train_epochs=args.pretrain_epochs or 0,
        max_steps=-1,
        learning_rate=args.eta_max,
        push_to_hub=False,
    )
    settings = {"pretraining": {k: getattr(args if k.endswith("batch_size") else pre, k) for k in _PRETRAINING}}
    record = read_sparsity(folder) if os.path.isdir(folder) else None
    if record is not None:
        saved = record.get("recipe")
        if saved != json.loads(json.dumps(settings)):
            raise ValueError(
                f"{folder} holds a dense model pretrained with {saved}, not {settings}: delete it, or point "
                "--dense_dir elsewhere"
            )
        logger.info("[hf-sms] dense model: pretrained earlier, loading %s", folder)
        return load_sparse(folder, model).train()
    if not args.pretrain_epochs:
        raise ValueError("pretraining needs its length: set --pretrain_epochs (the paper: 200 for CIFAR)")
    # Before any work: a second job pretraining into the same folder stops at once with a clear message.
    lock = lock_folder(folder, "pretraining", "--dense_dir") if int(os.environ.get("RANK", 0)) == 0 else None
    try:
        logger.info("[hf-sms] dense model: pretraining %s epochs into %s", args.pretrain_epochs, folder)
        trainer = SparseSoupTrainer(
            model, pre, masks={}, train_dataset=train_dataset, lr_schedule="pretrain", **trainer_kwargs
        )
        trainer.train()
        if n > 1:  # DDP syncs buffers before each forward, so the last step left BatchNorm statistics per process
            for buffer in model.buffers():
                buffer.copy_(broadcast(buffer.to(trainer.accelerator.device), from_process=0))
        if trainer.is_world_process_zero():
            save_sparse(model, folder, recipe=settings)
        trainer.accelerator.wait_for_everyone()
    finally:
        if lock is not None:
            os.close(lock)
    return model


def public_weights_note(source: str, saw_validation: bool = True) -> str:
    """What a run from public pretrained weights must say (run output and model card): the validation split it
    holds out may be in those weights' training data, and ``pretrain_*`` describe a schedule, not a training here."""
    seen = saw_validation * (  # the sentence, or "" without a validation split
        "The validation split held out here was in the training data of those weights, so validation scores (which "
        "pick greedy soups and the best candidate) are optimistic. "
    )
    return f"The dense model is the public pretrained {source}; it was not trained by this run. {seen}" + (
        "The pretrain_* settings describe the schedule the retraining schedules (LRW, SLR, ALLR) replay, not a "
        "training that ran here."
    )


def finish(runner: SparseModelSoup) -> None:
    """Print, for every test set, the table of the metric per phase beside the dense model (main process)."""
    if runner.world.is_main:
        for name in reported_tests(runner.results):
            print(f"\n{name} after each phase:\n" + format_table([runner.results], name), flush=True)
        print("\n" + speedup_report([runner.results]), flush=True)
