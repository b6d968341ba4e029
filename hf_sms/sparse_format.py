"""Sparse checkpoints: small on disk, loadable with each model family's own loader.

A checkpoint is the folder the family writes (``config.json``, tokenizer/processor files, timm's
``config.json`` with ``pretrained_cfg``, smp's hub-mixin ``config.json``) plus ``sparsity.json``
(sparsity, mask hash, soup recipe, metrics). Weights live in ``model.safetensors``:

- ``format="dense"``: the family's own file, untouched; loads without hf-sms.
- ``format="bitmask"``: every *eligible* weight ``W`` (floating point, at least 2-D, named ``*.weight``)
  is stored as two tensors: ``W`` holds its nonzero values, flattened in row-major order (1-D, W's
  dtype), and ``W.sp_index`` (uint8) a header (codec, shape, nnz, CRC-32) and the positions code. The
  codec is chosen per tensor as the smallest of DENSE (all values, no index), BITMASK (one bit per
  weight) and ELIAS_FANO (positions split into unary-coded high bits and k low bits: within a few
  percent of the entropy bound at high sparsity, and decoded without a prefix sum).
  With ``hf_sms`` imported, ``AutoModel*.from_pretrained(dir)`` decodes it through a registered
  transformers quantizer; :func:`load_sparse` loads every family. A loader that does not know the
  format fails loudly on the shape mismatch instead of loading random weights.

Pruned weights are the exact zeros; they load as ``+0.0`` (a ``-0.0`` left by masking by
multiplication loads as ``+0.0``, which compares equal). Only safetensors and JSON are ever read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
import zlib
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

FORMATS = ("bitmask", "dense")
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SPARSITY_NAME = "sparsity.json"
INDEX_SUFFIX = ".sp_index"
QUANT_METHOD = "hf-sms-sparse"
FORMAT_VERSION = 1
# Weight files a save replaces; anything else in an existing folder is left alone.
STALE_FILES = re.compile(r"^(model\.safetensors|model\.safetensors\.index\.json|model-\d+-of-\d+\.safetensors|"
                    r"pytorch_model\.bin|sparsity\.json)$")  # fmt: skip

# ---------------------------------------------------------------------------------------------
# Codec: one tensor <-> (values, index)
DENSE, BITMASK, ELIAS_FANO = 0, 1, 2
CODECS = {DENSE: "dense", BITMASK: "bitmask", ELIAS_FANO: "elias-fano"}
_MAGIC = b"HSMS"
_HEAD = struct.Struct("<4sBBBBQQI")  # magic, version, codec, low bits k, ndim, nnz, unary bits, crc32
_CRC_AT = _HEAD.size - 4


def eligible(name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> bool:
    """Whether a tensor is stored sparse in the bitmask format (linear, conv and embedding weights)."""
    return dtype.is_floating_point and len(shape) >= 2 and name.rsplit(".", 1)[-1] == "weight"


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
    return _encode(flat, (flat != 0).numpy(), tuple(tensor.shape), codec)


def _encode(flat: torch.Tensor, keep: np.ndarray, shape: tuple, codec: int | None = None):
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


def _parse_index(index: torch.Tensor, name: str) -> tuple[dict, np.ndarray]:
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


def _positions(head: dict, payload: np.ndarray, name: str) -> np.ndarray | None:
    """Flat positions of the nonzeros (``None`` for DENSE: every position)."""
    bad = f"sparse index of {name!r} is corrupted (positions do not add up); re-save or re-download the checkpoint"
    if head["codec"] == DENSE:
        return None
    if head["codec"] == BITMASK:
        # flatnonzero on a bool view is an order of magnitude faster than on uint8
        pos = np.flatnonzero(np.unpackbits(payload, count=head["numel"], bitorder="little").view(bool))
    else:
        nnz, k, ub = head["nnz"], head["k"], _nbytes(head["ubits"])
        pos = np.flatnonzero(np.unpackbits(payload[:ub], count=head["ubits"], bitorder="little").view(bool))
        if len(pos) != nnz:
            raise ValueError(bad)
        pos -= np.arange(nnz, dtype=np.int64)  # the high parts, non-decreasing
        pos <<= k
        plane, low = _nbytes(nnz), np.zeros(nnz, dtype=np.uint8 if k <= 8 else np.int64)
        for j in range(k):
            bits = np.unpackbits(payload[ub + j * plane : ub + (j + 1) * plane], count=nnz, bitorder="little")
            low |= bits.astype(low.dtype) << low.dtype.type(j)  # narrow ints: half the time of int64 planes
        pos |= low
    if len(pos) != head["nnz"] or (len(pos) and pos[-1] >= head["numel"]):
        raise ValueError(bad)
    return pos


def decode_tensor(values: torch.Tensor, index: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """Inverse of :func:`encode_tensor`; checks the CRC and every size, raising ``ValueError`` if corrupted."""
    head, payload = _parse_index(index, name)
    device = values.device
    values = values.detach().to("cpu").contiguous().reshape(-1)
    if values.numel() != head["nnz"] or not values.is_floating_point():
        raise ValueError(
            f"{name!r} has {values.numel()} stored values of dtype {values.dtype} but its index expects "
            f"{head['nnz']} floating-point values; the checkpoint is corrupted or mixes files of two saves."
        )
    if zlib.crc32(payload, zlib.crc32(_bytes_of(values))) != head["crc"]:
        raise ValueError(f"checksum mismatch in {name!r}: the checkpoint file is corrupted; re-save or re-download it")
    pos = _positions(head, payload, name)
    if pos is None:
        out = values.clone()
    else:
        # numpy's zeros is lazily zeroed memory (calloc): much faster than torch.zeros + index_put for
        # large tensors. Integer views of the same width make this work for bf16 too.
        view = _INT_VIEW[values.element_size()]
        flat = np.zeros(head["numel"], dtype=view[1])
        flat[pos] = values.view(view[0]).numpy()
        out = torch.from_numpy(flat).view(values.dtype)
    return out.reshape(head["shape"]).to(device)


def index_mask(index: torch.Tensor, name: str = "tensor") -> torch.Tensor | None:
    """The bool mask (True = stored) an index describes, without the values; ``None`` for DENSE."""
    head, payload = _parse_index(index, name)
    pos = _positions(head, payload, name)
    if pos is None:
        return None
    mask = torch.zeros(head["numel"], dtype=torch.bool, device="cpu")
    mask[torch.from_numpy(pos)] = True
    return mask.reshape(head["shape"])


def index_info(index: torch.Tensor, name: str = "tensor") -> dict:
    """Header of an index: ``codec`` (name), ``shape``, ``numel``, ``nnz`` (stored values)."""
    head, _ = _parse_index(index, name)
    return {"codec": CODECS[head["codec"]], "shape": list(head["shape"]), "numel": head["numel"], "nnz": head["nnz"]}


def restamp_index(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``index`` re-stamped with the CRC of new ``values`` (same mask, e.g. after averaging)."""
    head, payload = _parse_index(index, "merged tensor")
    out = index.clone().numpy()
    out[_CRC_AT : _HEAD.size] = np.frombuffer(
        struct.pack("<I", zlib.crc32(payload, zlib.crc32(_bytes_of(values)))), np.uint8
    )
    return torch.from_numpy(out)


