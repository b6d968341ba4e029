"""Decoding a checkpoint's encoded tensors on a thread pool, ahead of transformers asking for them."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from transformers.core_model_loading import dot_natural_key

from .codec import decode_tensor, header_key, parse_index
from .constants import INDEX_SUFFIX
from .safetensors_io import SafetensorsFile, workers


def _read_and_decode(f: SafetensorsFile, name: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = f.read(name)
    return values, decode_tensor(values, index, name)


class Prefetcher:
    """Decodes every encoded tensor of some weight files on a thread pool, in the order transformers loads.

    numpy, zlib and file reads release the GIL, so decoding overlaps with transformers' own loading
    work and uses every core. transformers hands over tensors under its renamed keys, so a request is
    matched by the index header (codec, shape, nnz, CRC-32); ties (identical headers) are broken by
    comparing the index and the values.
    """

    def __init__(self, files: list[SafetensorsFile]):
        jobs = []
        for f in files:
            for key in f.keys():
                if key.endswith(INDEX_SUFFIX):
                    name = key[: -len(INDEX_SUFFIX)]
                    if name not in f.entries:
                        raise ValueError(f"{f.path}: {key!r} has no values tensor; the checkpoint is incomplete")
                    index = f.read(key)
                    parse_index(index, name)  # structure errors raise here, before loading starts
                    jobs.append((dot_natural_key(name), f, name, index))
        self._pool = ThreadPoolExecutor(max_workers=workers())
        self._ready: dict[bytes, list[tuple[torch.Tensor, Future]]] = {}
        for _, f, name, index in sorted(jobs, key=lambda j: j[0]):
            future = self._pool.submit(_read_and_decode, f, name, index)
            self._ready.setdefault(header_key(index), []).append((index, future))

    def take(self, values: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
        """The decoded tensor for ``(values, index)``; decoded now if it was not prefetched."""
        candidates = self._ready.get(header_key(index), [])
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
