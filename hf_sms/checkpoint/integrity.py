"""One integrity check for every reader of a checkpoint folder.

Bytes are checked where they are read: every tensor stored as it is has a CRC-32 in its file's header (or, for a
dense folder's own files, in ``sparsity.json``), every encoded tensor a CRC-32 over its values and index in the
index. What binds each tensor to its *name* and each file to its *folder* is the manifest ``sparsity.json``
records (``files``): per weight file its size and the SHA-256 of its safetensors header, which holds every name,
dtype, shape, byte range and the CRC table, and of a sharded folder's index and a smaller model's plain route
(``pruned.txt``, ``model.pt2``: whole files). Two tensors swapped in a header, a
renamed tensor, a file from another save or a missing shard change a header, so :func:`check_manifest` refuses
them, naming the file, before any tensor is read. Every reader calls it (:class:`~hf_sms.checkpoint.reader.
SparseCheckpoint`: ``load_sparse``, ``merge``, ``convert``, ``inspect``, ``speed``; ``from_pretrained`` after
``import hf_sms``); ``hf-sms inspect`` also reads every byte (:func:`hf_sms.checkpoint.inspect.verify_checkpoint`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct

from .constants import INDEX_NAME, MANIFEST_SINCE, PROGRAM, SPARSITY_NAME, TIMM_WIDTHS

logger = logging.getLogger("hf_sms")

_FIX = "re-download the folder, or re-save it"


class CorruptionError(ValueError):
    """A folder whose bytes or files are not what it records (``hf-sms inspect`` exits 1; a folder it cannot read,
    2)."""


def _digest(path: str, header_only: bool) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if header_only:  # the 8-byte length and the JSON header: names, dtypes, shapes, offsets, CRC table
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
            h.update(raw + f.read(min(n, 100_000_000)))
        else:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _entry(folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    header = name.endswith(".safetensors")
    return {"bytes": os.path.getsize(path), ("header_sha256" if header else "sha256"): _digest(path, header)}


def _listed(folder: str, weight_paths: list[str]) -> list[str]:
    names = [os.path.relpath(p, folder) for p in weight_paths]
    # which file holds which tensor; a smaller model's plain route (the card tells users to run model.pt2)
    names += [n for n in (INDEX_NAME, TIMM_WIDTHS, PROGRAM) if os.path.lexists(os.path.join(folder, n))]
    return sorted(names)


def weight_manifest(folder: str, weight_paths: list[str]) -> dict:
    """``{file: {"bytes", "header_sha256" | "sha256"}}`` of a folder's weight files, its shard index and a smaller
    model's plain route (``pruned.txt``, ``model.pt2``), for ``sparsity.json``."""
    return {name: _entry(folder, name) for name in _listed(folder, weight_paths)}


_UNCHECKED: set[str] = set()  # folders already warned about


def require_manifest(folder: str, info: dict | None) -> None:
    """A folder of format version 2 or later must record its manifest (deleted or renamed: refused); an older
    hf-sms folder without one loads with a warning that its files are unchecked."""
    if info is None or info.get("files") is not None:
        return
    version = info.get("hf_sms_format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version >= MANIFEST_SINCE:
        raise CorruptionError(
            f"{folder}/{SPARSITY_NAME} (format version {version!r}) records no weight files ('files'): its manifest "
            f"was deleted or renamed, so its weights cannot be checked; {_FIX}"
        )
    if folder not in _UNCHECKED:
        _UNCHECKED.add(folder)
        why = "no file manifest: its files are not checked against its record; re-save it to add one"
        logger.warning("[hf-sms] %s was saved by hf-sms before 0.9 (%s)", folder, why)


def check_manifest(folder: str, info: dict | None, weight_paths: list[str]) -> None:
    """Raise ``ValueError`` naming the file if the folder's weight files are not the ones ``sparsity.json``
    records. A folder without a manifest (a family's own save, hf-sms before 0.9) is not checked here."""
    recorded = (info or {}).get("files")
    if recorded is None:
        return
    if not isinstance(recorded, dict) or not all(isinstance(v, dict) for v in recorded.values()):
        raise CorruptionError(f"{folder}/{SPARSITY_NAME} has a corrupted file manifest ('files'); {_FIX}")
    present = _listed(folder, weight_paths)
    extra = [n for n in present if n not in recorded]
    if extra:
        raise CorruptionError(
            f"{folder}: {extra[0]} is not one of the files {SPARSITY_NAME} records: it comes from another save "
            f"(or from hf-sms before plain routes were recorded); {_FIX}"
        )
    for name, want in recorded.items():
        if name not in present:
            raise CorruptionError(f"{folder}: the weight file {name} that {SPARSITY_NAME} records is missing; {_FIX}")
        have = _entry(folder, name)
        if have != {k: want.get(k) for k in have}:
            what = "header (tensor names, shapes, byte ranges, checksums)" if "header_sha256" in have else "content"
            raise CorruptionError(
                f"{folder}: the {what} of {name} differs from what {SPARSITY_NAME} records: tensors were renamed or "
                f"swapped, or the file comes from another save; {_FIX}"
            )
