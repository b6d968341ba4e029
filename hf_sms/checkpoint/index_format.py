"""The index format of an encoded tensor, numpy only: its header, its checksum and the positions it stores.

The index is a header (magic, version, codec, low-bit count k, ndim, nnz, unary bits, CRC-32) followed by
the shape (ndim little-endian uint64) and the positions, in the smallest of three codes chosen per tensor:
DENSE (all values, no positions), BITMASK (one bit per entry) and ELIAS_FANO (each position split into a
unary-coded high part and k low bits stored as bit-planes: within a few percent of the entropy bound at
high sparsity, and decoded without a prefix sum). The CRC-32 covers the values and the positions.
:mod:`~hf_sms.checkpoint.codec` encodes and decodes tensors with it; ``hf-sms inspect`` reads it without torch.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterator

import numpy as np

from .constants import FORMAT_VERSION
from .masks import floating

DENSE, BITMASK, ELIAS_FANO = 0, 1, 2
CHUNK_BITS = 1 << 18  # index bits decoded at a time (see position_chunks)
CODECS = {DENSE: "dense", BITMASK: "bitmask", ELIAS_FANO: "elias-fano"}
MAGIC = b"HSMS"
HEAD = struct.Struct("<4sBBBBQQI")  # magic, version, codec, low bits k, ndim, nnz, unary bits, crc32
CRC_AT = HEAD.size - 4
NDIM_AT = 7


def nbytes(nbits: int) -> int:
    return (nbits + 7) // 8


def parse_index_bytes(buf: np.ndarray, name: str) -> tuple[dict, np.ndarray]:
    """Validate an index's header and sizes.

    Args:
        buf: a ``W.sp_index`` tensor's bytes (uint8).
        name: the tensor's name, for error messages.

    Returns:
        ``(header, positions payload)``; the header has ``codec``, ``k``, ``shape``, ``numel``, ``nnz``,
        ``ubits`` and ``crc``. Raises ``ValueError`` naming the tensor if anything is off.
    """
    fix = f"The checkpoint is corrupted: re-save or re-download {name!r}'s file."
    if buf.dtype != np.uint8 or buf.size < HEAD.size:
        raise ValueError(f"sparse index of {name!r} is too short or not uint8. {fix}")
    magic, version, codec, k, ndim, nnz, ubits, crc = HEAD.unpack(buf[: HEAD.size].tobytes())
    if magic != MAGIC or codec not in CODECS:
        raise ValueError(f"sparse index of {name!r} has no valid header. {fix}")
    if version > FORMAT_VERSION:
        raise ValueError(f"{name!r} uses sparse format version {version}; upgrade hf-sms (knows {FORMAT_VERSION})")
    end = HEAD.size + 8 * ndim
    if buf.size < end:
        raise ValueError(f"sparse index of {name!r} is truncated. {fix}")
    shape = tuple(int(d) for d in buf[HEAD.size : end].view("<u8"))
    numel = math.prod(shape)
    expected = {DENSE: 0, BITMASK: nbytes(numel), ELIAS_FANO: nbytes(ubits) + k * nbytes(nnz)}[codec]
    if buf.size - end != expected or nnz > numel:
        raise ValueError(f"sparse index of {name!r} has {buf.size - end} payload bytes, expected {expected}. {fix}")
    head = dict(codec=codec, k=k, shape=shape, numel=numel, nnz=nnz, ubits=ubits, crc=crc)
    return head, buf[end:]


def position_chunks(head: dict, payload: np.ndarray, name: str) -> Iterator[np.ndarray]:
    """The flat positions (int64, increasing) of an index's stored values, a few hundred thousand at a time (none
    for DENSE: every position is stored). A chunk's arrays stay in a core's cache, where whole-tensor passes
    would go through memory several times. Raises ``ValueError`` on positions that do not add up, before
    yielding any that are out of order or out of range."""
    bad = f"sparse index of {name!r} is corrupted (positions do not add up); re-save or re-download the checkpoint"
    if head["codec"] == DENSE:
        return
    numel, nnz, k, step = head["numel"], head["nnz"], head["k"], max(1, CHUNK_BITS // 8)
    elias_fano = head["codec"] == ELIAS_FANO
    end = nbytes(head["ubits"]) if elias_fano else len(payload)  # where the bits scanned for ones end
    done, last, plane = 0, -1, nbytes(nnz)
    low_type = np.uint8 if k <= 8 else np.int64
    for at in range(0, end, step):
        # flatnonzero on a bool view is an order of magnitude faster than on uint8
        pos = np.flatnonzero(np.unpackbits(payload[at : min(at + step, end)], bitorder="little").view(bool))
        n = len(pos)
        if not n:
            continue
        if done + n > nnz:
            raise ValueError(bad)
        if not elias_fano:
            pos += 8 * at
        else:  # value done + i set unary bit (its high part) + done + i; its k low bits are in k bit-planes
            pos += 8 * at - done
            pos -= np.arange(n)
            if k:
                pos <<= k
                low, skip = np.zeros(n, low_type), done % 8
                for j in range(k):
                    start = end + j * plane + done // 8
                    bits = np.unpackbits(payload[start : start + (skip + n + 7) // 8], bitorder="little")
                    low |= bits[skip : skip + n].astype(low_type, copy=False) << low_type(j)
                pos |= low
        if pos[0] <= last or pos[-1] >= numel or (n > 1 and not (pos[1:] > pos[:-1]).all()):
            raise ValueError(bad)
        done, last = done + n, pos[-1]
        yield pos
    if done != nnz:
        raise ValueError(bad)


def check_values(head: dict, payload: np.ndarray, values: np.ndarray, count: int, dtype, name: str) -> None:
    """Raise ``ValueError`` naming the tensor unless ``count`` values of ``dtype`` (torch's or a safetensors name)
    whose bytes are ``values`` are what the index (``head``, ``payload``: :func:`parse_index_bytes`) expects,
    checksum included."""
    if count != head["nnz"] or not floating(dtype):
        raise ValueError(
            f"{name!r} has {count} stored values of dtype {dtype} but its index expects {head['nnz']} floating-point "
            "values; the checkpoint is corrupted or mixes files of two saves."
        )
    if zlib.crc32(payload, zlib.crc32(values)) != head["crc"]:
        raise ValueError(f"checksum mismatch in {name!r}: the checkpoint file is corrupted; re-save or re-download it")
