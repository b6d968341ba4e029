"""``hf-sms inspect``: what a checkpoint folder holds, measured from its stored tensors.

Sparsity, counts and mask hashes are measured from the weights, never taken from ``sparsity.json``;
where the record disagrees (edited by hand, or weights from another save) the report says so.
"""

from __future__ import annotations

import math
import os

from .constants import SPARSITY_NAME
from .families import FAMILIES
from .masks import MaskStats, eligible
from .reader import SparseCheckpoint, check_masks

_COMPARED = ("sparsity", "nnz", "numel", "mask_hash")  # global figures of sparsity.json
# Not the codec: earlier merges recorded the inputs' codec for a dense output, which is not a wrong sparsity.
_COMPARED_PER_TENSOR = ("shape", "nnz", "sparsity", "mask_hash")


def _same(recorded, measured) -> bool:
    if isinstance(recorded, float) and isinstance(measured, float):
        return math.isclose(recorded, measured, rel_tol=1e-9, abs_tol=1e-12)
    return recorded == measured


def _show(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def disagreements(info: dict, stats: MaskStats) -> list[str]:
    """What a ``sparsity.json`` record claims that the stored tensors contradict.

    Args:
        info: the record.
        stats: measured statistics of (at least) the tensors the record lists.

    Returns:
        One line per disagreement; empty if the record matches. Tensors the record does not list are
        not compared, so records written under a narrower eligibility rule still match.
    """
    recorded = info.get("per_tensor")
    recorded = recorded if isinstance(recorded, dict) else {}
    missing = [n for n in recorded if n not in stats.per_tensor]
    lines = [f"per_tensor lists {len(missing)} tensors the weights lack, e.g. {missing[:3]}"] if missing else []
    measured = stats.summary(recorded or None)
    rows = [("", info, measured, _COMPARED)]
    rows += [
        (f"{n} ", row, stats.per_tensor[n], _COMPARED_PER_TENSOR)
        for n, row in recorded.items()
        if n in stats.per_tensor and isinstance(row, dict)
    ]
    for prefix, claimed, real, keys in rows:
        for key in keys:
            if key in claimed and not _same(claimed[key], real[key]):
                said, has = _show(claimed[key]), _show(real[key])
                lines.append(f"{prefix}{key}: {SPARSITY_NAME} says {said}, the stored weights have {has}")
    return lines


def verify_checkpoint(ckpt: SparseCheckpoint) -> list[str]:
    """Every byte of a checkpoint read and checked: each stored tensor against its CRC, each encoded one decoded
    against its index, the masks against ``sparsity.json``'s hash. Returns what is wrong (empty: verified)."""
    problems, dense = [], {}
    for f in ckpt.files:  # every stored tensor against its CRC (an encoded one's index is checked when decoded)
        for key in f.keys():
            try:
                f.read(key)
            except ValueError as e:
                problems.append(str(e))
    for name in ckpt.names():
        try:
            dense[name] = ckpt.read(name)
        except ValueError as e:
            problems.append(str(e))
    if not problems:
        try:
            check_masks(ckpt, dense)
        except ValueError as e:
            problems.append(str(e))
    return problems


def inspect_checkpoint(directory: str) -> dict:
    """Format, size on disk, measured sparsity (global and per tensor), recipe and metrics of a checkpoint folder.

    Args:
        directory: a folder written by :func:`hf_sms.save_sparse`, ``hf-sms merge`` or a family's own saver.

    Returns:
        A JSON-serialisable report. ``sparsity``, ``nnz``, ``numel``, ``mask_hash`` and ``per_tensor`` are
        measured from the weights; ``sparsity_json`` is ``"matches"``, ``"mismatch"`` (listed in
        ``mismatches``, with the ``recorded`` figures) or ``"missing"``. ``integrity`` is ``"verified"`` (every
        byte read and checked: :func:`verify_checkpoint`; the file manifest, where the
        folder has one) or the list of what is wrong. A folder whose files are not the ones ``sparsity.json`` records
        raises ``ValueError`` naming the file.
    """
    ckpt = SparseCheckpoint(directory)
    problems = verify_checkpoint(ckpt)
    specs = {name: ckpt.spec(name) for name in ckpt.names()}
    names = [n for n, (shape, dtype) in specs.items() if eligible(n, shape, dtype)]
    info = ckpt.info
    listed = [n for n in ((info or {}).get("per_tensor") or {}) if n in specs and n not in names]
    stats = MaskStats()
    for name in names + listed:  # a tensor whose index is corrupted is left out (integrity names it)
        try:
            stats.add(name, ckpt.mask(name), ckpt.codec(name))
        except ValueError:
            continue
    measured = stats.summary([n for n in names if n in stats.per_tensor])
    mismatches = disagreements(info, stats) if info is not None else []
    dense_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
    family = FAMILIES.get(ckpt.library) if ckpt.library in FAMILIES else None  # a hand-edited name gets a report
    location = os.path.abspath(directory)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return {
        "directory": location,
        "format": ckpt.format,
        "library": ckpt.library,
        "architecture": ckpt.architecture,
        "size_on_disk": size,
        "weights_bytes": sum(os.path.getsize(f.path) for f in ckpt.files),
        "dense_weights_bytes": dense_bytes,
        "sparsity": measured["sparsity"],
        "nnz": measured["nnz"],
        "numel": measured["numel"],
        "mask_hash": measured["mask_hash"],
        "integrity": problems or "verified",
        "manifest": "checked" if (info or {}).get("files") is not None else "none (a folder saved without one)",
        "sparsity_json": "missing" if info is None else ("mismatch" if mismatches else "matches"),
        "mismatches": mismatches,
        "recorded": {k: info.get(k) for k in _COMPARED} if info is not None else None,
        "recipe": (info or {}).get("recipe"),
        "metrics": (info or {}).get("metrics"),
        "how_to_load": (
            family.load_snippet(ckpt.architecture, ckpt.format, location, hub=False, own=not ckpt.cut_in_place)
            if family
            else None
        ),
        "per_tensor": measured["per_tensor"],
    }
