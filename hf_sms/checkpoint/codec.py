"""Per-tensor encoding: one tensor <-> its nonzero values and a uint8 index that places them.

The index is a header (magic, version, codec, low-bit count k, ndim, nnz, unary bits, CRC-32) followed by
the shape (ndim little-endian uint64) and the positions, in the smallest of three codes chosen per tensor:
DENSE (all values, no positions), BITMASK (one bit per entry) and ELIAS_FANO (each position split into a
unary-coded high part and k low bits stored as bit-planes: within a few percent of the entropy bound at
high sparsity, and decoded without a prefix sum). The CRC-32 covers the values and the positions.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterator

import numpy as np
import torch

from .constants import FORMAT_VERSION

DENSE, BITMASK, ELIAS_FANO = 0, 1, 2
CHUNK_BITS = 1 << 18  # index bits decoded at a time (see position_chunks)
CODECS = {DENSE: "dense", BITMASK: "bitmask", ELIAS_FANO: "elias-fano"}
_MAGIC = b"HSMS"
_HEAD = struct.Struct("<4sBBBBQQI")  # magic, version, codec, low bits k, ndim, nnz, unary bits, crc32
_CRC_AT = _HEAD.size - 4
_NDIM_AT = 7
# Integer views of the same width let one numpy scatter place values of any float dtype (bf16 too).
_INT_VIEW = {
    1: (torch.uint8, np.uint8),
    2: (torch.int16, np.int16),
    4: (torch.int32, np.int32),
    8: (torch.int64, np.int64),
}


def _nbytes(nbits: int) -> int:
    return (nbits + 7) // 8


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes, as stored."""
    return zlib.crc32(_bytes_of(t.reshape(-1)) if t.numel() else b"")


def _elias_fano_k(numel: int, nnz: int) -> tuple[int, int]:
    """Low-bit count k minimising the Elias-Fano size; returns (k, bits of the unary high part)."""
    k0 = max(0, int(math.log2(numel / nnz))) if nnz else 0
    best = None
    for k in range(max(0, k0 - 1), k0 + 2):
        ubits = nnz + ((numel - 1) >> k) + 1
        size = _nbytes(ubits) + k * _nbytes(nnz)
        if best is None or size < best[0]:
            best = (size, k, ubits)
    return best[1], best[2]


