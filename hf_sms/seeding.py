"""Independent random streams for replicas, IMP tracks and epochs.

The paper's replicas are separate runs with their own random seeds. Seeds ``s`` and ``s + 1`` are not
independent when a sampler seeds epoch ``e`` with ``seed + e`` (accelerate's ``SeedableRandomSampler``,
torch's ``DistributedSampler``): replica ``s + 1``'s epoch ``e`` replays replica ``s``'s epoch ``e + 1``.
So every seed here is derived with numpy's ``SeedSequence``, which hashes its whole key.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from torch.utils.data import Sampler


def _entropy(key: int | str) -> int:
    if isinstance(key, str):  # names such as "imp" become integers so they can key a SeedSequence
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return int(key)


def derive_seed(*keys: int | str) -> int:
    """A 32-bit seed for the stream named by ``keys``, e.g. ``derive_seed(seed, "sms", phase, replica)``.

    Distinct keys give statistically independent streams (no ``seed + i`` arithmetic anywhere).
    """
    return int(np.random.SeedSequence([_entropy(k) for k in keys]).generate_state(1)[0])


class EpochShuffleSampler(Sampler[int]):
    """A fresh permutation per epoch from the stream ``(seed, epoch)``, optionally sharded over a process group.

    All ranks of one replica share ``seed`` and so the permutation, and each takes every
    ``num_shards``-th index (padded to equal length, as ``DistributedSampler`` does). The Trainer calls
    ``set_epoch`` at the start of every epoch.
    """

    def __init__(self, dataset_size: int, seed: int, num_shards: int = 1, shard: int = 0):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in [0, {num_shards})")
        self.size, self.seed, self.num_shards, self.shard, self.epoch = dataset_size, seed, num_shards, shard, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def permutation(self) -> list[int]:
        rng = np.random.default_rng([_entropy(self.seed), _entropy(self.epoch)])
        return rng.permutation(self.size).tolist()

    def __len__(self) -> int:
        return math.ceil(self.size / self.num_shards)

    def __iter__(self):
        order = self.permutation()
        order += order[: len(self) * self.num_shards - self.size]  # equal shards
        return iter(order[self.shard :: self.num_shards])
