"""``hf-sms inspect``: what a checkpoint folder holds, measured from its stored tensors, and its report's text.

Sparsity, counts and mask hashes are measured from the weights, never taken from ``sparsity.json``;
where the record disagrees (edited by hand, or weights from another save) the report says so. Everything is read
as bytes with numpy (:class:`~hf_sms.checkpoint.files.CheckpointFiles`): the command starts without torch.
"""

from __future__ import annotations

import json
import math
import os
import zipfile

import numpy as np

from ..families import FAMILIES
from .constants import INDEX_SUFFIX, PROGRAM, SPARSITY_NAME, TIMM_WIDTHS
from .family_files import load_snippet
from .files import CheckpointFiles
from .index_format import CODECS, DENSE, check_values, parse_index_bytes, position_chunks
from .masks import MaskDigest, MaskStats, eligible, floating
from .program_check import check_program
from .safetensors_raw import DTYPE_SIZES

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


def _nonzero(raw: np.ndarray, dtype: str) -> np.ndarray:
    """``tensor != 0`` from a tensor's bytes: a float is zero when every bit but its sign is (+0.0 and -0.0)."""
    size = DTYPE_SIZES[dtype]
    bits = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
    if floating(dtype):
        bits = bits & bits.dtype.type((1 << (8 * size - 1)) - 1)
    return bits != 0


def _examine(files: CheckpointFiles, name: str, counted: set[str], stats: MaskStats) -> tuple[tuple, str]:
    """Read and check every byte of tensor ``name`` (its values and index), record its mask in ``stats`` if it is
    eligible or ``counted``; returns ``(shape, dtype name)`` of the dense tensor. ``ValueError`` names what is
    wrong."""
    dtype, shape = files.layout(name)
    values = files.stored_bytes(name)  # checked against its CRC where one is recorded
    if not files.is_encoded(name):
        if eligible(name, shape, dtype) or name in counted:
            stats.add(name, _nonzero(values, dtype), "dense", shape)
        return shape, dtype
    head, payload = parse_index_bytes(files.stored_bytes(name + INDEX_SUFFIX), name)
    check_values(head, payload, values, math.prod(shape), dtype, name)
    shape, codec = head["shape"], CODECS[head["codec"]]
    measured = eligible(name, shape, dtype) or name in counted
    if head["codec"] == DENSE:
        if measured:
            stats.add(name, _nonzero(values, dtype), codec, shape)
        return shape, dtype
    digest, nnz = MaskDigest(head["numel"]), 0
    for positions in position_chunks(head, payload, name):  # raises on positions that do not add up
        digest.add(positions)
        nnz += len(positions)
    if measured:
        stats.add_digest(name, shape, nnz, digest.digest(), codec)
    return shape, dtype


