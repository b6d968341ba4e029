"""Read access to a checkpoint folder (either format, or a family's own dense save), tensor by tensor."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .codec import DENSE, decode_positions, decode_tensor, index_info, index_mask
from .constants import INDEX_SUFFIX
from .files import CheckpointFiles
from .masks import MaskStats, eligible
from .safetensors_io import SafetensorsFile, workers


class SparseCheckpoint(CheckpointFiles):
    """A checkpoint folder (:class:`CheckpointFiles`), read as torch tensors by the names it was saved with."""

    file_class = SafetensorsFile

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of the dense tensor (an encoded one's from its index header: nothing decoded)."""
        dtype, shape, _, _ = self._where[name].entries[name]
        if self.is_encoded(name):
            shape = tuple(index_info(self.read_raw(name + INDEX_SUFFIX, mapped=True), name)["shape"])
        return shape, dtype

    def check_claims(self, model: nn.Module) -> None:
        """Raise before anything is decoded if a stored tensor claims another shape than ``model``'s tensor of that
        name, or, under a name the model lacks, more elements than any of its tensors (``model`` may be on the meta
        device). A hostile index may claim any shape; decoding one claiming 2^35 entries would stall the load."""
        own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        largest = max((math.prod(s) for s in own.values()), default=0)
        for name in self._names:
            shape = tuple(self.spec(name)[0])
            if name in own and shape != own[name] or name not in own and math.prod(shape) > largest:
                what = f"the model's {own[name]}" if name in own else f"no tensor of the model has {math.prod(shape)}"
                raise ValueError(
                    f"{self.directory}: {name!r} claims shape {shape}, but {what}: the checkpoint is corrupted or of "
                    "another architecture. Pass the matching template, or re-save the checkpoint."
                )

    def read_raw(self, key: str, mapped: bool = False) -> torch.Tensor:
        """A stored tensor as it is in the file (for an encoded tensor: its values, or ``name.sp_index``);
        ``mapped``: see :meth:`SafetensorsFile.read`."""
        return self._where[key].read(key, mapped)

    def read_encoded(self, name: str, mapped: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(values, index)`` of an encoded tensor, else ``None``."""
        if not self.is_encoded(name):
            return None
        return self.read_raw(name, mapped), self.read_raw(name + INDEX_SUFFIX, mapped)

    def read(self, name: str) -> torch.Tensor:
        """The dense tensor."""
        enc = self.read_encoded(name)
        return self.read_raw(name) if enc is None else decode_tensor(*enc, name=name)

    def read_sparse(self, name: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """``(positions, values, shape)``: the nonzeros of a tensor by flat row-major position. An encoded tensor
        is never made dense; a dense-stored one is read and its zeros dropped."""
        enc = self.read_encoded(name)
        if enc is None:
            dense = self.read_raw(name)
            flat = dense.reshape(-1)
            positions = torch.nonzero(flat).reshape(-1)
            return positions, flat[positions], tuple(dense.shape)
        values, index = enc
        positions, head = decode_positions(values, index, name)
        if head["codec"] == DENSE:
            values = values.reshape(-1)[positions]
        return positions, values.reshape(-1), tuple(head["shape"])

    def chunk_reader(self, name: str) -> Callable[[int, int], torch.Tensor]:
        """``read(start, stop)``: a slice of the flattened tensor; reads only that slice if stored dense."""
        if self.is_encoded(name):
            flat = self.read(name).reshape(-1)
            return lambda start, stop: flat[start:stop]
        f = self._where[name]
        return lambda start, stop: f.read_range(name, start, stop)

    def mask(self, name: str) -> torch.Tensor:
        """The nonzero mask; read from the index alone unless its codec is DENSE (zeros among the values)."""
        if not self.is_encoded(name):
            return self.read_raw(name) != 0
        mask = index_mask(self.read_raw(name + INDEX_SUFFIX), name)
        return mask if mask is not None else self.read(name) != 0

    def codec(self, name: str) -> str:
        """How a tensor is stored: its index's codec, or ``"dense"``."""
        return index_info(self.read_raw(name + INDEX_SUFFIX), name)["codec"] if self.is_encoded(name) else "dense"

    def mask_stats(self, names: Iterable[str]) -> MaskStats:
        """Sparsity, codec and mask hash of each of ``names``, measured from the stored tensors."""
        stats = MaskStats()
        for name in names:
            stats.add(name, self.mask(name), self.codec(name))
        return stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, dense, read and decoded on a thread pool (numpy and file reads release the GIL)."""
        with ThreadPoolExecutor(max_workers=workers()) as pool:
            return dict(zip(self._names, pool.map(self.read, self._names)))


def check_masks(ckpt: SparseCheckpoint, state_dict: dict[str, torch.Tensor] | None, stats: MaskStats | None = None):
    """Raise if the loaded weights do not have the mask hash recorded in ``sparsity.json``.

    The masks come from ``state_dict`` (dense tensors), or from ``stats`` (digests a loader recorded while
    reading, e.g. from stored positions).
    """
    names = ckpt.hashed_names(n for n, t in (state_dict or {}).items() if eligible(n, t.shape, t.dtype))
    if names is None:
        return
    if stats is None:
        stats = MaskStats()
        for name in (n for n in names if n in state_dict):
            stats.add(name, state_dict[name] != 0, "")
    ckpt.check_mask_hash(stats, names)
