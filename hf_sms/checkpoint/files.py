"""A checkpoint folder's files, validated and read as bytes, without torch (:class:`CheckpointFiles`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import numpy as np

from ..families import Family, family_of_config, get_family
from .constants import CONFIG_NAME, INDEX_SUFFIX, SPARSITY_NAME
from .folder import PREVIOUS_SUFFIX, checkpoint_file, read_json, read_sparsity, restore_previous, weight_files
from .integrity import CorruptionError, check_manifest, require_manifest
from .masks import MaskStats
from .safetensors_raw import RawSafetensorsFile
from .shrink_record import ShrinkRecord

logger = logging.getLogger(__name__)


class CheckpointFiles:
    """A checkpoint folder's record, config, family and weight files, validated (file manifest, headers, checksums
    recorded for a dense folder) before any tensor is read; tensors are read as bytes (``files``:
    :class:`RawSafetensorsFile`), so nothing here needs torch (``hf-sms inspect``).

    Attributes:
        info: the ``sparsity.json`` record, or ``None`` for a family's own save.
        config: ``config.json``, if any.
        family, library, architecture: the model family and the class it builds.
        files: the ``file_class`` objects holding the weights.
        format: ``"bitmask"`` if any tensor is stored encoded, else ``"dense"``.
    """

    file_class = RawSafetensorsFile

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
        require_manifest(directory, self.info)
        check_manifest(directory, self.info, paths)  # names and files bound to the folder, before anything is read
        self.files = [self.file_class(p) for p in paths]
        self._where: dict[str, RawSafetensorsFile] = {}
        for f in self.files:
            for key in f.keys():
                if key in self._where:
                    raise ValueError(f"tensor {key!r} appears in two weight files of {directory}; re-save it")
                self._where[key] = f
        self._check_format()
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
        record = ShrinkRecord.of(self.info)
        return record is not None and record.cut_in_place

    @property
    def plain_route(self) -> str | None:
        """A smaller model cut in place: the route that loads it without hf-sms, if one was saved."""
        record = ShrinkRecord.of(self.info)
        return record.plain if record is not None and record.cut_in_place else None

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

    def stored_bytes(self, key: str) -> np.ndarray:
        """A stored tensor's bytes as they are in the file (an encoded tensor: its values, or ``name.sp_index``),
        checked against its CRC-32 where one is recorded."""
        return self._where[key].read_bytes(key)

    def _check_format(self) -> None:
        """A version-2 folder's weight files are of the format ``sparsity.json`` names: bitmask files say so in their
        header; a dense folder's tensors have their checksums (in ``sparsity.json`` or the files' headers), else a
        flipped byte would load unnoticed."""
        problem = format_problem(self.info, self.files)
        if problem:
            raise CorruptionError(f"{self.directory}: {problem}; re-save the checkpoint")

    def layout(self, key: str) -> tuple[str, tuple[int, ...]]:
        """``(dtype name, shape)`` of a stored tensor as the file's header gives them."""
        dtype, shape, _, _ = self._where[key].layout[key]
        return dtype, shape

    def hashed_names(self, eligible_names: Iterable[str]) -> list[str] | None:
        """The tensors whose masks ``sparsity.json``'s ``mask_hash`` covers, ``None`` if it records no hash.

        The tensors the saver counted (``per_tensor``), else ``eligible_names``: recomputing over the same names
        keeps checkpoints valid when the eligibility rule grows (e.g. MultiheadAttention's in_proj_weight)."""
        if not (self.info or {}).get("mask_hash"):
            return None
        recorded = self.info.get("per_tensor")
        return list(recorded) if recorded is not None else list(eligible_names)

    def check_mask_hash(self, stats: MaskStats, names: list[str]) -> None:
        """Raise if the masks measured in ``stats`` (over ``names``: :meth:`hashed_names`) do not have the recorded
        hash."""
        if any(n not in stats.per_tensor for n in names) or stats.summary(names)["mask_hash"] != self.info["mask_hash"]:
            raise CorruptionError(
                f"the weights of {self.directory} do not have the mask recorded in {SPARSITY_NAME}: weight files and "
                "metadata come from different saves or a file is corrupted. Re-save the checkpoint."
            )


def format_problem(info: dict | None, files: list[RawSafetensorsFile]) -> str | None:
    """Why a folder of format version 2 or later is not of the format its record names (``None``: it is)."""
    version = (info or {}).get("hf_sms_format_version", 1)
    if not isinstance(version, int) or version < 2:
        return None  # older folders: the readers' own checks
    fmt = info.get("format")
    if fmt == "bitmask" and not all(str(f.metadata.get("hf_sms", "")).startswith("bitmask-v") for f in files):
        return f"{SPARSITY_NAME} says bitmask but the weights are not hf-sms bitmask files"
    if fmt == "dense" and not isinstance(info.get("crc32"), dict) and not all(f.crcs for f in files):
        return f"a dense folder whose {SPARSITY_NAME} and weight files record no checksums"
    return None