def mask_part(index: torch.Tensor) -> bytes:
    """The bytes of an index that depend on the mask only (everything but the CRC)."""
    b = index.numpy().tobytes()
    return b[:_CRC_AT] + b[_HEAD.size :]


# ---------------------------------------------------------------------------------------------
# Reading safetensors without pickle or mmap (so reading many files does not hold them all in RSS)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class SafetensorsFile:
    """Header-validated reader of one ``.safetensors`` file; each :meth:`read` reads one tensor."""

    def __init__(self, path: str):
        self.path = path
        fix = "re-save the checkpoint or re-download the file"
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(size - 8, 100_000_000):
                raise ValueError(f"{path} is not a valid safetensors file (bad or truncated header); {fix}")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path} has a corrupted safetensors header ({e}); {fix}") from None
        self.data_start = 8 + n
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, e in header.items():
            try:
                dtype, shape, (begin, end) = _DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path}: entry {key!r} is malformed or has an unsupported dtype; {fix}") from None
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise ValueError(f"{path}: entry {key!r} has a size that does not match its shape; {fix}")
            if self.data_start + end > size:
                raise ValueError(
                    f"{path} is truncated: {key!r} ends at byte {self.data_start + end} but the file has {size}; {fix}"
                )
            self.entries[key] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self.entries)

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the flattened tensor ``key``."""
        dtype, shape, begin, end = self.entries[key]
        size = dtype.itemsize
        buf = bytearray((stop - start) * size)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin + start * size)
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{self.path} is truncated while reading {key!r}; re-save or re-download it")
        return torch.from_numpy(np.frombuffer(buf, np.uint8)).view(dtype)

    def read(self, key: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[key]
        buf = bytearray(end - begin)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{self.path} is truncated while reading {key!r}; re-save or re-download it")
        # numpy, not torch.frombuffer: stays on the CPU inside transformers' meta-device init context
        return torch.from_numpy(np.frombuffer(buf, np.uint8)).view(dtype).reshape(shape)


def _workers() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _weight_files(directory: str) -> list[str]:
    index = os.path.join(directory, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(directory, v) for v in json.load(f)["weight_map"].values()})
    path = os.path.join(directory, WEIGHTS_NAME)
    if os.path.isfile(path):
        return [path]
    raise ValueError(
        f"{directory} holds no {WEIGHTS_NAME} (nor {INDEX_NAME}): it is not a checkpoint folder. Save one with "
        "hf_sms.save_sparse(model, directory) or the model family's save_pretrained / save_for_hf."
    )


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore it or re-save the checkpoint") from None


def _family_of_config(config: dict | None) -> tuple[str, str] | None:
    if not config:
        return None
    if "pretrained_cfg" in config and "architecture" in config:
        return "timm", config["architecture"]
    if "_model_class" in config:
        return "segmentation_models_pytorch", config["_model_class"]
    if config.get("architectures"):
        return "transformers", config["architectures"][0]
    return None


class SparseCheckpoint:
    """Read access to a checkpoint folder (either format), tensor by tensor, by the names it was saved with."""

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise ValueError(f"{directory} is not a directory")
        self.directory = directory
        self.info = _read_json(os.path.join(directory, SPARSITY_NAME))
        self.config = _read_json(os.path.join(directory, "config.json"))
        known = _family_of_config(self.config)
        if self.info is not None:
            self.library, self.architecture = self.info.get("library"), self.info.get("architecture")
        elif known is not None:
            self.library, self.architecture = known
        else:
            raise ValueError(
                f"{directory} has neither {SPARSITY_NAME} nor a transformers/timm/smp config.json: not a model "
                "checkpoint. Save one with hf_sms.save_sparse(model, directory)."
            )
        self.files = [SafetensorsFile(p) for p in _weight_files(directory)]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for key in f.keys():
                if key in self._where:
                    raise ValueError(f"tensor {key!r} appears in two weight files of {directory}; re-save it")
                self._where[key] = f
        self._names = [k for k in self._where if not k.endswith(INDEX_SUFFIX)]
        for key in self._where:
            if key.endswith(INDEX_SUFFIX) and key[: -len(INDEX_SUFFIX)] not in self._where:
                raise ValueError(f"{directory}: {key!r} has no values tensor; the checkpoint is incomplete, re-save it")
        self.format = "bitmask" if len(self._names) < len(self._where) else "dense"

    def names(self) -> list[str]:
        return list(self._names)

    def is_encoded(self, name: str) -> bool:
        return name + INDEX_SUFFIX in self._where

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        dtype, shape, _, _ = self._where[name].entries[name]
        if self.is_encoded(name):
            shape = tuple(index_info(self.read_raw(name + INDEX_SUFFIX), name)["shape"])
        return shape, dtype

    def read_raw(self, key: str) -> torch.Tensor:
        return self._where[key].read(key)

    def read_encoded(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.is_encoded(name):
            return None
        return self.read_raw(name), self.read_raw(name + INDEX_SUFFIX)

    def read(self, name: str) -> torch.Tensor:
        enc = self.read_encoded(name)
        return self.read_raw(name) if enc is None else decode_tensor(*enc, name=name)

    def chunk_reader(self, name: str):
        """``read(start, stop)``: a slice of the flattened tensor; reads only that slice if stored dense."""
        if self.is_encoded(name):
            flat = self.read(name).reshape(-1)
            return lambda start, stop: flat[start:stop]
        f = self._where[name]
        return lambda start, stop: f.read_range(name, start, stop)

    def mask(self, name: str) -> torch.Tensor:
        enc = self.read_encoded(name)
        if enc is not None:
            mask = index_mask(enc[1], name)
            return mask if mask is not None else enc[0].reshape(self.spec(name)[0]) != 0
        return self.read_raw(name) != 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=_workers()) as pool:  # numpy and file reads release the GIL
            return dict(zip(self._names, pool.map(self.read, self._names)))


# ---------------------------------------------------------------------------------------------
# Statistics written to sparsity.json
def _mask_digest(flat: np.ndarray) -> bytes:
    return hashlib.sha256(np.packbits(flat, bitorder="little").tobytes()).digest()


class MaskStats:
    """Accumulates per-tensor sparsity and the mask hash over the eligible tensors."""

    def __init__(self):
        self.per_tensor: dict[str, dict] = {}
        self._digests: dict[str, bytes] = {}

    def add(self, name: str, mask: torch.Tensor | np.ndarray, codec: str, shape: tuple | None = None) -> None:
        flat = (mask.numpy() if isinstance(mask, torch.Tensor) else mask).reshape(-1)
        numel, nnz = flat.size, int(np.count_nonzero(flat))
        digest = _mask_digest(flat)
        self._digests[name] = digest
        self.per_tensor[name] = {
            "shape": list(shape if shape is not None else mask.shape),
            "numel": numel,
            "nnz": nnz,
            "sparsity": 1.0 - nnz / numel if numel else 0.0,
            "codec": codec,
            "mask_hash": digest.hex()[:16],
        }

    def summary(self) -> dict:
        numel = sum(t["numel"] for t in self.per_tensor.values())
        nnz = sum(t["nnz"] for t in self.per_tensor.values())
        h = hashlib.sha256()
        for name in sorted(self._digests):
            h.update(name.encode() + b"\0" + self._digests[name])
        return {
            "sparsity": 1.0 - nnz / numel if numel else 0.0,
            "numel": numel,
            "nnz": nnz,
            "mask_hash": "sha256:" + h.hexdigest(),
            "per_tensor": self.per_tensor,
        }


def _write_weights(tensors: Iterable[tuple[str, torch.Tensor]], path: str, fmt: str) -> MaskStats:
    """Write ``tensors`` to one safetensors file in ``fmt``; returns the sparsity statistics."""
    stats, out = MaskStats(), {}
    for name, t in tensors:
        t = t.detach().to("cpu").contiguous()
        if not eligible(name, t.shape, t.dtype):
            out[name] = t
            continue
        flat = t.reshape(-1)
        keep = (flat != 0).numpy()
        if fmt == "bitmask":
            values, index = _encode(flat, keep, tuple(t.shape))
            out[name], out[name + INDEX_SUFFIX] = values, index
            stats.add(name, keep, CODECS[int(index[5])], tuple(t.shape))
        else:
            out[name] = t
            stats.add(name, keep, "dense", tuple(t.shape))
    save_file(out, path, metadata={"format": "pt", "hf_sms": f"{fmt}-v{FORMAT_VERSION}"})
    return stats


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")


def _quantization_config() -> dict:
    return {"quant_method": QUANT_METHOD, "format": "bitmask", "version": FORMAT_VERSION, "dequantize": True}


def patch_config(directory: str, library: str, fmt: str) -> None:
    """Add (bitmask) or remove (dense) the quantization_config through which transformers decodes the weights."""
    path = os.path.join(directory, "config.json")
    config = _read_json(path)
    if config is None or library not in ("transformers", "timm"):
        return
    if (config.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD:
        del config["quantization_config"]
    if library == "timm":
        # transformers' TimmWrapper passes num_classes itself; timm reads it from the top level too.
        config.get("model_args", {}).pop("num_classes", None)
    if fmt == "bitmask":
        config["quantization_config"] = _quantization_config()
    write_json(path, config)


def install_folder(tmp: str, directory: str, replace: bool = False) -> None:
    """Move the finished folder ``tmp`` to ``directory``.

    A new or empty ``directory`` is one rename. With ``replace`` the old folder is swapped out whole;
    otherwise its weight files and ``sparsity.json`` are replaced file by file and other files kept.
    """
    directory = os.path.abspath(directory)
    if not os.path.exists(directory) or (os.path.isdir(directory) and not os.listdir(directory)):
        os.replace(tmp, directory)
        return
    if replace:
        old = tmp + ".old"
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
        return
    new = set(os.listdir(tmp))
    for name in os.listdir(directory):
        if STALE_FILES.match(name) and name not in new:
            os.remove(os.path.join(directory, name))
    # sparsity.json last: a folder with it is complete.
    for name in sorted(new, key=lambda n: n == SPARSITY_NAME):
        dst = os.path.join(directory, name)
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        os.replace(os.path.join(tmp, name), dst)
    shutil.rmtree(tmp, ignore_errors=True)


def new_tmpdir(directory: str) -> str:
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".hf_sms-", dir=parent)


# ---------------------------------------------------------------------------------------------
# Saving
def library_of(model: nn.Module) -> str:
    """``"transformers"``, ``"timm"``, ``"segmentation_models_pytorch"`` or ``"torch"`` (anything else)."""
    from transformers import PreTrainedModel

    module = type(model).__module__
    if isinstance(model, PreTrainedModel):
        return "transformers"
    if module.startswith("timm.") and hasattr(model, "pretrained_cfg"):
        return "timm"
    if module.startswith("segmentation_models_pytorch") and hasattr(model, "save_pretrained"):
        return "segmentation_models_pytorch"
    return "torch"


def _save_family(model: nn.Module, tmp: str, library: str, processing_class=None) -> tuple[str, dict]:
    """Write the family's own dense folder into ``tmp``; returns (architecture, aliases of shared tensors)."""
    aliases: dict[str, str] = {}
    if library == "transformers":
        model.save_pretrained(tmp)
        architecture = type(model).__name__
    elif library == "timm":
        from timm.models import save_for_hf

        save_for_hf(model, tmp, safe_serialization=True)
        architecture = _read_json(os.path.join(tmp, "config.json"))["architecture"]
    elif library == "segmentation_models_pytorch":
        model.save_pretrained(tmp)
        architecture = type(model).__name__
    else:
        seen: dict[tuple, str] = {}
        tensors = {}
        for name, t in model.state_dict().items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
            if key is not None and key in seen:
                aliases[name] = seen[key]
                continue
            if key is not None:
                seen[key] = name
            tensors[name] = t.detach().to("cpu").contiguous()
        save_file(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
        architecture = f"{type(model).__module__}.{type(model).__qualname__}"
    if processing_class is not None:
        processing_class.save_pretrained(tmp)
    return architecture, aliases


def save_sparse(
    model: nn.Module,
    directory: str,
    format: str = "bitmask",
    *,
    recipe: dict | None = None,
    metrics: dict | None = None,
    processing_class=None,
) -> str:
    """Save ``model`` as a checkpoint folder its family's loader knows, plus ``sparsity.json``.

    Args:
        model: a transformers, timm, segmentation_models_pytorch or plain torch model (plain models
            load back with ``load_sparse(directory, model=template)``).
        directory: the folder; created if missing. Weight files and ``sparsity.json`` already there are
            replaced, other files are kept. Everything is written to a temporary folder first, so an
            error leaves existing files intact.
        format: ``"bitmask"`` (small; loads with ``from_pretrained`` once ``hf_sms`` is imported, and with
            :func:`load_sparse`) or ``"dense"`` (plain family format, loads without hf-sms).
        recipe: the soup recipe, e.g. ``{"phases": [...], "m": 3, "varied": "seed", "merge_method": "uniform"}``.
        metrics: e.g. ``{"accuracy": 0.91}``.
        processing_class: a tokenizer / image processor to save alongside.

    Returns:
        ``directory``.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    library = library_of(model)
    tmp = new_tmpdir(directory)
    try:
        architecture, aliases = _save_family(model, tmp, library, processing_class)
        files = [SafetensorsFile(p) for p in _weight_files(tmp)]
        pairs = ((k, f.read(k)) for f in files for k in f.keys())
        if format == "dense":
            stats = MaskStats()
            for name, t in pairs:
                if eligible(name, t.shape, t.dtype):
                    stats.add(name, t != 0, "dense")
        else:
            new_path = os.path.join(tmp, WEIGHTS_NAME + ".new")
            stats = _write_weights(pairs, new_path, "bitmask")
            for f in files:
                os.remove(f.path)
            if os.path.exists(os.path.join(tmp, INDEX_NAME)):
                os.remove(os.path.join(tmp, INDEX_NAME))
            os.replace(new_path, os.path.join(tmp, WEIGHTS_NAME))
        patch_config(tmp, library, format)
        info = {
            "hf_sms_format_version": FORMAT_VERSION,
            "format": format,
            "library": library,
            "architecture": architecture,
            **stats.summary(),
            "recipe": recipe,
            "metrics": metrics,
        }
        if aliases:
            info["aliases"] = aliases
        write_json(os.path.join(tmp, SPARSITY_NAME), info)
        install_folder(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# ---------------------------------------------------------------------------------------------
# Loading
def _load_into(model: nn.Module, state_dict: dict[str, torch.Tensor], aliases: dict | None = None) -> nn.Module:
    """Strictly load ``state_dict`` into ``model``; a key may be missing only if it shares storage with a loaded one."""
    for dup, kept in (aliases or {}).items():
        if kept in state_dict:
            state_dict.setdefault(dup, state_dict[kept])
    own = model.state_dict()
    unexpected = sorted(set(state_dict) - set(own))
    mismatched = [k for k in state_dict if k in own and tuple(own[k].shape) != tuple(state_dict[k].shape)]
    if unexpected or mismatched:
        what = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(own[k].shape)}" for k in mismatched[:5]]
        raise ValueError(
            f"the checkpoint does not fit this model: unexpected tensors {unexpected[:5]}, shape mismatches {what}. "
            "Pass a template of the architecture the checkpoint was saved from."
        )
    model.load_state_dict(state_dict, strict=False)
    loaded = {own[k].untyped_storage().data_ptr() for k in state_dict if own[k].numel()}
    missing = [
        k for k in own if k not in state_dict and not (own[k].numel() and own[k].untyped_storage().data_ptr() in loaded)
    ]
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[:5]}; they would keep their "
            "current (random) values. Re-save the checkpoint or pass the matching template."
        )
    return model


def _check_masks(ckpt: SparseCheckpoint, state_dict: dict[str, torch.Tensor]) -> None:
    expected = (ckpt.info or {}).get("mask_hash")
    if not expected:
        return
    stats = MaskStats()
    for name, t in state_dict.items():
        if eligible(name, t.shape, t.dtype):
            stats.add(name, t != 0, "")
    if stats.summary()["mask_hash"] != expected:
        raise ValueError(
            f"the weights of {ckpt.directory} do not have the mask recorded in {SPARSITY_NAME}: weight files and "
            "metadata come from different saves or a file is corrupted. Re-save the checkpoint."
        )


def load_sparse(directory: str, model: nn.Module | None = None, *, verify: bool = True, **kwargs) -> nn.Module:
    """Load a checkpoint folder written by :func:`save_sparse` (either format) or by a family's own saver.

    Args:
        directory: the folder.
        model: a template to load into (required for plain torch models); loaded strictly, in place.
        verify: check the loaded masks against the hash in ``sparsity.json``.
        **kwargs: passed to ``from_pretrained`` (transformers) or ``timm.create_model`` (timm).

    Returns:
        The model, in eval mode. Raises ``ValueError`` if a tensor is missing, unexpected, misshapen or corrupted.
    """
    ckpt = SparseCheckpoint(directory)
    state_dict = ckpt.state_dict()
    if verify:
        _check_masks(ckpt, state_dict)
    aliases = (ckpt.info or {}).get("aliases")
    if model is not None:
        return _load_into(model, state_dict, aliases).eval()
    if ckpt.library == "transformers":
        import transformers

        config = transformers.AutoConfig.from_pretrained(directory)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        cls = getattr(transformers, ckpt.architecture, None)
        if cls is None:
            raise ValueError(f"transformers has no class {ckpt.architecture!r}; pass model=<template> instead")
        # transformers applies its own key renaming to the names the checkpoint was saved with.
        model, info = cls.from_pretrained(
            None, config=config, state_dict=state_dict, output_loading_info=True, **kwargs
        )
        problems = {k: sorted(map(str, v))[:5] for k, v in info.items() if v}
        if problems:
            raise ValueError(f"{directory} does not load cleanly into {ckpt.architecture}: {problems}; re-save it")
        return model.eval()
    if ckpt.library == "timm":
        import timm

        model = timm.create_model(f"local-dir:{os.path.abspath(directory)}", pretrained=False, **kwargs)
    elif ckpt.library == "segmentation_models_pytorch":
        import segmentation_models_pytorch as smp

        config = {k: v for k, v in (ckpt.config or {}).items() if not k.startswith("_")}
        if "encoder_weights" in config:
            config["encoder_weights"] = None  # the checkpoint has the weights; never download
        model = getattr(smp, ckpt.architecture)(**config)
    else:
        raise ValueError(
            f"{directory} holds a plain torch model ({ckpt.architecture}); pass a template: "
            "load_sparse(directory, model=MyModel(...))"
        )
    return _load_into(model, state_dict, aliases).eval()


class _Prefetcher:
    """Decodes every encoded tensor of some weight files on a thread pool, ahead of the loader asking.

    numpy, zlib and file reads release the GIL, so decoding overlaps with transformers' own loading
    work and uses every core. A request is matched by the index header (codec, shape, nnz, CRC-32);
    ties (identical headers) are broken by comparing the index and the values.
    """

    def __init__(self, files: list[SafetensorsFile]):
        from concurrent.futures import ThreadPoolExecutor

        from transformers.core_model_loading import dot_natural_key

        jobs = []
        for f in files:
            for key in f.keys():
                if key.endswith(INDEX_SUFFIX):
                    name = key[: -len(INDEX_SUFFIX)]
                    if name not in f.entries:
                        raise ValueError(f"{f.path}: {key!r} has no values tensor; the checkpoint is incomplete")
                    index = f.read(key)
                    _parse_index(index, name)  # structure errors raise here, before loading starts
                    jobs.append((dot_natural_key(name), f, name, index))
        self._pool = ThreadPoolExecutor(max_workers=_workers())
        self._ready: dict[bytes, list] = {}
        for _, f, name, index in sorted(jobs, key=lambda j: j[0]):  # in the order transformers loads
            future = self._pool.submit(_read_and_decode, f, name, index)
            self._ready.setdefault(_index_key(index), []).append((index, future))

    def take(self, values: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
        candidates = self._ready.get(_index_key(index), [])
        for i, (idx, future) in enumerate(candidates):
            if len(candidates) == 1 or (
                torch.equal(idx, index.cpu()) and torch.equal(future.result()[0], values.cpu())
            ):
                del candidates[i]
                return future.result()[1].to(values.device)
        return decode_tensor(values, index, name)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ready.clear()


def _read_and_decode(f: SafetensorsFile, name: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = f.read(name)
    return values, decode_tensor(values, index, name)


def _index_key(index: torch.Tensor) -> bytes:
    buf = (index if index.device.type == "cpu" else index.cpu()).numpy()
    ndim = int(buf[7]) if buf.size >= _HEAD.size else 0
    return buf[: _HEAD.size + 8 * ndim].tobytes()


# ---------------------------------------------------------------------------------------------
# transformers integration: AutoModel*.from_pretrained(dir) decodes bitmask checkpoints once hf_sms is imported
def _register_with_transformers() -> None:
    from transformers.core_model_loading import (
        ConversionOps,
        WeightConverter,
        WeightTransform,
        _IdentityOp,
        build_glob_alternation,
    )
    from transformers.quantizers import HfQuantizer
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class _Converter(WeightConverter):
        """A WeightConverter that copies by re-construction: transformers deep-copies one per weight."""

        __slots__ = ()

        def __deepcopy__(self, memo):
            new = object.__new__(type(self))
            for slot in WeightTransform.__slots__ + WeightConverter.__slots__:
                if hasattr(self, slot):
                    object.__setattr__(new, slot, getattr(self, slot))  # patterns and ops are never mutated
            object.__setattr__(new, "collected_tensors", defaultdict(list))
            object.__setattr__(new, "layer_targets", defaultdict(set))
            return new

    class SparseDecode(ConversionOps):
        """Turns each ``(W values, W.sp_index)`` pair into the dense ``W``; other tensors pass through."""

        supports_many_to_many = True  # prepended to the model's own converters (e.g. fused experts)

        def __init__(self, hf_quantizer):
            self.hf_quantizer = hf_quantizer

        def __deepcopy__(self, memo):
            return self  # stateless; transformers deep-copies each converter per weight

        def convert(
            self, input_dict, source_patterns=None, target_patterns=None, model=None, full_layer_name=None, **kw
        ):
            # Errors are recorded and raised as ValueError once loading ends: raised here, transformers
            # would only log them and raise a generic RuntimeError.
            try:
                return self._convert(input_dict, model, full_layer_name)
            except ValueError as e:
                self.hf_quantizer.errors.append(str(e))
                return {}

        def _convert(self, input_dict, model, name):
            dtype = self.hf_quantizer.target_dtype(model, name)
            out = {}
            for pattern, values in input_dict.items():
                if pattern.endswith(INDEX_SUFFIX):
                    if pattern[: -len(INDEX_SUFFIX)] not in input_dict:
                        raise ValueError(f"{name}: the checkpoint has its sparse index but not its values; re-save it")
                    continue
                values = values if isinstance(values, list) else [values]
                indexes = input_dict.get(pattern + INDEX_SUFFIX, [])
                indexes = indexes if isinstance(indexes, list) else [indexes]
                if indexes and len(indexes) != len(values):
                    raise ValueError(f"{name}: {len(values)} value tensors but {len(indexes)} sparse indexes")
                if indexes:
                    values = [self.hf_quantizer.decode(v, i, name) for v, i in zip(values, indexes)]
                out[pattern] = [v.to(dtype) if dtype is not None and v.is_floating_point() else v for v in values]
            return out

        @property
        def reverse_op(self):
            return _IdentityOp()

    @register_quantization_config(QUANT_METHOD)
    class SparseCheckpointConfig(QuantizationConfigMixin):
        """Marks a checkpoint saved by ``hf_sms.save_sparse(format="bitmask")``; loading restores dense weights."""

        def __init__(self, format: str = "bitmask", version: int = FORMAT_VERSION, dequantize: bool = True, **kwargs):
            self.quant_method = QUANT_METHOD
            self.format = format
            self.version = version
            self.dequantize = True  # weights load dense: the model is an ordinary model afterwards

    @register_quantizer(QUANT_METHOD)
    class SparseCheckpointQuantizer(HfQuantizer):
        """Decodes bitmask checkpoints on load, then checks that every tensor of the model arrived.

        transformers re-initialises missing weights at random with only a printed report; for a sparse
        checkpoint that would silently destroy the model, so a missing tensor raises here.
        """

        requires_calibration = False
        serialized_names = {"weight": ["weight", "weight" + INDEX_SUFFIX]}

        def __init__(self, quantization_config, **kwargs):
            super().__init__(quantization_config, **kwargs)
            self.errors: list[str] = []
            self._prefetch: _Prefetcher | None = None
            self._plan = None
            self._dtypes: dict[str, torch.dtype] | None = None

        def update_parallel_plan(self, model, plan):
            return  # ".sp_index" companions never become parameters: nothing to add to TP/EP plans

        def validate_environment(self, *args, **kwargs):
            if self.quantization_config.version > FORMAT_VERSION:
                raise ValueError(
                    f"this checkpoint uses hf-sms sparse format version {self.quantization_config.version}; "
                    f"upgrade hf-sms (it reads up to {FORMAT_VERSION})"
                )

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, dtype=None, **kwargs):
            self.errors, self._dtypes = [], None
            with torch.device("cpu"):  # called inside transformers' meta-device init context
                # Truncated or malformed files raise a clear ValueError here, before loading; decoding
                # (and the checksums) start on a thread pool while transformers prepares the rest.
                files = [SafetensorsFile(p) for p in checkpoint_files or [] if p.endswith(".safetensors")]
                self._prefetch = _Prefetcher(files)
            plan = model._get_dtype_plan(dtype) if isinstance(dtype, torch.dtype) else {}
            self._plan = (build_glob_alternation(list(plan)), plan) if plan else None
            return model

        def decode(self, values: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
            if self._prefetch is not None:
                return self._prefetch.take(values, index, name)
            return decode_tensor(values, index, name)

        def target_dtype(self, model, name: str | None) -> torch.dtype | None:
            """The dtype transformers would cast this tensor to: the dtype plan's, else the model parameter's."""
            if model is None or not name:
                return None
            if self._plan is not None:
                (alternation, by_group, _), plan = self._plan
                hit = alternation.search(name)
                if hit is not None:
                    return plan[by_group[hit.lastgroup]]
            if self._dtypes is None:
                self._dtypes = {n: t.dtype for n, t in model.state_dict(keep_vars=True).items() if t is not None}
            return self._dtypes.get(name)

        def _process_model_after_weight_loading(self, model, **kwargs):
            if self._prefetch is not None:
                self._prefetch.close()
                self._prefetch = None
            if self.errors:
                raise ValueError(
                    self.errors[0] + (f" (and {len(self.errors) - 1} more errors)" if self.errors[1:] else "")
                )
            missing = [
                k
                for k, v in model.state_dict(keep_vars=True).items()
                if v is not None and v.device.type != "meta" and not getattr(v, "_is_hf_initialized", False)
            ]
            if missing:
                raise ValueError(
                    f"{len(missing)} tensors of {type(model).__name__} were not in the sparse checkpoint (e.g. "
                    f"{missing[:5]}) and would be random. Load it with the class it was saved from, re-save "
                    "the checkpoint, or load into a template with hf_sms.load_sparse(dir, model=...)."
                )
            return model

        def get_load_operations(self):
            return {"deserialize": SparseDecode, "dequantize": SparseDecode}

        def get_weight_conversions(self):
            return [_Converter(names, param, [SparseDecode(self)]) for param, names in self.serialized_names.items()]

        def is_serializable(self):
            return False  # weights are dense after loading; save again with hf_sms.save_sparse

        @property
        def is_trainable(self) -> bool:
            return True

    assert AUTO_QUANTIZER_MAPPING[QUANT_METHOD] is SparseCheckpointQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] is SparseCheckpointConfig


def register_transformers_quantizer() -> None:
    """Register the ``hf-sms-sparse`` quantization method with transformers (done on ``import hf_sms``)."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        _register_with_transformers()


register_transformers_quantizer()
