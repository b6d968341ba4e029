"""Read access to a checkpoint folder (either format, or a family's own dense save), tensor by tensor."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .codec import DENSE, decode_positions, decode_tensor, index_info, index_mask
from .constants import CONFIG_NAME, INDEX_SUFFIX, SPARSITY_NAME
from .families import Family, family_of_config, get_family
from .folder import PREVIOUS_SUFFIX, checkpoint_file, read_json, read_sparsity, restore_previous, weight_files
from .integrity import check_manifest
from .masks import MaskStats, eligible
from .safetensors_io import SafetensorsFile, workers

logger = logging.getLogger(__name__)


class SparseCheckpoint:
    """A checkpoint folder, read tensor by tensor by the names it was saved with.

    Attributes:
        info: the ``sparsity.json`` record, or ``None`` for a family's own save.
        config: ``config.json``, if any.
        family, library, architecture: the model family and the class it builds.
        files: the :class:`SafetensorsFile` s holding the weights.
        format: ``"bitmask"`` if any tensor is stored encoded, else ``"dense"``.
    """

    def __init__(self, directory: str):
        if not os.path.isdir(directory) and os.path.isdir(os.path.abspath(directory) + PREVIOUS_SUFFIX):
            restore_previous(directory)  # a save killed between its two renames: the old folder goes back
            logger.warning(
                "[hf-sms] %s was being replaced when a save was killed: restored the previous one", directory
            )
        if not os.path.isdir(directory):
            raise ValueError(f"{directory} is not a directory")
        self.directory = directory
        self.info = read_sparsity(directory)
        self.config = read_json(checkpoint_file(directory, CONFIG_NAME))
        known = family_of_config(self.config)
        if self.info is not None:
            self.library, self.architecture = self.info.get("library"), self.info.get("architecture")
        elif known is not None:
            self.library, self.architecture = known[0].library, known[1]
        else:
            raise ValueError(
                f"{directory} has neither {SPARSITY_NAME} nor a transformers/timm/smp {CONFIG_NAME}: not a model "
                "checkpoint. Save one with hf_sms.save_sparse(model, directory)."
            )
        paths = weight_files(directory)
        check_manifest(directory, self.info, paths)  # names and files bound to the folder, before anything is read
        self.files = [SafetensorsFile(p) for p in paths]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for key in f.keys():
                if key in self._where:
                    raise ValueError(f"tensor {key!r} appears in two weight files of {directory}; re-save it")
                self._where[key] = f
        recorded = (self.info or {}).get("crc32") or {}  # a dense folder's checksums (the family's files)
        if not isinstance(recorded, dict) or not all(isinstance(v, int) for v in recorded.values()):
            raise ValueError(f"{directory}/{SPARSITY_NAME} has corrupted checksums; re-save the checkpoint")
        for key, crc in recorded.items():
            if key in self._where:
                self._where[key].crcs.setdefault(key, crc)
        self._names = [k for k in self._where if not k.endswith(INDEX_SUFFIX)]
        for key in self._where:
            if key.endswith(INDEX_SUFFIX) and key[: -len(INDEX_SUFFIX)] not in self._where:
                raise ValueError(f"{directory}: {key!r} has no values tensor; the checkpoint is incomplete, re-save it")
        self.format = "bitmask" if len(self._names) < len(self._where) else "dense"

    @property
    def cut_in_place(self) -> bool:
        """A smaller model whose units were cut in place (its family's config cannot state its widths):
        :func:`hf_sms.load_sparse` cuts the model the family or a template builds to the stored shapes first."""
        shrunk = ((self.info or {}).get("recipe") or {}).get("shrunk")
        return isinstance(shrunk, dict) and shrunk.get("saved") == "smaller" and shrunk.get("cut") == "in place"

    @property
    def family(self) -> Family:
        return get_family(self.library)

    @property
    def aliases(self) -> dict[str, str] | None:
        """``{name: kept name}`` of tensors stored once because they share storage."""
        return (self.info or {}).get("aliases")

    def names(self) -> list[str]:
        """The tensors' names (an encoded tensor's index is not listed separately)."""
        return list(self._names)

    def is_encoded(self, name: str) -> bool:
        return name + INDEX_SUFFIX in self._where

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
    expected = (ckpt.info or {}).get("mask_hash")
    if not expected:
        return
    # The hash covers the tensors the saver counted; recomputing over the same names keeps checkpoints
    # valid when the eligibility rule grows (e.g. MultiheadAttention's in_proj_weight).
    recorded = (ckpt.info or {}).get("per_tensor")
    names = (
        list(recorded) if recorded is not None else [n for n, t in state_dict.items() if eligible(n, t.shape, t.dtype)]
    )
    if stats is None:
        stats = MaskStats()
        for name in (n for n in names if n in state_dict):
            stats.add(name, state_dict[name] != 0, "")
    if any(n not in stats.per_tensor for n in names) or stats.summary(names)["mask_hash"] != expected:
        raise ValueError(
            f"the weights of {ckpt.directory} do not have the mask recorded in {SPARSITY_NAME}: weight files and "
            "metadata come from different saves or a file is corrupted. Re-save the checkpoint."
        )
