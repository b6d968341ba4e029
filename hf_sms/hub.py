"""Sharing soups on the Hugging Face Hub: a generated model card and ``push_to_hub``.

The card's front matter lists metric types and a ``model-index`` of the soup's results (the Hub's evaluation
results); its Markdown names split and metric of every number and states the theoretical speedup once.
Authentication is huggingface_hub's own (``token=`` or ``hf auth login``); the token is never printed or logged.
"""

from __future__ import annotations

import glob
import logging
import numbers
import os
import re
import shutil
import tempfile

import yaml
from torch import nn

from .checkpoint import save_sparse
from .checkpoint.constants import CARD_NAME, SPARSITY_NAME, TMP_PREFIX
from .checkpoint.families import FAMILIES, Family
from .checkpoint.folder import published_files, read_sparsity
from .runtime.speed import format_measured

logger = logging.getLogger(__name__)


def _read_info(directory: str) -> dict:
    info = read_sparsity(directory)
    if info is None:
        raise ValueError(f"{directory} has no {SPARSITY_NAME}; save the model with hf_sms.save_sparse first")
    return info


def _family(info: dict) -> Family:
    library = info.get("library")
    return FAMILIES.get(library) if library in FAMILIES else FAMILIES.get("torch")


# Readable metric names -> the Hub's metric ids (https://huggingface.co/metrics), which the front matter lists;
# other names are lowercased with "_" for every run of other characters ("BLEU" -> "bleu").
METRIC_TYPES = {"top-1 accuracy": "accuracy", "ood accuracy": "accuracy", "worst-group recall": "recall"}
METRIC_TYPES.update({"miou": "mean_iou", "mean iou": "mean_iou"})
# Hub task ids a metric implies in the paper's settings (ImageNet, CIFAR, CelebA, WMT16, Cityscapes); pass
# ``task=`` (or a row's ``"task"``) for anything else.
TASKS = {"accuracy": "image-classification", "recall": "image-classification", "bleu": "translation"}
TASKS["mean_iou"] = "image-segmentation"
SPEEDUP = "Theoretical speedup (FLOPs with zeros skipped)"
MEASURED = 'Measured speedup with hf-sms\'s sparse runtime (`hf_sms.load_sparse(dir, runtime="auto", ...)`)'


def metric_type(metric: str) -> str:
    """The Hub metric id of a readable metric name: ``"top-1 accuracy"`` -> ``"accuracy"``."""
    key = metric.strip().lower()
    return METRIC_TYPES.get(key) or re.sub(r"[^a-z0-9]+", "_", key).strip("_")


def card_metrics(
    results: list[dict] | None = None, metrics: dict | None = None, speedup=None, measured: dict | None = None
) -> dict:
    """The record of what a card reports, as stored in ``sparsity.json``'s ``metrics``: ``{"results", "speedup",
    "measured_speedup"}``.

    Args:
        results: rows ``{"model": "soup" | "dense" | "imp" ..., "split": "test" ..., "metric": "BLEU" ...,
            "value": float}``, optionally with ``"dataset"`` (Hub id) and ``"task"`` (Hub task id).
        metrics: the older flat ``{metric name: value}`` of the soup on an unnamed split; a ``"speedup"`` key
            is the theoretical speedup, not a metric.
        speedup: the theoretical speedup (:func:`hf_sms.evaluation.theoretical_speedup`), ``None`` if unknown.
        measured: the sparse runtime's measured speedup record (:func:`hf_sms.runtime.measure_speedup`: speedup,
            times, device, threads, input), ``None`` if not measured.

    Returns:
        ``{"results": rows with every key set, "speedup": float or None, "measured_speedup": dict or None}``.
    """
    flat = dict(metrics or {})
    legacy_speedup = flat.pop("speedup", None)
    speedup = legacy_speedup if speedup is None else speedup
    results = [{"metric": k, "value": v} for k, v in flat.items()] if results is None else results
    if speedup is not None and not _is_number(speedup):
        raise TypeError(f"speedup is the theoretical speedup, a number (or None if unknown), got {speedup!r}")
    rows = []
    for row in results:
        if row.get("value") is None:
            continue
        if str(row.get("metric", "")).strip().lower() in ("", "speedup"):
            raise ValueError(f"result {row} needs a metric name; pass the speedup as speedup=, not as a result")
        if not _is_number(row["value"]):
            raise ValueError(f"result {row} needs a number as its value")
        rows.append({"model": "soup", "split": None, **row, "value": float(row["value"])})
    return {
        "results": rows,
        "speedup": None if speedup is None else float(speedup),
        "measured_speedup": dict(measured) if measured else None,
    }


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _stored(info: dict) -> dict:
    """What ``sparsity.json`` recorded: a :func:`card_metrics` record, or an older flat metrics dict."""
    stored = info.get("metrics") or {}
    if isinstance(stored.get("results"), list):
        return stored
    # An older record may hold anything a caller passed; the card reports its numbers only.
    return card_metrics(metrics={k: v for k, v in stored.items() if _is_number(v)})


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def results_table(results: list[dict]) -> str:
    """One line per (split, metric) and one column per model: dense beside the soup, then the baselines."""
    models = list(dict.fromkeys(["dense", "soup", *(r["model"] for r in results)]))
    models = [m for m in models if any(r["model"] == m for r in results)]
    lines: dict[tuple, dict] = {}
    for r in results:
        lines.setdefault((r["split"], r["metric"]), {})[r["model"]] = r["value"]
    return _table([{"split": s, "metric": m, **{c: line.get(c, "") for c in models}} for (s, m), line in lines.items()])


