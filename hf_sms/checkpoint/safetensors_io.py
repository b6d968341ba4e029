"""Reading safetensors files tensor by tensor (no pickle) and writing hf-sms weight files.

The reader opens the file per read instead of mapping it, so streaming over many files does not keep
them all resident; a loader whose tensors stay in the model anyway can map them instead (``mapped=True``:
no copy). Every header entry is validated up front, so truncated or malformed files raise a ``ValueError``
before any tensor is used.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import tempfile
import zlib

import numpy as np
import torch

from ..atomic import atomic_write
from . import codec
from .constants import FORMAT_VERSION, INDEX_SUFFIX
from .masks import MaskStats, eligible
from .safetensors_raw import CRC_KEY, RawSafetensorsFile

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def workers() -> int:
    """Threads for reading and decoding: numpy, zlib and file reads release the GIL; more than 4 rarely help."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


class SafetensorsFile(RawSafetensorsFile):
    """A :class:`RawSafetensorsFile` read as torch tensors; each :meth:`read` reads one tensor.
    ``entries[key] = (torch dtype, shape, begin, end)``."""

    def __init__(self, path: str):
        super().__init__(path)
        self._map: mmap.mmap | None = None
        self._progress: dict[str, tuple[int, int]] = {}  # key: (next element, CRC so far) of sequential chunks
        self.entries = {k: (_DTYPES[d], shape, b, e) for k, (d, shape, b, e) in self.layout.items()}

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the flattened tensor ``key``; chunks read in order from 0 are checked
        against the tensor's checksum when the last one is read."""
        dtype, shape, begin, _ = self.entries[key]
        raw = self._read_bytes(key, begin + start * dtype.itemsize, (stop - start) * dtype.itemsize)
        at, crc = self._progress.pop(key, (0, 0))
        if start == at:
            crc = zlib.crc32(raw, crc)
            if stop == math.prod(shape):
                self._check(key, crc)
            else:
                self._progress[key] = (stop, crc)
        return torch.from_numpy(raw).view(dtype)

    def read(self, key: str, mapped: bool = False) -> torch.Tensor:
        """The tensor ``key``, in its dtype and shape; with ``mapped``, a view of a copy-on-write mapping of the
        file (no read, no copy: pages come from the page cache when first used; writing to it leaves the file
        as it is)."""
        dtype, shape, begin, end = self.entries[key]
        at = self.data_start + begin
        if mapped and at % dtype.itemsize == 0:  # safetensors does not promise aligned offsets
            if self._map is None:  # two threads may both map it: harmless
                with open(self.path, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            raw = self.checked(key, np.frombuffer(self._map, np.uint8, end - begin, at))
        else:
            raw = self.read_bytes(key)
        return torch.from_numpy(raw).view(dtype).reshape(shape)


class WeightsWriter:
    """Writes one weight file in a format, with the mask statistics of the eligible tensors.

    Each tensor goes to a spool file (in ``spool_dir``, e.g. the folder being written) as it is added, and
    :meth:`save` writes the safetensors header and copies the spooled bytes after it: writing a model's weights
    holds one tensor at a time, never the file's worth (safetensors' own writer needs every tensor in memory at
    once). The layout is safetensors' own: tensors ordered by dtype size, then name, with contiguous offsets. The
    spool needs the file's size in free disk until :meth:`save` has copied it.
    """

    def __init__(self, fmt: str, spool_dir: str | None = None):
        self.fmt = fmt
        self.stats = MaskStats()
        self._spool = tempfile.TemporaryFile(dir=spool_dir)
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}  # dtype, shape, at, bytes
        self._crcs: dict[str, int] = {}  # tensors stored as they are (an encoded tensor's index checks its values)

    def _put(self, name: str, tensor: torch.Tensor, check: bool = False) -> None:
        t = tensor.detach().to("cpu").contiguous()
        data = codec.bytes_of(t)
        self._entries[name] = (t.dtype, tuple(t.shape), self._spool.tell(), data.nbytes)
        self._spool.write(data)
        if check:
            self._crcs[name] = zlib.crc32(data)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add a dense tensor, encoding it if it is eligible and the format is bitmask."""
        t = tensor.detach().to("cpu").contiguous()
        if not eligible(name, t.shape, t.dtype):
            self._put(name, t, check=True)
            return
        flat = t.reshape(-1)
        keep = (flat != 0).numpy()
        if self.fmt == "bitmask":
            values, index = codec.encode(flat, keep, tuple(t.shape))
            self._put(name, values)
            self._put(name + INDEX_SUFFIX, index)
            self.stats.add(name, keep, codec.index_info(index, name)["codec"], t.shape)
        else:
            self._put(name, t, check=True)
            self.stats.add(name, keep, "dense", t.shape)

    def add_encoded(self, name: str, values: torch.Tensor, index: torch.Tensor) -> None:
        """Add a tensor given as ``(values, index)`` without re-encoding it in the bitmask format.

        Args:
            name: the tensor's name.
            values: its stored values (e.g. averaged values under an unchanged index).
            index: the index placing them.
        """
        info = codec.index_info(index, name)
        if self.fmt == "bitmask":
            self._put(name, values)
            self._put(name + INDEX_SUFFIX, index)
        else:
            self._put(name, codec.decode_tensor(values, index, name), check=True)
        if eligible(name, info["shape"], values.dtype):
            mask = codec.stored_mask(values, index, name)
            self.stats.add(name, mask, info["codec"] if self.fmt == "bitmask" else "dense")

    def save(self, path: str) -> MaskStats:
        """Write the added tensors to ``path`` with a CRC-32 of each one stored as it is (biases, norms,
        BatchNorm statistics, dense weights; an encoded tensor's index checks its values); returns the mask
        statistics."""
        metadata = {"format": "pt", "hf_sms": f"{self.fmt}-v{FORMAT_VERSION}", CRC_KEY: json.dumps(self._crcs)}
        order = sorted(self._entries, key=lambda k: (-self._entries[k][0].itemsize, k))
        header, offset = {"__metadata__": metadata}, 0
        for k in order:
            dtype, shape, _, n = self._entries[k]
            header[k] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with atomic_write(path, "wb", encoding=None) as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for k in order:
                _, _, at, n = self._entries[k]
                self._spool.seek(at)
                while n > 0:
                    part = self._spool.read(min(n, 1 << 24))
                    f.write(part)
                    n -= len(part)
        self._spool.close()
        return self.stats
