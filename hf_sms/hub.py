"""Sharing soups on the Hugging Face Hub: a generated model card and ``push_to_hub``.

The model card is YAML front matter (library_name, tags, base_model, datasets, metrics) plus Markdown
(sparsity, size, speedup, the per-phase table of the recipe, how to load). Authentication is
huggingface_hub's own (``token=`` or ``hf auth login``); the token is never printed or logged.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import yaml
from torch import nn

from .checkpoint import save_sparse
from .checkpoint.constants import CARD_NAME, SPARSITY_NAME, TMP_PREFIX
from .checkpoint.families import FAMILIES, Family
from .checkpoint.folder import read_sparsity

logger = logging.getLogger(__name__)


def _read_info(directory: str) -> dict:
    info = read_sparsity(directory)
    if info is None:
        raise ValueError(f"{directory} has no {SPARSITY_NAME}; save the model with hf_sms.save_sparse first")
    return info


def _family(info: dict) -> Family:
    return FAMILIES.get(info.get("library"), FAMILIES["torch"])


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _how_to_load(info: dict, repo: str) -> str:
    snippet = _family(info).load_snippet(info.get("architecture"), info.get("format"), repo, hub=True)
    return "```python\n" + snippet + "\n```"


def model_card(
    directory: str,
    repo_id: str | None = None,
    *,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    metrics: dict | None = None,
    speedup: str | float | None = None,
    license: str | None = None,
    tags: list[str] | None = None,
) -> str:
    """The model card (``README.md`` text) of a checkpoint folder written by :func:`hf_sms.save_sparse`.

    Args:
        directory: the checkpoint folder; its ``sparsity.json`` supplies sparsity, recipe and metrics.
        repo_id: the Hub repository, used in the loading snippet.
        base_model: Hub id of the dense model the soup was pruned from.
        datasets: Hub ids of the training datasets.
        metrics: metric name -> value; defaults to the metrics in ``sparsity.json``.
        speedup: measured speedup (a number is read as "x times faster"); omitted if unknown.
        license, tags: extra front matter.
    """
    info = _read_info(directory)
    metrics = metrics if metrics is not None else info.get("metrics") or {}
    recipe = info.get("recipe") or {}
    repo = repo_id or os.path.basename(os.path.abspath(directory))
    meta = {
        "library_name": _family(info).hub_library_name,
        "tags": list(dict.fromkeys(["hf-sms", "sparse", "pruning", "model-soup", *(tags or [])])),
    }
    if license:
        meta["license"] = license
    if base_model:
        meta["base_model"] = base_model
    if datasets:
        meta["datasets"] = list(datasets)
    if metrics:
        meta["metrics"] = list(metrics)

    weights = sum(
        os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors")
    )
    sparsity = info.get("sparsity") or 0.0
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
        "- Speedup: "
        + (f"{speedup}x" if isinstance(speedup, (int, float)) else (str(speedup) if speedup else "not measured"))
        + " (unstructured sparsity runs faster only with sparse kernels; it always shrinks the checkpoint).",
    ]
    if recipe:
        body += ["", "## Recipe", ""]
        body += [f"- {k}: {_cell(v)}" for k, v in recipe.items() if k != "phases"]
        phases = recipe.get("phases")
        if phases:
            body += ["", _table([p if isinstance(p, dict) else {"phase": p} for p in phases])]
    if metrics:
        body += ["", "## Metrics", "", _table([{"metric": k, "value": v} for k, v in metrics.items()])]
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
        **card_kwargs: passed to :func:`model_card` (base_model, datasets, metrics, speedup, license, tags).
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
            metrics=card_kwargs.get("metrics"),
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
            ignore_patterns=[TMP_PREFIX + "*", "*.tmp"],
        )
        return getattr(commit, "commit_url", None) or str(commit)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
