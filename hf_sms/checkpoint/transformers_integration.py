"""``AutoModel*.from_pretrained(dir)`` for bitmask checkpoints, through a transformers quantization method, and
checked reads of dense hf-sms folders.

A bitmask folder's ``config.json`` has ``quantization_config = {"quant_method": "hf-sms-sparse", ...}``.
Once :func:`register` has run (after ``import hf_sms``, when transformers' models load), transformers builds the
quantizer below, whose weight converter decodes each ``(W, W.sp_index)`` pair after transformers' own key renaming.
The loaded model is an ordinary dense model: the quantizer is not kept and the quantization config is dropped.

A ``format="dense"`` folder is the family's own, which loads without hf-sms; so transformers reads it as any
other. With hf_sms imported, ``from_pretrained`` of a local one first checks it as ``hf-sms inspect`` does (files,
every tensor's CRC-32, the mask hash): :func:`check_dense_folder`; a compressed-tensors sparse folder, which
transformers 5 would load with random weights, is refused with the lines that load it.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict

import torch
from transformers.core_model_loading import (
    ConversionOps,
    WeightConverter,
    WeightTransform,
    _IdentityOp,
    build_glob_alternation,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from .codec import decode_tensor
from .compressed_tensors import is_compressed_folder
from .constants import FORMAT_VERSION, INDEX_NAME, INDEX_SUFFIX, QUANT_METHOD, QUANT_METHODS, WEIGHTS_NAME
from .files import CheckpointFiles
from .folder import checkpoint_file, read_json, read_sparsity
from .inspect import verify_checkpoint
from .masks import MaskStats, eligible
from .prefetch import Prefetcher
from .safetensors_io import SafetensorsFile
from .shrink_record import ShrinkRecord


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

    def __init__(self, hf_quantizer: SparseCheckpointQuantizer):
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        return self  # stateless; transformers deep-copies each converter per weight

    def convert(self, input_dict, source_patterns=None, target_patterns=None, model=None, full_layer_name=None, **kw):
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


class SparseCheckpointConfig(QuantizationConfigMixin):
    """Marks a checkpoint saved by ``hf_sms.save_sparse(format="bitmask")``; loading restores dense weights."""

    def __init__(self, format: str = "bitmask", version: int = FORMAT_VERSION, dequantize: bool = True, **kwargs):
        self.quant_method = QUANT_METHOD
        self.format = format
        self.version = version
        self.dequantize = True  # weights load dense: the model is an ordinary model afterwards


class SparseCheckpointQuantizer(HfQuantizer):
    """Decodes bitmask checkpoints on load, then checks that every tensor of the model arrived.

    transformers re-initialises missing weights at random with only a printed report; for a sparse
    checkpoint that would silently destroy the model, so a missing tensor raises here.
    """

    requires_calibration = False
    # Source patterns are searched in the key, so "weight" also matches MultiheadAttention's in_proj_weight.
    serialized_names = {"weight": ["weight", "weight" + INDEX_SUFFIX]}

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.errors: list[str] = []
        self._prefetch: Prefetcher | None = None
        self._files: list[SafetensorsFile] = []
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
            paths = [p for p in checkpoint_files or [] if p.endswith(".safetensors")]
            root = getattr(model.config, "_name_or_path", None)
            if root and os.path.isdir(root):  # a local folder: an index naming "../x" never leads outside it
                for p in paths:
                    checkpoint_file(root, os.path.relpath(os.path.normpath(p), os.path.normpath(root)))
            # the files and every tensor's name are the ones sparsity.json records (a Hub download: its snapshot)
            # and of the format it names; CheckpointFiles checks all of it, as for every other reader
            folder = root if root and os.path.isdir(root) else (os.path.dirname(paths[0]) if paths else None)
            self._checkpoint = CheckpointFiles(folder) if folder is not None else None
            self._files = files = [SafetensorsFile(p) for p in paths]
            self._prefetch = Prefetcher(files)
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
            more = f" (and {len(self.errors) - 1} more errors)" if self.errors[1:] else ""
            raise ValueError(self.errors[0] + more)
        for f in self._files:  # transformers read the tensors stored as they are: check their bytes in the file
            for key in f.crcs:
                f.read(key, mapped=True)
        self._check_mask_hash(model)
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

    _checkpoint: CheckpointFiles | None = None

    @torch.no_grad()
    def _check_mask_hash(self, model) -> None:
        """The loaded weights have the mask ``sparsity.json`` records (as ``load_sparse`` checks): weight files and
        record from different saves are refused, not loaded."""
        files = self._checkpoint
        if files is None:
            return
        state = model.state_dict()
        names = files.hashed_names(n for n, t in state.items() if eligible(n, t.shape, t.dtype))
        if not names or any(n not in state for n in names):  # names transformers converted: not comparable here
            return
        stats = MaskStats()
        for name in names:
            stats.add(name, state[name] != 0, "")
        files.check_mask_hash(stats, names)

    def get_load_operations(self):
        return {"deserialize": SparseDecode, "dequantize": SparseDecode}

    def get_weight_conversions(self):
        return [_Converter(names, param, [SparseDecode(self)]) for param, names in self.serialized_names.items()]

    def is_serializable(self):
        return False  # weights are dense after loading; save again with hf_sms.save_sparse

    @property
    def is_trainable(self) -> bool:
        return True


def register() -> None:
    """Register the ``hf-sms-sparse`` quantization method with transformers (under its name and the short one of
    folders written before), and check dense hf-sms folders in ``from_pretrained``; repeated calls do nothing."""
    for name in QUANT_METHODS:
        if name not in AUTO_QUANTIZATION_CONFIG_MAPPING:
            register_quantization_config(name)(SparseCheckpointConfig)
        if name not in AUTO_QUANTIZER_MAPPING:
            register_quantizer(name)(SparseCheckpointQuantizer)
    if not getattr(PreTrainedModel.from_pretrained, "hf_sms_checked", False):
        PreTrainedModel.from_pretrained = _checked(PreTrainedModel.from_pretrained.__func__)


def check_dense_folder(directory: str) -> None:
    """Raise ``ValueError`` naming what is wrong if an hf-sms ``format="dense"`` folder is not what its
    ``sparsity.json`` records: another file, a tensor renamed or swapped, a byte changed, another mask. Every other
    folder (bitmask: its quantizer checks it; not hf-sms's) passes untouched."""
    if is_compressed_folder(directory):  # transformers 5 leaves its compressed layers' weights random
        raise ValueError(
            f"{directory} holds a compressed-tensors sparse model, whose compressors compressed-tensors has dropped: "
            f"transformers would fill its pruned layers at random. Load it with hf_sms.load_sparse({directory!r}), "
            f"or convert it once: hf-sms convert {directory} --output DIR (then from_pretrained(DIR))"
        )
    info = read_sparsity(directory) or {}
    record = ShrinkRecord.of(info)
    if record is not None and record.cut_in_place:  # widths its config cannot state
        raise ValueError(
            f"{directory} holds a smaller model cut in place (widths its config cannot state): transformers would "
            f"build the full-size model and fill the layers that differ at random. Load it with "
            f"hf_sms.load_sparse({directory!r}), which cuts the model to the stored widths"
        )
    quant = (read_json(os.path.join(directory, "config.json")) or {}).get("quantization_config") or {}
    if info.get("format") != "dense" and quant.get("quant_method") in QUANT_METHODS:
        return  # a bitmask folder: its quantizer checks it while decoding
    if not info or not any(os.path.exists(os.path.join(directory, n)) for n in (WEIGHTS_NAME, INDEX_NAME)):
        return  # not an hf-sms folder, or no weights (transformers says so itself)
    # a dense folder, or one whose record says bitmask but whose config transformers reads as plain: check it
    problems = verify_checkpoint(CheckpointFiles(directory))[0]
    if problems:
        more = f" (and {len(problems) - 1} more)" if problems[1:] else ""
        raise ValueError(f"{directory} is corrupted: {problems[0]}{more}")


def _checked(from_pretrained):
    """transformers' ``from_pretrained``, checking a local dense hf-sms folder first (:func:`check_dense_folder`)."""

    @functools.wraps(from_pretrained)
    def checked(cls, pretrained_model_name_or_path, *args, **kwargs):
        path = pretrained_model_name_or_path
        if isinstance(path, (str, os.PathLike)):
            folder = os.path.join(path, kwargs.get("subfolder") or "")
            if os.path.isdir(folder):
                check_dense_folder(folder)
        return from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)

    checked.hf_sms_checked = True
    return classmethod(checked)


# Importing this module registers too: when it is what first imports transformers' models, the import hook of
# hf_sms/__init__.py fires while this module is only half defined (and finds no register() yet).
register()