def model_index(name: str, results: list[dict], dataset: str | None = None, task: str | None = None) -> list[dict]:
    """The ``model-index`` front matter of the soup's rows, grouped by task, dataset and split.

    Args:
        name: the model's name (its repo id).
        results: rows as in :func:`card_metrics`; only ``model == "soup"`` rows are indexed.
        dataset: Hub id of the dataset of rows that name none; rows without any dataset are left out (the Hub
            requires one).
        task: Hub task id of rows that name none; by default implied by the metric (``TASKS``), else ``other``.

    Returns:
        ``[]`` if nothing can be indexed, else ``[{"name", "results": [{"task", "dataset", "metrics"}]}]``.
    """
    groups: dict[tuple, list] = {}
    for r in results:
        kind, data = metric_type(r["metric"]), r.get("dataset") or dataset
        if r["model"] != "soup" or not data:
            continue
        key = (r.get("task") or task or TASKS.get(kind, "other"), data, r["split"])
        groups.setdefault(key, []).append({"type": kind, "name": r["metric"], "value": r["value"]})
    entries = []
    for (task_type, data, split), metrics in groups.items():
        data_entry = {"name": data, "type": data, **({"split": split} if split else {})}
        task_entry = {"type": task_type, "name": task_type.replace("-", " ").capitalize()}
        entries.append({"task": task_entry, "dataset": data_entry, "metrics": metrics})
    return [{"name": name, "results": entries}] if entries else []


def _phases(phases: list) -> list[dict]:
    """Phase rows: a recipe's phase targets (floats) or phase dicts, with sparsities in %."""
    rows = [dict(p) if isinstance(p, dict) else {"phase": i + 1, "sparsity": p} for i, p in enumerate(phases)]
    return [
        {**r, "sparsity": f"{100 * r['sparsity']:.2f}%"} if isinstance(r.get("sparsity"), float) else r for r in rows
    ]


def _how_to_load(info: dict, repo: str) -> str:
    snippet = _family(info).load_snippet(info.get("architecture"), info.get("format"), repo, hub=True)
    return "```python\n" + snippet + "\n```"


