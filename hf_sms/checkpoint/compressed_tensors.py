"""Sparse LLMs saved by llm-compressor in compressed-tensors' ``sparse-bitmask`` / ``sparse-24-bitmask`` formats,
read exactly without compressed-tensors (docs/checkpoints.md, "Sparse checkpoints of other tools").

Many 2:4 and unstructured sparse LLaMA checkpoints of 2024-2025 are stored this way: ``config.json`` holds
``quantization_config = {"quant_method": "compressed-tensors", "sparsity_config": {"format": ...}}`` and each compressed
linear layer ``M`` is stored as ``M.compressed`` (the kept values in row-major order: 1-D for ``sparse-bitmask``,
``[rows, cols / 2]`` for 2:4), ``M.bitmask`` (uint8 ``[rows, ceil(cols / 8)]``, the mask packed along each row, least
significant bit first: numpy's ``packbits(bitorder="little")``), ``M.row_offsets`` (``sparse-bitmask`` only) and
``M.shape``. compressed-tensors has since dropped these compressors and transformers 5 loads such a folder with the
pruned layers' weights missing, randomly initialised; :func:`load_compressed` builds the model and fills every
weight, its mask kept (a 2:4 folder stays 2:4 through replicas, soups and saves).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError, safe_open
from torch import nn

from .constants import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from .folder import checkpoint_file, read_json

FORMATS = ("sparse-bitmask", "sparse-24-bitmask")
PARTS = ("compressed", "bitmask", "row_offsets", "shape")


def sparsity_format(config: dict | None) -> str | None:
    """The compressed-tensors sparse format of a ``config.json`` (``None`` for any other folder); a folder that is
    also quantized is refused (its values are not the weights)."""
    quant = (config or {}).get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        return None
    sparsity = quant.get("sparsity_config") or {}
    fmt = sparsity.get("format") if isinstance(sparsity, dict) else None
    if fmt not in FORMATS:
        return None
    if quant.get("config_groups"):
        raise ValueError(
            "this compressed-tensors folder is quantized as well as sparse (quantization_config.config_groups): "
            "hf-sms reads sparse-only folders; load it with vLLM or compressed-tensors"
        )
    return fmt


def _files(directory: str) -> list[str]:
    index = checkpoint_file(directory, INDEX_NAME)
    if index is not None:
        names = sorted(set(read_json(index)["weight_map"].values()))
    else:
        names = [WEIGHTS_NAME]
    paths = [checkpoint_file(directory, n) for n in names]
    missing = [n for n, p in zip(names, paths) if p is None]
    if missing:
        raise ValueError(f"{directory}: the weight file(s) {missing} are missing or not regular files inside it")
    return paths


def _unpack(bitmask: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    bits = np.unpackbits(bitmask.numpy().astype(np.uint8, copy=False), axis=-1, count=shape[1], bitorder="little")
    return torch.from_numpy(bits.reshape(shape).astype(bool))


def decompress(name: str, parts: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """The dense weight of layer ``name`` from its stored parts; ``ValueError`` naming it where they disagree."""
    missing = [p for p in ("compressed", "bitmask", "shape") if p not in parts]
    if fmt == "sparse-bitmask" and "row_offsets" not in parts:
        missing.append("row_offsets")
    if missing:
        raise ValueError(f"{name}: the compressed weight lacks {missing}; the folder is incomplete")
    raw = parts["shape"].reshape(-1).tolist()
    if not all(isinstance(s, int) or (math.isfinite(s) and s == int(s)) for s in raw):
        raise ValueError(f"{name}: its stored shape {raw} is not whole numbers; the folder is damaged")
    shape = tuple(int(s) for s in raw)
    values, bitmask = parts["compressed"], parts["bitmask"]
    if not values.is_floating_point():  # int8 / fp8 values are a quantized folder, not only a sparse one
        raise ValueError(
            f"{name}: its values are stored as {values.dtype}, not a floating-point weight: a quantized folder, "
            "which hf-sms does not read (dequantize it with llm-compressor / compressed-tensors first)"
        )
    if len(shape) != 2 or min(shape) < 1 or tuple(bitmask.shape) != (shape[0], math.ceil(shape[1] / 8)):
        raise ValueError(f"{name}: shape {shape} and bitmask {tuple(bitmask.shape)} disagree")
    keep = _unpack(bitmask, shape)
    kept = int(keep.sum())
    if values.numel() != kept:
        raise ValueError(f"{name}: {values.numel()} stored values for {kept} kept positions in its bitmask")
    if fmt == "sparse-24-bitmask":
        groups = keep.reshape(shape[0], -1, 4) if shape[1] % 4 == 0 else None
        if groups is None or not bool((groups.sum(-1) == 2).all()) or tuple(values.shape) != (shape[0], shape[1] // 2):
            raise ValueError(f"{name}: not 2:4 (two of every four positions kept, values [rows, cols / 2])")
    else:
        offsets = parts["row_offsets"].reshape(-1)
        counts = keep.sum(-1)
        if offsets.numel() != shape[0] or not torch.equal(offsets.long(), counts.cumsum(0) - counts):
            raise ValueError(f"{name}: row_offsets disagree with the bitmask's rows")
    dense = torch.zeros(shape, dtype=values.dtype)
    dense[keep] = values.reshape(-1)  # row-major, as the compressor gathered them
    return dense


def read_state(directory: str, fmt: str) -> dict[str, torch.Tensor]:
    """The folder's state dict with every compressed weight dense (one layer decompressed at a time)."""
    plain, grouped = {}, {}
    for path in _files(directory):
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    module, _, part = key.rpartition(".")
                    if part in PARTS and module:
                        grouped.setdefault(module, {})[part] = f.get_tensor(key)
                    else:
                        plain[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as e:  # truncated or not safetensors: name the file
            raise ValueError(f"{path} is not a readable safetensors file ({e}): the folder is damaged") from e
    for module, parts in grouped.items():
        if f"{module}.weight" in plain:
            raise ValueError(f"{directory}: {module} is stored both dense and compressed")
        plain[f"{module}.weight"] = decompress(module, parts, fmt)
        parts.clear()
    return _one_dtype(directory, plain)


def _one_dtype(directory: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every floating tensor in the widest floating dtype the folder holds (a float16 layer in a float32 folder
    would give a model whose first forward fails on mixed dtypes); widening is exact, so nothing changes value."""
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) <= 1:
        return state
    if dtypes == {torch.float16, torch.bfloat16}:  # neither holds the other exactly
        raise ValueError(f"{directory} mixes float16 and bfloat16 weights: convert it to one dtype first")
    wide = max(dtypes, key=lambda d: torch.finfo(d).bits)
    return {k: t.to(wide) if t.is_floating_point() else t for k, t in state.items()}


def load_compressed(directory: str, model: nn.Module | None = None, **kwargs) -> nn.Module:
    """The model of a compressed-tensors sparse folder, every weight exact (its pruned entries zero); built from
    ``config.json`` (without its ``quantization_config``) unless ``model`` is given; in eval mode."""
    config = read_json(checkpoint_file(directory, CONFIG_NAME))
    fmt = sparsity_format(config)
    if fmt is None:
        raise ValueError(f"{directory} is not a compressed-tensors sparse-bitmask / sparse-24-bitmask folder")
    state = read_state(directory, fmt)
    if model is None:
        import transformers

        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        architecture = (plain.get("architectures") or [None])[0]
        cls = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            raise ValueError(
                f"{directory}/{CONFIG_NAME} names no transformers model class in 'architectures' "
                f"({architecture!r}; e.g. 'LlamaForCausalLM'): pass model= a model of the folder's architecture"
            )
        try:
            auto = cls.config_class.from_dict(plain)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{directory}/{CONFIG_NAME} is not a {cls.config_class.__name__} ({e})") from e
        with init_empty_weights(include_buffers=False):
            model = cls._from_config(auto, **kwargs)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(auto, "tie_word_embeddings", False)}
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"{directory} does not load into {architecture}: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        model.tie_weights()
    else:
        model.load_state_dict(state, strict=True)
    return model.eval()


def is_compressed_folder(directory: str) -> bool:
    """A folder holding a compressed-tensors sparse model (``config.json`` says so)."""
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and sparsity_format(config) is not None
