"""Checkpoint folders: written atomically, and the one writer of ``sparsity.json``.

Every folder is written into a temporary folder next to the target (same file system, so the final
step is a rename) and moved into place only when complete: an error never leaves a half-written folder
and never touches an existing one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from ..atomic import atomic_write, user_modes
from .constants import (
    CARD_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    PUBLISHED_FILES,
    SPARSITY_NAME,
    STALE_FILES,
    TMP_PREFIX,
    WEIGHTS_NAME,
)

# How an existing target folder is treated when the new one is installed:
#   "new":     refuse it unless empty (merge without --overwrite);
#   "update":  replace its weight files and sparsity.json, keep its other files (save_sparse into a
#              Trainer's output_dir);
#   "replace": swap it out whole (merge --overwrite).
MODES = ("new", "update", "replace")


def read_json(path: str | None) -> dict | None:
    """The JSON object in ``path``, or ``None`` if there is no such file; ``ValueError`` if it is not JSON."""
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore it or re-save the checkpoint") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}, not an object; restore it or re-save the checkpoint"
        )
    return data


def write_json(path: str, data: dict) -> None:
    """Write ``data`` as indented JSON with a final newline (diff-friendly, like transformers' config files)."""
    with atomic_write(path) as f:
        json.dump(data, f, indent=2)
        f.write("\n")


_HUB_CACHE_REPO = re.compile(r"^(models|datasets|spaces)--[^/]+$")


def _hub_cache_blobs(directory: str) -> str | None:
    """The ``blobs`` folder of a huggingface_hub cache snapshot, else ``None``: there every file is a symbolic
    link into it.

    Only the cache's real layout counts: ``<models|datasets|spaces>--<id>/snapshots/<revision>``, with the
    snapshot, ``snapshots`` and ``blobs`` real folders (not links). A ``blobs`` that is itself a link could lead
    anywhere (a private folder), and every file there would pass for the snapshot's own.
    """
    snapshot = os.path.abspath(directory)
    snapshots = os.path.dirname(snapshot)
    repo = os.path.dirname(snapshots)
    blobs = os.path.join(repo, "blobs")
    layout = os.path.basename(snapshots) == "snapshots" and _HUB_CACHE_REPO.match(os.path.basename(repo))
    if not layout or any(os.path.islink(p) or not os.path.isdir(p) for p in (snapshot, snapshots, blobs)):
        return None
    return os.path.realpath(blobs)


def checkpoint_file(directory: str, name: str) -> str | None:
    """The path of the file ``name`` of a checkpoint folder, or ``None`` if there is none.

    Every file hf-sms reads or copies from a checkpoint comes through here: ``name`` must be a plain relative
    path that resolves, symbolic links followed, to a regular file inside ``directory`` (or, in a
    huggingface_hub cache snapshot, inside its repository's ``blobs``), else ``ValueError``: a folder from
    elsewhere can never make hf-sms read, copy or upload a file outside it.
    """
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts or not name:
        raise ValueError(f"{directory} names the file {name!r}, which is outside the folder; re-save the checkpoint")
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
        if os.path.isdir(directory) and not os.access(directory, os.R_OK | os.X_OK):  # else read as "no such file"
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), directory)
        return None
    real, roots = os.path.realpath(path), [os.path.realpath(directory), _hub_cache_blobs(directory)]
    if not any(r and os.path.commonpath([real, r]) == r for r in roots) or not os.path.isfile(real):
        raise ValueError(
            f"{path} is a symbolic link or special file that leads outside its checkpoint folder ({real}); hf-sms "
            "reads only regular files inside the folder: replace it with the file itself"
        )
    return path


def weight_files(directory: str) -> list[str]:
    """The safetensors files of a folder: the shards its index lists, else ``model.safetensors``."""
    index = read_json(checkpoint_file(directory, INDEX_NAME))
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(
                f"{directory}: {INDEX_NAME} has no weight_map of tensor names to file names; the index is corrupted, "
                "re-save or re-download the checkpoint"
            )
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if checkpoint_file(directory, n) is None]
        if missing or not names:
            raise ValueError(f"{directory}: {INDEX_NAME} lists missing weight files {missing}; re-save the checkpoint")
        return [os.path.join(directory, n) for n in names]
    path = checkpoint_file(directory, WEIGHTS_NAME)
    if path is not None:
        return [path]
    raise ValueError(
        f"{directory} holds no {WEIGHTS_NAME} (nor {INDEX_NAME}): it is not a checkpoint folder. Save one with "
        "hf_sms.save_sparse(model, directory) or the model family's save_pretrained / save_for_hf."
    )