def model_card(
    directory: str,
    repo_id: str | None = None,
    *,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    results: list[dict] | None = None,
    metrics: dict | None = None,
    speedup: float | None = None,
    measured: dict | None = None,
    task: str | None = None,
    license: str | None = None,
    tags: list[str] | None = None,
) -> str:
    """The model card (``README.md`` text) of a checkpoint folder written by :func:`hf_sms.save_sparse`.

    Args:
        directory: the checkpoint folder; its ``sparsity.json`` supplies sparsity, recipe and, unless given
            here, results and speedup (a :func:`card_metrics` record, or an older flat metrics dict).
        repo_id: the Hub repository, used in the title, the loading snippet and ``model-index``.
        base_model: Hub id of the dense model the soup was pruned from.
        datasets: Hub ids of the training datasets; the first is the dataset of results that name none.
        results, metrics, speedup, measured: what the card reports, as in :func:`card_metrics`.
        task: Hub task id for ``model-index`` (default: implied by each metric).
        license, tags: extra front matter.

    Returns:
        YAML front matter (with ``model-index`` for the soup's results) and Markdown.
    """
    info = _read_info(directory)
    given, stored = card_metrics(results, metrics, speedup, measured), _stored(info)  # arguments, then the file
    rows = given["results"] if results is not None or metrics is not None else stored["results"]
    speedup = stored["speedup"] if given["speedup"] is None else given["speedup"]
    measured = given["measured_speedup"] or stored.get("measured_speedup")
    recipe = info.get("recipe") or {}
    repo = repo_id or os.path.basename(os.path.abspath(directory))
    meta = {
        "library_name": _family(info).hub_library_name,
        "tags": list(dict.fromkeys(["hf-sms", "sparse", "pruning", "model-soup", *(tags or [])])),
    }
    extra = {"license": license, "base_model": base_model, "datasets": list(datasets or [])}
    meta.update({k: v for k, v in extra.items() if v})
    if rows:
        meta["metrics"] = list(dict.fromkeys(metric_type(r["metric"]) for r in rows))
    if index := model_index(repo, rows, (datasets or [None])[0], task):
        meta["model-index"] = index

    weights = sum(
        os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors")
    )
    sparsity = info.get("sparsity") or 0.0
    # The speedup is stated here only: a second mention could only disagree with this one.
    speed = f"**{_cell(speedup)}x** over the dense model" if speedup is not None else "not measured"
    body = [
        f"# {repo}",
        "",
        "A sparse model soup made with hf-sms, an implementation of Sparse Model Soups (Zimmer, Spiegel, "
        "Pokutta; ICLR 2024, [arXiv:2306.16788](https://arxiv.org/abs/2306.16788)): prune a model, retrain "
        "several copies under the same mask, and average them into one sparse model.",
        "",
        "## Sparsity",
        "",
        f"- Sparsity: **{100 * sparsity:.2f}%** of the {info.get('numel', 0):,} prunable weights are zero "
        f"({info.get('nnz', 0):,} kept); mask `{info.get('mask_hash')}`.",
        f"- Checkpoint format: `{info.get('format')}`, weights {weights / 1e6:.2f} MB on disk.",
        f"- {SPEEDUP}: {speed}. Unstructured sparsity runs faster only with sparse kernels; it always "
        "shrinks the checkpoint.",
        f"- {MEASURED}: "
        + (format_measured(measured) if measured else "not timed for this card; `hf-sms speed DIR` times it on yours")
        + ".",
    ]
    if rows:
        body += ["", "## Results", "", results_table(rows)]
    if recipe:
        body += ["", "## Recipe"]
        settings = [f"- {k}: {_cell(v)}" for k, v in recipe.items() if k != "phases"]
        body += ["", *settings] if settings else []
        if recipe.get("phases"):
            body += ["", "Sparsity after each pruning phase:", "", _table(_phases(recipe["phases"]))]
    body += ["", "## How to load", "", _how_to_load(info, repo)]
    per_tensor = info.get("per_tensor") or {}
    if per_tensor:
        rows = [
            {"tensor": n, "shape": "x".join(map(str, t["shape"])), "sparsity": f"{100 * t['sparsity']:.2f}%"}
            for n, t in per_tensor.items()
        ]
        body += ["", "<details><summary>Per-layer sparsity</summary>", "", _table(rows), "", "</details>"]
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    return f"---\n{front}---\n\n" + "\n".join(body) + "\n"


def push_to_hub(
    model_or_directory: nn.Module | str,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload sparse model soup (hf-sms)",
    revision: str | None = None,
    create_pr: bool = False,
    format: str = "bitmask",
    recipe: dict | None = None,
    processing_class=None,
    **card_kwargs,
) -> str:
    """Upload a soup with a generated model card; returns the commit URL.

    Args:
        model_or_directory: a checkpoint folder from :func:`hf_sms.save_sparse`, or a model (saved to a
            temporary folder in ``format`` with ``recipe`` and ``processing_class`` first).
        repo_id: ``"user/name"``; created if missing.
        token: a Hub token; by default huggingface_hub's login. Never printed or logged.
        private, revision, create_pr, commit_message: as in ``HfApi.upload_folder`` / ``create_repo``.
        **card_kwargs: passed to :func:`model_card` (base_model, datasets, results, metrics, speedup, task,
            license, tags).
    """
    from huggingface_hub import HfApi

    tmp = None
    if isinstance(model_or_directory, nn.Module):
        tmp = tempfile.mkdtemp(prefix="hf_sms-push-")
        directory = save_sparse(
            model_or_directory,
            os.path.join(tmp, "model"),
            format,
            recipe=recipe,
            metrics=card_metrics(*(card_kwargs.get(k) for k in ("results", "metrics", "speedup", "measured"))),
            processing_class=processing_class,
        )
    else:
        directory = model_or_directory
    try:
        card = model_card(directory, repo_id, **card_kwargs)
        path = os.path.join(directory, CARD_NAME)
        with open(path + ".tmp", "w") as f:
            f.write(card)
        os.replace(path + ".tmp", path)
        files = published_files(directory)  # raises on a link out of the folder, before the repository exists
        api = HfApi(token=token)
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        logger.info("uploading %s to %s", directory, repo.repo_id)
        commit = api.upload_folder(
            repo_id=repo.repo_id,
            folder_path=directory,
            repo_type="model",
            commit_message=commit_message,
            revision=revision,
            create_pr=create_pr,
            # an explicit list: weights, configs, tokenizer/processor files, sparsity.json and the card; never
            # training_args.bin or optimizer state, never a file a symbolic link leads to outside the folder
            allow_patterns=[glob.escape(name) for name in files],
            ignore_patterns=[TMP_PREFIX + "*", "*.tmp"],
        )
        return getattr(commit, "commit_url", None) or str(commit)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
