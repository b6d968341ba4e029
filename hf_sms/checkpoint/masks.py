"""Which tensors are stored sparse, and the mask statistics recorded in ``sparsity.json``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .constants import SPARSITY_NAME

if TYPE_CHECKING:
    from .reader import SparseCheckpoint  # reader imports this module


def eligible(name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> bool:
    """Whether a tensor is stored sparse in the bitmask format and counted in the sparsity.

    Every weight :func:`hf_sms.prunable_tensors` can return qualifies: linear, convolution and embedding
    ``weight`` s and nn.MultiheadAttention's ``in_proj_weight`` / ``q_proj_weight`` / ``k_proj_weight`` /
    ``v_proj_weight``. The rule reads only the name, shape and dtype, not a model: loading, merging and
    inspecting must pick the same tensors as saving did, and they have only the files.

    Args:
        name: the tensor's name in the weight file.
        shape: its shape.
        dtype: its dtype.

    Returns:
        True for floating-point tensors of at least two dimensions whose name ends in ``weight``.
    """
    return dtype.is_floating_point and len(shape) >= 2 and name.endswith("weight")


def _sparsity(nnz: int, numel: int) -> float:
    return 1.0 - nnz / numel if numel else 0.0


def _mask_digest(flat: np.ndarray) -> bytes:
    return hashlib.sha256(np.packbits(flat, bitorder="little").tobytes()).digest()


class MaskStats:
    """Per-tensor sparsity and mask hashes of the eligible tensors, and their summary for ``sparsity.json``."""

    def __init__(self):
        self.per_tensor: dict[str, dict] = {}
        self._digests: dict[str, bytes] = {}

    def add(self, name: str, mask: torch.Tensor | np.ndarray, codec: str, shape: Iterable[int] | None = None) -> None:
        """Record one tensor.

        Args:
            name: the tensor's name.
            mask: its nonzero mask (any shape; flattened in row-major order).
            codec: how it is stored (``"dense"``, ``"bitmask"`` or ``"elias-fano"``).
            shape: its shape, if ``mask`` is flat.
        """
        flat = (mask.numpy() if isinstance(mask, torch.Tensor) else mask).reshape(-1)
        numel, nnz = flat.size, int(np.count_nonzero(flat))
        digest = _mask_digest(flat)
        self._digests[name] = digest
        self.per_tensor[name] = {
            "shape": list(shape if shape is not None else mask.shape),
            "numel": numel,
            "nnz": nnz,
            "sparsity": _sparsity(nnz, numel),
            "codec": codec,
            "mask_hash": digest.hex()[:16],
        }

    def summary(self, names: Iterable[str] | None = None) -> dict:
        """Global sparsity, counts, mask hash and per-tensor rows, over ``names`` (default: every tensor added).

        The mask hash is a SHA-256 over the sorted names and each mask's digest, so it identifies the mask
        of the whole model independently of the order tensors were added in.
        """
        names = list(self.per_tensor) if names is None else [n for n in names if n in self.per_tensor]
        numel = sum(self.per_tensor[n]["numel"] for n in names)
        nnz = sum(self.per_tensor[n]["nnz"] for n in names)
        h = hashlib.sha256()
        for name in sorted(names):
            h.update(name.encode() + b"\0" + self._digests[name])
        return {
            "sparsity": _sparsity(nnz, numel),
            "numel": numel,
            "nnz": nnz,
            "mask_hash": "sha256:" + h.hexdigest(),
            "per_tensor": {n: self.per_tensor[n] for n in names},
        }


def check_masks(ckpt: SparseCheckpoint, state_dict: dict[str, torch.Tensor] | None, stats: MaskStats | None = None):
    """Raise if the loaded weights do not have the mask hash recorded in ``sparsity.json``.

    The masks come from ``state_dict`` (dense tensors), else from ``stats`` (digests a loader recorded while
    reading, e.g. from stored positions), else from the stored indices.
    """
    expected = (ckpt.info or {}).get("mask_hash")
    if not expected:
        return
    # The hash covers the tensors the saver counted; recomputing over the same names keeps checkpoints
    # valid when the eligibility rule grows (e.g. MultiheadAttention's in_proj_weight).
    recorded = (ckpt.info or {}).get("per_tensor")
    names = (
        list(recorded) if recorded is not None else [n for n, t in state_dict.items() if eligible(n, t.shape, t.dtype)]
    )
    if stats is None:
        stats = MaskStats()
        stored = set(ckpt.names())
        for name in names:
            if state_dict is None and name in stored:
                stats.add(name, ckpt.mask(name), "")
            elif state_dict is not None and name in state_dict:
                stats.add(name, state_dict[name] != 0, "")
    if any(n not in stats.per_tensor for n in names) or stats.summary(names)["mask_hash"] != expected:
        raise ValueError(
            f"the weights of {ckpt.directory} do not have the mask recorded in {SPARSITY_NAME}: weight files and "
            "metadata come from different saves or a file is corrupted. Re-save the checkpoint."
        )


def positions_mask(positions: torch.Tensor, numel: int) -> np.ndarray:
    """The flat bool mask of the given nonzero positions."""
    mask = np.zeros(numel, dtype=bool)
    mask[positions.numpy()] = True
    return mask
