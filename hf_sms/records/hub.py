"""Sharing soups on the Hugging Face Hub: ``push_to_hub`` with the folder's generated model card
(:mod:`hf_sms.checkpoint.card`). Authentication is huggingface_hub's own (``token=`` or ``hf auth login``); the
token is never printed or logged.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from torch import nn

from ..checkpoint import save_sparse
from ..checkpoint.card import (  # noqa: F401  (the card's names, importable from here as before)
    CARD_MARK,
    MEASURED,
    SHRUNK,
    SPEEDUP,
    card_metrics,
    is_generated_card,
    metric_type,
    model_card,
    model_index,
    results_table,
)
from ..checkpoint.constants import CARD_NAME
from ..checkpoint.folder import published_files

logger = logging.getLogger(__name__)
CARD_MODES = ("generate", "replace", "keep")


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
    card: str = "generate",
    **card_kwargs,
) -> str:
    """Upload a soup with a generated model card; returns the commit URL.

    Nothing is written into a given folder: its published files are uploaded from where they are (each checked
    to be a regular file inside it), and the card from memory. So a link planted in the folder can never make
    hf-sms write a file, and the user's own ``README.md`` stays as it is.

    Args:
        model_or_directory: a checkpoint folder from :func:`hf_sms.save_sparse`, or a model (saved to a
            temporary folder in ``format`` with ``recipe`` and ``processing_class`` first).
        repo_id: ``"user/name"``; created if missing.
        token: a Hub token; by default huggingface_hub's login. Never printed or logged.
        private, revision, create_pr, commit_message: as in ``HfApi.create_commit`` / ``create_repo``.
        card: ``"generate"`` uploads hf-sms's card as ``README.md`` and refuses a folder whose ``README.md`` hf-sms
            did not write; ``"replace"`` uploads the generated card in place of that one (the local file is
            kept); ``"keep"`` uploads the folder's ``README.md`` as it is.
        **card_kwargs: passed to :func:`model_card` (base_model, datasets, results, metrics, speedup, task,
            license, tags).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    if card not in CARD_MODES:
        raise ValueError(f"card must be one of {CARD_MODES}, got {card!r}")
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
        files = published_files(directory)  # raises on a link out of the folder, before the repository exists
        own = CARD_NAME in files and not is_generated_card(os.path.join(directory, CARD_NAME))
        if own and card == "generate":
            raise ValueError(
                f"{directory}/{CARD_NAME} is a card hf-sms did not write; pass card='keep' to upload it as it is, "
                "or card='replace' to upload hf-sms's generated card instead (your file stays in the folder)"
            )
        # each file is read from its resolved path, which checkpoint_file found inside the folder
        uploads = [
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.realpath(os.path.join(directory, name)))
            for name in files
            if name != CARD_NAME or card == "keep"
        ]
        if card != "keep" or CARD_NAME not in files:
            text = model_card(directory, repo_id, **card_kwargs)
            uploads.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=text.encode()))
        api = HfApi(token=token)
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        logger.info("uploading %s to %s", directory, repo.repo_id)
        # an explicit list: weights, configs, tokenizer/processor files, sparsity.json and the card; never
        # training_args.bin or optimizer state, never a file a symbolic link leads to outside the folder
        commit = api.create_commit(
            repo_id=repo.repo_id,
            operations=uploads,
            repo_type="model",
            commit_message=commit_message,
            revision=revision,
            create_pr=create_pr,
        )
        return (create_pr and getattr(commit, "pr_url", None)) or getattr(commit, "commit_url", None) or str(commit)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
