"""Header-validated byte access to one ``.safetensors`` file, numpy only (no pickle, no torch).

Every header entry is validated up front, so truncated or malformed files raise a ``ValueError`` before any
tensor is used; each read is checked against the CRC-32 hf-sms stored for that tensor. ``hf-sms inspect`` reads
through it without importing torch; :class:`~hf_sms.checkpoint.safetensors_io.SafetensorsFile` adds tensors.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib

import numpy as np

DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_MAX_HEADER = 100_000_000  # safetensors' own limit
FIX = "re-save the checkpoint or re-download the file"
CRC_KEY = "hf_sms_crc32"  # header metadata: {tensor name: CRC-32 of its bytes}


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class RawSafetensorsFile:
    """A ``.safetensors`` file whose header is validated; ``layout[key] = (dtype name, shape, begin, end)``."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                raise ValueError(f"{path} is not a valid safetensors file (bad or truncated header); {FIX}")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path} has a corrupted safetensors header ({e}); {FIX}") from None
        self.data_start = 8 + n
        self.metadata = header.pop("__metadata__", None) or {} if isinstance(header, dict) else None
        if not isinstance(self.metadata, dict) or not all(isinstance(v, str) for v in self.metadata.values()):
            raise ValueError(f"{path} has a corrupted safetensors header (its metadata is not text); {FIX}")
        try:  # CRC-32 of every tensor hf-sms stored as it is (an encoded tensor's index holds its own)
            self.crcs = json.loads(self.metadata.get(CRC_KEY, "{}"))
            assert isinstance(self.crcs, dict) and all(isinstance(v, int) for v in self.crcs.values())
        except (TypeError, ValueError, AssertionError):
            raise ValueError(f"{path} has corrupted hf-sms checksums in its header; {FIX}") from None
        self.layout: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for key, e in header.items():
            try:
                dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
                itemsize = DTYPE_SIZES[dtype]
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path}: entry {key!r} is malformed or has an unsupported dtype; {FIX}") from None
            if not all(_count(d) for d in (*shape, begin, end)):  # a float, a bool or a negative number
                raise ValueError(f"{path}: entry {key!r} has a shape or offsets that are not counts; {FIX}")
            if end - begin != math.prod(shape) * itemsize or begin < 0:
                raise ValueError(f"{path}: entry {key!r} has a size that does not match its shape; {FIX}")
            if self.data_start + end > size:
                raise ValueError(
                    f"{path} is truncated: {key!r} ends at byte {self.data_start + end} but the file has {size}; {FIX}"
                )
            self.layout[key] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self.layout)

    def _read_bytes(self, key: str, offset: int, nbytes: int) -> np.ndarray:
        buf = bytearray(nbytes)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + offset)
            if f.readinto(buf) != nbytes:
                raise ValueError(f"{self.path} is truncated while reading {key!r}; {FIX}")
        return np.frombuffer(buf, np.uint8)

    def _check(self, key: str, crc: int) -> None:
        if key in self.crcs and crc != self.crcs[key]:
            raise ValueError(f"checksum mismatch in {key!r} of {self.path}: the file is corrupted; {FIX}")

    def checked(self, key: str, raw: np.ndarray) -> np.ndarray:
        """``raw``, the bytes of tensor ``key``, once they match its CRC-32 where the file or folder records one."""
        if key in self.crcs:
            self._check(key, zlib.crc32(raw))
        return raw

    def read_bytes(self, key: str) -> np.ndarray:
        """The bytes of tensor ``key`` (uint8), checked (:meth:`checked`)."""
        _, _, begin, end = self.layout[key]
        return self.checked(key, self._read_bytes(key, begin, end - begin))
