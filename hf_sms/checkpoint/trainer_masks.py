"""The mask file of a :class:`~hf_sms.SparseSoupTrainer` checkpoint (``sparse_masks.safetensors``), with ALLR's d and
q, so a resumed run prunes and schedules as the interrupted one."""

from __future__ import annotations

import os

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..atomic import atomic_path
from ..pruning.masks import PruningStep
from ..pruning.prunable import Masks
from .constants import MASKS_NAME
from .folder import checkpoint_file


def save_masks(masks: Masks, directory: str, step: PruningStep | None = None) -> None:
    """Write a trainer checkpoint's masks (``sparse_masks.safetensors``), with ALLR's d and q of ``step``."""
    metadata = {"format": "pt"}
    if step is not None:  # ALLR's start rate depends on them, so a resumed run needs them back
        metadata.update(norm_fraction=repr(step.norm_fraction), phase_fraction=repr(step.phase_fraction))
    with atomic_path(os.path.join(directory, MASKS_NAME)) as tmp:
        save_file({n: m.detach().cpu().contiguous() for n, m in masks.items()}, tmp, metadata=metadata)


def load_masks(directory: str) -> Masks | None:
    path = checkpoint_file(directory, MASKS_NAME)  # a regular file inside the folder, or None
    return load_file(path) if path is not None else None


def load_pruning_step(directory: str, fallback: PruningStep) -> PruningStep | None:
    """The masks saved in ``directory`` with the step's ``d`` and ``q`` (``fallback``'s where not recorded)."""
    masks = load_masks(directory)
    if masks is None:
        return None
    with safe_open(os.path.join(directory, MASKS_NAME), "pt") as f:
        meta = f.metadata() or {}
    if "norm_fraction" not in meta:
        return PruningStep(masks, fallback.norm_fraction, fallback.phase_fraction)
    return PruningStep(masks, float(meta["norm_fraction"]), float(meta["phase_fraction"]))