def encode_tensor(tensor: torch.Tensor, codec: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``tensor`` into its nonzero values and an index (uint8) that places them.

    Args:
        tensor: any floating-point tensor.
        codec: force ``DENSE``, ``BITMASK`` or ``ELIAS_FANO``; by default the smallest is chosen.

    Returns:
        ``(values, index)``: 1-D values in ``tensor``'s dtype and the 1-D uint8 index.
    """
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return encode(flat, (flat != 0).numpy(), tuple(tensor.shape), codec)


def encode(
    flat: torch.Tensor, keep: np.ndarray, shape: tuple[int, ...], codec: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_tensor` of a flattened CPU tensor whose nonzero mask ``keep`` the caller already has.

    Args:
        flat: the tensor, flattened in row-major order, on the CPU.
        keep: ``flat != 0`` as a numpy bool array.
        shape: the tensor's shape, recorded in the index.
        codec: force a codec; by default the smallest is chosen.

    Returns:
        ``(values, index)`` as :func:`encode_tensor`.
    """
    numel, bpv = flat.numel(), flat.element_size()
    pos = np.flatnonzero(keep)
    nnz = len(pos)
    k, ubits = _elias_fano_k(numel, nnz) if nnz else (0, 0)
    sizes = {
        DENSE: numel * bpv,
        BITMASK: nnz * bpv + _nbytes(numel),
        ELIAS_FANO: nnz * bpv + _nbytes(ubits) + k * _nbytes(nnz),
    }
    codec = min(sizes, key=sizes.get) if codec is None else codec
    if codec == DENSE:
        values, payload, k, ubits, nnz = flat.clone(), [], 0, 0, numel
    elif codec == BITMASK:
        values, payload, k, ubits = flat[torch.from_numpy(pos)], [np.packbits(keep, bitorder="little")], 0, 0
    else:
        # Elias-Fano: the i-th position p sets bit (p >> k) + i of the unary part; its k low bits are
        # stored in k bit-planes. Decoding is a nonzero scan, a subtraction and a shift.
        unary = np.zeros(ubits, dtype=bool)
        unary[(pos >> k) + np.arange(nnz)] = True
        low = (pos & ((1 << k) - 1)).astype(np.uint8 if k <= 8 else np.int64)
        planes = [np.packbits((low >> low.dtype.type(j)) & 1, bitorder="little") for j in range(k)]
        values, payload = flat[torch.from_numpy(pos)], [np.packbits(unary, bitorder="little"), *planes]
    crc = zlib.crc32(_bytes_of(values))
    for part in payload:
        crc = zlib.crc32(part, crc)
    head = _HEAD.pack(_MAGIC, FORMAT_VERSION, codec, k, len(shape), nnz, ubits, crc)
    dims = np.asarray(shape, dtype="<u8").view(np.uint8)
    index = np.concatenate([np.frombuffer(head, np.uint8), dims, *payload])
    return values, torch.from_numpy(index)


def parse_index(index: torch.Tensor, name: str) -> tuple[dict, np.ndarray]:
    """Validate an index's header and sizes.

    Args:
        index: a ``W.sp_index`` tensor.
        name: the tensor's name, for error messages.

    Returns:
        ``(header, positions payload)``; the header has ``codec``, ``k``, ``shape``, ``numel``, ``nnz``,
        ``ubits`` and ``crc``. Raises ``ValueError`` naming the tensor if anything is off.
    """
    buf = index.detach().to("cpu").contiguous().numpy()
    fix = f"The checkpoint is corrupted: re-save or re-download {name!r}'s file."
    if buf.dtype != np.uint8 or buf.size < _HEAD.size:
        raise ValueError(f"sparse index of {name!r} is too short or not uint8. {fix}")
    magic, version, codec, k, ndim, nnz, ubits, crc = _HEAD.unpack(buf[: _HEAD.size].tobytes())
    if magic != _MAGIC or codec not in CODECS:
        raise ValueError(f"sparse index of {name!r} has no valid header. {fix}")
    if version > FORMAT_VERSION:
        raise ValueError(f"{name!r} uses sparse format version {version}; upgrade hf-sms (knows {FORMAT_VERSION})")
    end = _HEAD.size + 8 * ndim
    if buf.size < end:
        raise ValueError(f"sparse index of {name!r} is truncated. {fix}")
    shape = tuple(int(d) for d in buf[_HEAD.size : end].view("<u8"))
    numel = math.prod(shape)
    expected = {DENSE: 0, BITMASK: _nbytes(numel), ELIAS_FANO: _nbytes(ubits) + k * _nbytes(nnz)}[codec]
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
    end = _nbytes(head["ubits"]) if elias_fano else len(payload)  # where the bits scanned for ones end
    done, last, plane = 0, -1, _nbytes(nnz)
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


def verified(values: torch.Tensor, index: torch.Tensor, name: str) -> tuple[dict, torch.Tensor, np.ndarray]:
    """``(header, flat CPU values, positions payload)`` once the values' count, dtype and checksum match the
    index; the positions are left encoded (see :func:`position_chunks`)."""
    head, payload = parse_index(index, name)
    values = values.detach().to("cpu").contiguous().reshape(-1)
    if values.numel() != head["nnz"] or not values.is_floating_point():
        raise ValueError(
            f"{name!r} has {values.numel()} stored values of dtype {values.dtype} but its index expects "
            f"{head['nnz']} floating-point values; the checkpoint is corrupted or mixes files of two saves."
        )
    if zlib.crc32(payload, zlib.crc32(_bytes_of(values))) != head["crc"]:
        raise ValueError(f"checksum mismatch in {name!r}: the checkpoint file is corrupted; re-save or re-download it")
    return head, values, payload


def decode_tensor(values: torch.Tensor, index: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """Inverse of :func:`encode_tensor`.

    Args:
        values: the stored values (1-D).
        index: their index.
        name: the tensor's name, for error messages.

    Returns:
        The dense tensor, on ``values``' device. Raises ``ValueError`` on a checksum or size mismatch.
    """
    device = values.device
    head, values, payload = verified(values, index, name)
    if head["codec"] == DENSE:
        out = values.clone()
    else:
        # numpy's zeros is lazily zeroed memory (calloc): much faster than torch.zeros + index_put for
        # large tensors. Values are placed chunk by chunk, as the positions decode.
        view = _INT_VIEW[values.element_size()]
        flat, stored, done = np.zeros(head["numel"], dtype=view[1]), values.view(view[0]).numpy(), 0
        for chunk in position_chunks(head, payload, name):
            flat[chunk] = stored[done : done + len(chunk)]
            done += len(chunk)
        out = torch.from_numpy(flat).view(values.dtype)
    return out.reshape(head["shape"]).to(device)


def decode_positions(values: torch.Tensor, index: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, dict]:
    """The flat row-major positions (int64, increasing) of an encoded tensor's stored values, checksum
    verified, without materialising the dense tensor. Returns ``(positions, header)``; for the DENSE codec
    (every value stored) the positions of its nonzeros."""
    head, values, payload = verified(values, index, name)
    if head["codec"] == DENSE:
        return torch.nonzero(values).reshape(-1), head
    chunks = list(position_chunks(head, payload, name))
    return torch.from_numpy(np.concatenate(chunks) if chunks else np.zeros(0, np.int64)), head


def index_mask(index: torch.Tensor, name: str = "tensor") -> torch.Tensor | None:
    """The bool mask (True = stored) an index describes, without the values; ``None`` for DENSE."""
    head, payload = parse_index(index, name)
    if head["codec"] == DENSE:
        return None
    mask = np.zeros(head["numel"], dtype=bool)
    for chunk in position_chunks(head, payload, name):
        mask[chunk] = True
    return torch.from_numpy(mask).reshape(head["shape"])


def stored_mask(values: torch.Tensor, index: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """The nonzero mask of an encoded tensor: from its index, or from its values if the codec is DENSE."""
    mask = index_mask(index, name)
    return mask if mask is not None else values.reshape(parse_index(index, name)[0]["shape"]) != 0


def index_info(index: torch.Tensor, name: str = "tensor") -> dict:
    """Header of an index: ``codec`` (name), ``shape``, ``numel``, ``nnz`` (stored values)."""
    head, _ = parse_index(index, name)
    return {"codec": CODECS[head["codec"]], "shape": list(head["shape"]), "numel": head["numel"], "nnz": head["nnz"]}


def restamp_index(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``index`` re-stamped with the CRC of new ``values`` (same mask, e.g. after averaging)."""
    head, payload = parse_index(index, "merged tensor")
    out = index.clone().numpy()
    crc = zlib.crc32(payload, zlib.crc32(_bytes_of(values)))
    out[_CRC_AT : _HEAD.size] = np.frombuffer(struct.pack("<I", crc), np.uint8)
    return torch.from_numpy(out)


def mask_part(index: torch.Tensor) -> bytes:
    """The bytes of an index that depend on the mask only (everything but the CRC)."""
    b = index.numpy().tobytes()
    return b[:_CRC_AT] + b[_HEAD.size :]


def header_key(index: torch.Tensor) -> bytes:
    """The header and shape bytes of an index: equal for two tensors only if codec, shape, nnz and CRC agree."""
    buf = (index if index.device.type == "cpu" else index.cpu()).numpy()
    ndim = int(buf[_NDIM_AT]) if buf.size >= _HEAD.size else 0
    return buf[: _HEAD.size + 8 * ndim].tobytes()
