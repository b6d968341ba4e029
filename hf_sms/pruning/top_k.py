"""Keep the ``k`` largest of many tensors' scores without concatenating them: a radix select on the scores' bits.

``torch.cat`` of every score plus ``torch.topk`` over the result holds the scores about 8 times over (the copy,
topk's values, its int64 indices and its work buffers): 8x the model's bytes at the moment a large model is pruned.
Here the threshold is found digit by digit (8 bits a pass, 4 passes for float32) from histograms of chunks, so the
memory beyond the scores is one chunk's. The result is the same set as a global top-k (ties broken by position,
tensors in order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from .bits import pack_bits

CHUNK = 1 << 20  # elements per histogram step: 8 MiB of int64 keys


class ElementwiseScores(Mapping):
    """Scores that are an elementwise function of the weights (``|w|``, ``w**2``): ``{name: fn(weights[name])}``,
    each computed when asked for. A global top-k (:func:`top_k` with ``transform=fn``) computes them chunk by chunk
    from the weights and never holds them all: the scores of a large model are a model's worth of memory."""

    def __init__(self, weights: Mapping[str, torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]):
        self.weights, self.fn = weights, fn

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fn(self.weights[name])

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


class Lazy(Sequence):
    """``[make(key) for key in keys]``, each made when it is asked for and never held: a model's scores, weights in
    float32 or masks, one tensor at a time (a model's worth of memory when made all at once)."""

    def __init__(self, keys, make: Callable):
        self.keys, self.make = list(keys), make

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Lazy(self.keys[i], self.make)
        return self.make(self.keys[i])

    def __len__(self) -> int:
        return len(self.keys)


class LazyMapping(Mapping):
    """``{key: make(key)}``, each made when it is asked for and never held (as :class:`Lazy`).

    ``stored``: the same tensors as they are stored (a bf16 model's weights, no float32 copy), where an elementwise
    criterion can convert them chunk by chunk itself; ``None`` where there is no such view."""

    def __init__(self, keys, make: Callable, stored: LazyMapping | None = None):
        self._keys, self.make, self.stored = dict.fromkeys(keys), make, stored

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        return self.make(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _keys(scores: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 keys ordered as the float32 scores (IEEE bits, negatives reversed, shifted by 2^31)."""
    raw = scores.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(raw < 0, raw ^ 0x7FFFFFFF, raw) + (1 << 31)


def _chunks(scores: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], transform=None) -> Iterator[tuple]:
    """``(tensor index, keys of one chunk, chunk start)``; pruned entries (mask False) get the lowest key."""
    for i, (s, m) in enumerate(zip(scores, masks)):
        flat, keep = s.reshape(-1), m.reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            part = flat[start : start + CHUNK]
            part = (transform(part) if transform is not None else part).masked_fill(
                ~keep[start : start + CHUNK], -torch.inf
            )
            yield i, _keys(part), start


def top_k(
    scores: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    k: int,
    transform=None,
    like=None,
    packed_bits: bool = False,
) -> list[torch.Tensor]:
    """Bool masks keeping exactly the ``k`` largest scores over all tensors (float32 or narrower; entries whose mask
    is False rank lowest), ties broken by position with the tensors in order. ``transform``: the scores are
    ``transform(scores)``, applied chunk by chunk (:class:`ElementwiseScores`: ``scores`` are then the weights).
    ``scores`` and ``masks`` are read one tensor at a time, in order: they may be made as they are asked for
    (:class:`Lazy`), given ``like``, tensors of their shapes and devices (the weights). ``packed_bits``: each mask
    as :func:`hf_sms.pruning.bits.pack_bits` packs it (uint8), as it is built."""
    like = list(scores) if like is None else like
    total = sum(s.numel() for s in like)

    def whole(t: torch.Tensor, fill: bool) -> torch.Tensor:
        mask = torch.full(t.shape, fill, dtype=torch.bool, device=t.device)
        return pack_bits(mask) if packed_bits else mask

    if k >= total:
        return [whole(s, True) for s in like]
    out: list[torch.Tensor | None] = [None] * len(like)
    prefix, need = 0, k  # among keys that start with ``prefix``, the ``need`` largest are still to keep
    for shift in (24, 16, 8, 0):
        hist = torch.zeros(256, dtype=torch.int64, device=like[0].device)
        for _, keys, _ in _chunks(scores, masks, transform) if k > 0 else ():
            if shift < 24:
                keys = keys[(keys >> (shift + 8)) == prefix]
            hist += torch.bincount((keys >> shift) & 0xFF, minlength=256)
        above = hist.flip(0).cumsum(0).flip(0)  # above[d]: keys with this digit or a larger one
        d = int((above >= need).nonzero().max()) if need > 0 else 255
        need -= int(above[d + 1]) if d < 255 else 0  # those with a larger digit are all kept
        prefix = prefix * 256 + d
    ties, current, buffer = need, None, None

    def finish() -> None:  # one tensor's bool mask exists at a time; with packed_bits it is kept as bits
        if current is not None:
            out[current] = pack_bits(buffer) if packed_bits else buffer.view(like[current].shape)

    for i, keys, start in _chunks(scores, masks, transform) if k > 0 else ():
        if i != current:
            finish()
            current, buffer = i, torch.zeros(like[i].numel(), dtype=torch.bool, device=like[i].device)
        keep = keys > prefix
        if ties > 0:
            equal = (keys == prefix).nonzero().reshape(-1)[:ties]
            keep[equal] = True
            ties -= equal.numel()
        buffer[start : start + keys.numel()] = keep
    finish()
    return [o if o is not None else whole(s, False) for o, s in zip(out, like)]
