"""The mask file of a :class:`~hf_sms.SparseSoupTrainer` checkpoint (``sparse_masks.safetensors``), with ALLR's d and
q, so a resumed run prunes and schedules as the interrupted one."""

from __future__ import annotations

import json
import logging
import math
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..atomic import atomic_path
from ..pruning.masks import PruningStep
from ..pruning.prunable import Masks
from .codec import crc32
from .constants import MASKS_NAME
from .folder import checkpoint_file
from .safetensors_raw import CRC_KEY

logger = logging.getLogger("hf_sms")


def save_masks(masks: Masks, directory: str, step: PruningStep | None = None) -> None:
    """Write a trainer checkpoint's masks (``sparse_masks.safetensors``), with ALLR's d and q of ``step``."""
    masks = {n: m.detach().cpu().contiguous() for n, m in masks.items()}
    # every other file hf-sms writes carries checksums: one changed byte here would zero a kept weight on resume
    metadata = {"format": "pt", CRC_KEY: json.dumps({n: crc32(m) for n, m in masks.items()})}
    if step is not None:  # ALLR's start rate depends on them, so a resumed run needs them back
        metadata.update(norm_fraction=repr(step.norm_fraction), phase_fraction=repr(step.phase_fraction))
    with atomic_path(os.path.join(directory, MASKS_NAME)) as tmp:
        save_file(masks, tmp, metadata=metadata)


def load_masks(directory: str) -> Masks | None:
    """The masks of a trainer checkpoint, checked against the CRC-32 of each recorded when they were saved."""
    read = _read_checked(directory)
    return read[1] if read is not None else None


def _read_checked(directory: str) -> tuple[str, Masks, dict] | None:
    """``(path, masks, metadata)`` of the folder's mask file, read once and checked; ``None`` if it has none."""
    path = checkpoint_file(directory, MASKS_NAME)  # a regular file inside the folder, or None
    if path is None:
        return None
    with safe_open(path, "pt") as f:
        meta, masks = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    recorded = meta.get(CRC_KEY)
    if recorded is None:
        logger.warning("[hf-sms] %s has no checksums (written before hf-sms recorded them): loaded unchecked", path)
        return path, masks, meta
    try:
        crcs = json.loads(recorded)
    except json.JSONDecodeError:
        crcs = None
    if not isinstance(crcs, dict) or set(crcs) != set(masks):
        raise ValueError(f"{path}: its checksum record does not list its masks; the file is corrupted")
    bad = [n for n, m in masks.items() if m.dtype != torch.bool or crc32(m) != crcs[n]]
    if bad:
        raise ValueError(
            f"{path}: masks {bad[:3]} differ from their checksums; the file is corrupted (re-train or resume from an "
            "earlier checkpoint)"
        )
    return path, masks, meta


def _fraction(meta: dict, key: str, path: str) -> float:
    try:
        value = float(meta[key])
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{path}: {key}={meta[key]!r} is not a fraction; the file is corrupted")
    return value


def load_pruning_step(directory: str, fallback: PruningStep) -> PruningStep | None:
    """The masks saved in ``directory`` with the step's ``d`` and ``q`` (``fallback``'s where not recorded)."""
    read = _read_checked(directory)
    if read is None:
        return None
    path, masks, meta = read
    if "norm_fraction" not in meta:
        return PruningStep(masks, fallback.norm_fraction, fallback.phase_fraction)
    return PruningStep(masks, _fraction(meta, "norm_fraction", path), _fraction(meta, "phase_fraction", path))