def check_target(directory: str, mode: str, replace_hint: str = "replace it explicitly") -> None:
    """Raise ``ValueError`` if a folder may not be written to ``directory`` in ``mode`` (see ``MODES``).

    Args:
        directory: the target folder.
        mode: ``"new"``, ``"update"`` or ``"replace"``.
        replace_hint: how the caller's user asks for ``"replace"`` (e.g. a command-line flag), for the message.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{directory} is an existing file, not a folder; give a folder path (it is created)")
    if mode == "new" and os.path.isdir(directory) and os.listdir(directory):
        raise ValueError(f"{directory} exists and is not empty; choose a new folder or {replace_hint}")


PREVIOUS_SUFFIX = ".hf_sms-previous"  # an existing folder while its replacement is swapped in


@contextmanager
def atomic_folder(directory: str, mode: str = "new") -> Iterator[str]:
    """Write a folder atomically: yields a temporary folder to fill, installed at ``directory`` on success.

    An existing folder is replaced by two renames (it to ``<directory>.hf_sms-previous``, the new one into place),
    so a kill at any moment leaves either the old folder or the complete new one; one left between the two renames
    is put back by the next write to ``directory``.

    Args:
        directory: the target folder; its parent is created if missing.
        mode: how an existing ``directory`` is treated (see ``MODES``); checked before and after writing.

    Yields:
        The temporary folder, in ``directory``'s parent. It is removed if the body raises.
    """
    directory = os.path.abspath(directory)
    restore_previous(directory)
    check_target(directory, mode)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent)
    try:
        yield tmp
        check_target(directory, mode)  # something may have appeared there meanwhile
        user_modes(tmp)  # mkdtemp's 0700 and save_file's 0600 are for while it is written; then the user's own modes
        _install(tmp, directory, mode)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def restore_previous(directory: str) -> None:
    """Put back a folder a killed write left aside between its two renames (see :func:`atomic_folder`)."""
    previous = os.path.abspath(directory) + PREVIOUS_SUFFIX
    if os.path.isdir(previous):
        if os.path.exists(directory):  # the new one made it into place: the old one is no longer needed
            shutil.rmtree(previous, ignore_errors=True)
        else:
            os.replace(previous, directory)


def _install(tmp: str, directory: str, mode: str) -> None:
    if not os.path.exists(directory) or not os.listdir(directory):
        os.replace(tmp, directory)  # a rename replaces an empty folder too
        return
    if mode == "update":  # the existing folder's other files come along (hard links: no copy)
        new = set(os.listdir(tmp))
        for name in os.listdir(directory):
            src = os.path.join(directory, name)
            if name in new or STALE_FILES.match(name):
                continue
            dst = os.path.join(tmp, name)
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(src, dst)
    previous = directory + PREVIOUS_SUFFIX
    if os.path.islink(previous) or os.path.isfile(previous):  # hf-sms's name, not its folder: a link is unlinked,
        os.unlink(previous)  # never followed (nothing it points to is touched)
    elif os.path.isdir(previous):  # a killed replace's old folder, and the new one is in place: no longer needed
        shutil.rmtree(previous)
    os.replace(directory, previous)
    os.replace(tmp, directory)
    shutil.rmtree(previous, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def published_files(directory: str) -> list[str]:
    """The files of a checkpoint folder that may leave it (upload, a merge's copy): weights, config, tokenizer
    and processor files, ``sparsity.json`` and the model card (:data:`PUBLISHED_FILES`). Never a pickle
    (``training_args.bin`` holds the Hub token), optimizer state, or a file outside the folder."""
    names = sorted(n for n in os.listdir(directory) if PUBLISHED_FILES.match(n))
    return [n for n in names if checkpoint_file(directory, n) is not None]


def copy_companion_files(src: str, dst: str) -> None:
    """Copy a checkpoint's config and processor files (not its weights, sparsity.json or model card)."""
    for name in published_files(src):
        if not STALE_FILES.match(name) and name != CARD_NAME and not name.endswith(".safetensors"):
            shutil.copyfile(os.path.realpath(os.path.join(src, name)), os.path.join(dst, name))


def write_sparsity(
    folder: str,
    *,
    format: str,
    library: str,
    architecture: str,
    stats: dict,
    recipe: dict | None = None,
    metrics: dict | None = None,
    aliases: dict[str, str] | None = None,
    checksums: dict[str, int] | None = None,
    files: dict | None = None,
) -> dict:
    """Write ``sparsity.json``, the record that makes a folder an hf-sms checkpoint.

    Args:
        folder: the checkpoint folder.
        format: ``"bitmask"`` or ``"dense"``.
        library: the model family (see :mod:`hf_sms.families`).
        architecture: the class the family builds.
        stats: :meth:`MaskStats.summary` of the stored weights (sparsity, numel, nnz, mask_hash, per_tensor).
        recipe: the soup recipe.
        metrics: evaluation metrics.
        aliases: ``{name: kept name}`` of tensors stored once because they share storage.
        checksums: ``{name: CRC-32}`` of tensors in files hf-sms did not write (a dense folder keeps the family's).
        files: the weight files' manifest (:func:`hf_sms.checkpoint.integrity.weight_manifest`).

    Returns:
        The record written.
    """
    info = {
        "hf_sms_format_version": FORMAT_VERSION,
        "format": format,
        "library": library,
        "architecture": architecture,
        **stats,
        "recipe": recipe,
        "metrics": metrics,
    }
    if aliases:
        info["aliases"] = aliases
    if checksums:
        info["crc32"] = checksums
    if files is not None:
        info["files"] = files
    write_json(os.path.join(folder, SPARSITY_NAME), info)
    return info


def read_sparsity(folder: str) -> dict | None:
    """The ``sparsity.json`` record of a folder, or ``None`` if it has none."""
    return read_json(checkpoint_file(folder, SPARSITY_NAME))
