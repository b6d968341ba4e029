"""What the recipes share: YAML-aware argument parsing, data loading, and the end of a run."""

from __future__ import annotations

import dataclasses
import os
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


def load_splits(dataset_name: str | None, dataset_config: str | None = None, dataset_path: str | None = None,
                data_dir: str | None = None):  # fmt: skip
    """A ``DatasetDict`` from the Hub (or a builder such as ``imagefolder``), or from ``save_to_disk`` output."""
    import datasets

    if dataset_path:
        return datasets.load_from_disk(dataset_path)
    if not dataset_name:
        raise ValueError("give --dataset_name (a Hub dataset or a builder such as imagefolder) or --dataset_path")
    return datasets.load_dataset(dataset_name, dataset_config, data_dir=data_dir)


def transformed_splits(raw, transform, test_split: str):
    """``(train, test)`` with ``transform(training)``'s function applied on the fly; test is None if missing."""
    train = raw["train"].with_transform(transform(True))
    return train, raw[test_split].with_transform(transform(False)) if test_split in raw else None


def stack_collate(items: list[dict]) -> dict:
    """Batch items such as ``{"x": tensor, "labels": int or tensor}`` by stacking each key."""
    return {k: torch.stack([torch.as_tensor(item[k]) for item in items]) for k in items[0]}


def finish(runner: SparseModelSoup, base_model: str | None = None, datasets: list[str] | None = None) -> None:
    """Print the table and, with ``--push_to_hub``, upload the final soup with a model card (main process)."""
    args = runner.args
    if not runner.world.is_main:
        return
    print("\nTest metric after each phase:\n" + format_table([runner.results], "test"), flush=True)
    if args.push_to_hub:
        from .hub import push_to_hub

        repo = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
        url = push_to_hub(os.path.join(args.output_dir, "final_soup"), repo, token=args.hub_token,
                          private=args.hub_private_repo, base_model=base_model, datasets=datasets,
                          metrics=runner.final_metrics())  # fmt: skip
        print(f"[hf-sms] pushed the soup to {url}", flush=True)
