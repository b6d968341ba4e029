"""Per-tensor encoding: one tensor <-> its nonzero values and a uint8 index that places them (the index format:
:mod:`~hf_sms.checkpoint.index_format`)."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import torch

from .constants import FORMAT_VERSION
from .index_format import (
    BITMASK,
    CODECS,
    CRC_AT,
    DENSE,
    ELIAS_FANO,
    HEAD,
    MAGIC,
    NDIM_AT,
    check_values,
    nbytes,
    parse_index_bytes,
    position_chunks,
)

# Integer views of the same width let one numpy scatter place values of any float dtype (bf16 too).
_INT_VIEW = {
    1: (torch.uint8, np.uint8),
    2: (torch.int16, np.int16),
    4: (torch.int32, np.int32),
    8: (torch.int64, np.int64),
}


def bytes_of(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as stored (a view where it is contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes, as stored."""
    return zlib.crc32(bytes_of(t.reshape(-1)) if t.numel() else b"")


def _elias_fano_k(numel: int, nnz: int) -> tuple[int, int]:
    """Low-bit count k minimising the Elias-Fano size; returns (k, bits of the unary high part)."""
    k0 = max(0, int(math.log2(numel / nnz))) if nnz else 0
    best = None
    for k in range(max(0, k0 - 1), k0 + 2):
        ubits = nnz + ((numel - 1) >> k) + 1
        size = nbytes(ubits) + k * nbytes(nnz)
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


def _kept(flat: torch.Tensor, keep: np.ndarray, nnz: int, chunk: int = 1 << 20) -> torch.Tensor:
    """``flat[keep]`` in order, gathered a chunk at a time: indexing the whole tensor at once makes int64 positions
    of every kept entry (twice the values' bytes in float32)."""
    values, at, mask = torch.empty(nnz, dtype=flat.dtype), 0, torch.from_numpy(keep)
    for i in range(0, flat.numel(), chunk):
        part = flat[i : i + chunk][mask[i : i + chunk]]
        values[at : at + part.numel()] = part
        at += part.numel()
    return values


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
    nnz = int(np.count_nonzero(keep))  # the positions (8 bytes each) only where Elias-Fano stores them
    k, ubits = _elias_fano_k(numel, nnz) if nnz else (0, 0)
    sizes = {
        DENSE: numel * bpv,
        BITMASK: nnz * bpv + nbytes(numel),
        ELIAS_FANO: nnz * bpv + nbytes(ubits) + k * nbytes(nnz),
    }
    codec = min(sizes, key=sizes.get) if codec is None else codec
    if codec == DENSE:
        values, payload, k, ubits, nnz = flat.clone(), [], 0, 0, numel
    elif codec == BITMASK:
        values, payload, k, ubits = _kept(flat, keep, nnz), [np.packbits(keep, bitorder="little")], 0, 0
    else:
        # Elias-Fano: the i-th position p sets bit (p >> k) + i of the unary part; its k low bits are
        # stored in k bit-planes. Decoding is a nonzero scan, a subtraction and a shift.
        pos = np.flatnonzero(keep)
        unary = np.zeros(ubits, dtype=bool)
        unary[(pos >> k) + np.arange(nnz)] = True
        low = (pos & ((1 << k) - 1)).astype(np.uint8 if k <= 8 else np.int64)
        planes = [np.packbits((low >> low.dtype.type(j)) & 1, bitorder="little") for j in range(k)]
        values, payload = _kept(flat, keep, nnz), [np.packbits(unary, bitorder="little"), *planes]
    crc = zlib.crc32(bytes_of(values))
    for part in payload:
        crc = zlib.crc32(part, crc)
    head = HEAD.pack(MAGIC, FORMAT_VERSION, codec, k, len(shape), nnz, ubits, crc)
    dims = np.asarray(shape, dtype="<u8").view(np.uint8)
    index = np.concatenate([np.frombuffer(head, np.uint8), dims, *payload])
    return values, torch.from_numpy(index)


def parse_index(index: torch.Tensor, name: str) -> tuple[dict, np.ndarray]:
    """:func:`~hf_sms.checkpoint.index_format.parse_index_bytes` of a ``W.sp_index`` tensor."""
    return parse_index_bytes(index.detach().to("cpu").contiguous().numpy(), name)


def verified(values: torch.Tensor, index: torch.Tensor, name: str) -> tuple[dict, torch.Tensor, np.ndarray]:
    """``(header, flat CPU values, positions payload)`` once the values' count, dtype and checksum match the
    index; the positions are left encoded (see :func:`position_chunks`)."""
    head, payload = parse_index(index, name)
    values = values.detach().to("cpu").contiguous().reshape(-1)
    check_values(head, payload, bytes_of(values), values.numel(), values.dtype, name)
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
    crc = zlib.crc32(payload, zlib.crc32(bytes_of(values)))
    out[CRC_AT : HEAD.size] = np.frombuffer(struct.pack("<I", crc), np.uint8)
    return torch.from_numpy(out)


def mask_part(index: torch.Tensor) -> bytes:
    """The bytes of an index that depend on the mask only (everything but the CRC)."""
    b = index.numpy().tobytes()
    return b[:CRC_AT] + b[HEAD.size :]


def header_key(index: torch.Tensor) -> bytes:
    """The header and shape bytes of an index: equal for two tensors only if codec, shape, nnz and CRC agree."""
    buf = (index if index.device.type == "cpu" else index.cpu()).numpy()
    ndim = int(buf[NDIM_AT]) if buf.size >= HEAD.size else 0
    return buf[: HEAD.size + 8 * ndim].tobytes()
