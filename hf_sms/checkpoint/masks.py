"""Which tensors are stored sparse and the mask statistics recorded in ``sparsity.json``; numpy only (``hf-sms
inspect`` measures with them without importing torch)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# safetensors' floating-point dtype names (a file read without torch names its dtypes so)
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def eligible(name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype | str) -> bool:
    """Whether a tensor is stored sparse in the bitmask format and counted in the sparsity.

    Every weight :func:`hf_sms.prunable_tensors` can return qualifies: linear, convolution and embedding
    ``weight`` s and nn.MultiheadAttention's ``in_proj_weight`` / ``q_proj_weight`` / ``k_proj_weight`` /
    ``v_proj_weight``. The rule reads only the name, shape and dtype, not a model: loading, merging and
    inspecting must pick the same tensors as saving did, and they have only the files.

    Args:
        name: the tensor's name in the weight file.
        shape: its shape.
        dtype: its dtype: a torch dtype, or a safetensors dtype name (``"BF16"``).

    Returns:
        True for floating-point tensors of at least two dimensions whose name ends in ``weight``.
    """
    return floating(dtype) and len(shape) >= 2 and name.endswith("weight")


def floating(dtype: torch.dtype | str) -> bool:
    """Whether a torch dtype, or a safetensors dtype name (``"BF16"``), is a floating-point type."""
    return dtype in FLOAT_DTYPES if isinstance(dtype, str) else dtype.is_floating_point


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
        flat = np.asarray(mask).reshape(-1)  # a CPU torch tensor converts without a copy
        shape = shape if shape is not None else mask.shape
        self.add_digest(name, shape, int(np.count_nonzero(flat)), _mask_digest(flat), codec)

    def add_digest(self, name: str, shape: Iterable[int], nnz: int, digest: bytes, codec: str) -> None:
        """Record one tensor whose mask digest (:class:`MaskDigest`) and count of nonzeros are known."""
        shape = [int(d) for d in shape]
        numel = math.prod(shape)
        self._digests[name] = digest
        self.per_tensor[name] = {
            "shape": shape,
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


class MaskDigest:
    """The digest :class:`MaskStats` takes of a mask, from its nonzero positions given in increasing chunks
    (:func:`hf_sms.checkpoint.codec.position_chunks`): the bitmap is built and hashed a window at a time, in
    cache, never as a whole bool mask (8x the bitmap)."""

    def __init__(self, numel: int, window: int = 1 << 18):  # a multiple of 8: windows pack to whole bytes
        self._hash, self._numel, self._window, self._start = hashlib.sha256(), numel, window, 0
        self._bits = np.zeros(min(window, numel), dtype=bool)

    def _flush(self) -> None:
        n = min(self._window, self._numel - self._start)
        self._hash.update(np.packbits(self._bits[:n], bitorder="little"))
        self._bits[:n] = False
        self._start += self._window

    def add(self, positions: np.ndarray) -> None:
        """Mark ``positions`` (increasing, above those added before)."""
        while len(positions):
            while positions[0] >= self._start + self._window:
                self._flush()
            end = self._start + self._window
            cut = len(positions) if positions[-1] < end else int(np.searchsorted(positions, end))
            self._bits[positions[:cut] - self._start] = True
            positions = positions[cut:]

    def digest(self) -> bytes:
        while self._start < self._numel:
            self._flush()
        return self._hash.digest()