def verify_checkpoint(files: CheckpointFiles) -> tuple[list[str], dict[str, tuple], MaskStats]:
    """Every byte of a checkpoint read and checked: each stored tensor against its CRC, each encoded one's values
    and positions against its index, the masks against ``sparsity.json``'s hash.

    Returns:
        ``(problems, specs, stats)``: what is wrong (empty: verified), ``{name: (shape, dtype name)}`` of every
        tensor that could be read, and the mask statistics of the eligible tensors and those ``sparsity.json``
        lists.
    """
    recorded = (files.info or {}).get("per_tensor")
    counted = set(recorded) if isinstance(recorded, dict) else set()
    problems, specs, stats = [], {}, MaskStats()
    program = os.path.join(files.directory, PROGRAM)
    if os.path.isfile(program):  # the card tells users to run it: no entry torch would unpickle
        try:
            check_program(program)
        except (ValueError, zipfile.BadZipFile, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{PROGRAM}: {e}")
    for name in files.names():
        try:
            specs[name] = _examine(files, name, counted, stats)
        except ValueError as e:
            problems.append(str(e))
    names = files.hashed_names(n for n, (shape, dtype) in specs.items() if eligible(n, shape, dtype))
    if not problems and names is not None:
        try:
            files.check_mask_hash(stats, names)
        except ValueError as e:
            problems.append(str(e))
    return problems, specs, stats


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
    files = CheckpointFiles(directory)
    problems, specs, stats = verify_checkpoint(files)
    names = [n for n, (shape, dtype) in specs.items() if eligible(n, shape, dtype)]
    info = files.info
    measured = stats.summary([n for n in names if n in stats.per_tensor])
    mismatches = disagreements(info, stats) if info is not None else []
    dense_bytes = sum(math.prod(shape) * DTYPE_SIZES[dtype] for shape, dtype in specs.values())
    family = FAMILIES.get(files.library) if files.library in FAMILIES else None  # a hand-edited name gets a report
    location = os.path.abspath(directory)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return {
        "directory": location,
        "format": files.format,
        "library": files.library,
        "architecture": files.architecture,
        "size_on_disk": size,
        "weights_bytes": sum(os.path.getsize(f.path) for f in files.files),
        "dense_weights_bytes": dense_bytes,
        "sparsity": measured["sparsity"],
        "nnz": measured["nnz"],
        "numel": measured["numel"],
        "mask_hash": measured["mask_hash"],
        "integrity": problems or "verified",
        "manifest": _manifest(info),
        "sparsity_json": "missing" if info is None else ("mismatch" if mismatches else "matches"),
        "mismatches": mismatches,
        "recorded": {k: info.get(k) for k in _COMPARED} if info is not None else None,
        "recipe": (info or {}).get("recipe"),
        "metrics": (info or {}).get("metrics"),
        "how_to_load": (
            load_snippet(
                family, files.architecture, files.format, location, False, not files.cut_in_place, files.plain_route
            )
            if family
            else None
        ),
        "per_tensor": measured["per_tensor"],
    }


def _manifest(info: dict | None) -> str:
    recorded = (info or {}).get("files")
    if recorded is None:
        return "none (a folder saved without one)"
    plain = [n for n in (TIMM_WIDTHS, PROGRAM) if n in recorded]
    return f"checked ({', '.join(plain)} included)" if plain else "checked"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def format_report(report: dict) -> str:
    """The text of ``hf-sms inspect`` for a report of :func:`hf_sms.checkpoint.inspect_checkpoint`."""
    ratio = report["dense_weights_bytes"] / max(report["weights_bytes"], 1)
    lines = [
        f"directory:    {report['directory']}",
        f"model:        {report['library']} {report['architecture']}",
        f"format:       {report['format']}",
        f"size on disk: {_mb(report['size_on_disk'])} (weights {_mb(report['weights_bytes'])}, dense equivalent "
        f"{_mb(report['dense_weights_bytes'])}: {ratio:.1f}x compression)",
        f"sparsity:     {100 * report['sparsity']:.2f}% of {report['numel']:,} prunable weights "
        f"({report['nnz']:,} kept), mask {report['mask_hash']}, measured from the weights",
    ]
    if report["integrity"] == "verified":
        lines.append(
            f"integrity:    verified (every tensor read against its checksum; file manifest: {report['manifest']})"
        )
    else:
        lines.append("ERROR:        the stored bytes are corrupted; re-download the folder, or re-save it:")
        lines += [f"              - {p}" for p in report["integrity"]]
    if report["mismatches"]:
        lines.append("WARNING:      sparsity.json does not match the stored weights (edited by hand, or weights from")
        lines.append("              another save); the figures here are measured. Re-save the checkpoint to fix it.")
        lines += [f"              - {m}" for m in report["mismatches"]]
    for key in ("recipe", "metrics"):
        if report.get(key):
            lines.append(f"{key + ':':<13} {json.dumps(report[key])}")
    if report.get("how_to_load"):
        lines.append("how to load:")
        lines += [f"    {line}" if line else "" for line in report["how_to_load"].splitlines()]
    rows = report["per_tensor"]
    if rows:
        width = max(len(n) for n in rows)
        lines.append(f"\n{'tensor':<{width}}  {'shape':<20} {'sparsity':>9}  codec")
        for name, t in rows.items():
            shape = "x".join(map(str, t["shape"]))
            lines.append(f"{name:<{width}}  {shape:<20} {100 * t['sparsity']:>8.2f}%  {t['codec']}")
    return "\n".join(lines)


def run_inspect(args) -> int:
    """``hf-sms inspect DIR [--json]``: the report; exits 1 if the folder is corrupted or its record disagrees."""
    report = inspect_checkpoint(args.directory)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if report["integrity"] != "verified" or report["mismatches"]:
        return 1  # a script checking a download sees it fail
    return 0
