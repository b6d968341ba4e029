"""An adapter's folder in peft's format (``adapter_config.json``, ``adapter_model.safetensors``): saved from a replica,
loaded back onto its pruned model as hf-sms trains it, every field and tensor checked first."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.constants import SPARSITY_NAME
from ..checkpoint.folder import atomic_folder, checkpoint_file
from ..checkpoint.reader import SparseCheckpoint
from .merge import plain_name
from .replica import load_trained_state, lora_layers, make_replica, trained_state

ADAPTER_FOLDER = "adapter"  # beside a merged soup: the adapter in peft's format
KIND_KEY = "hf_sms_replica_params"
MERGED_NOTE = f"the adapter in {ADAPTER_FOLDER}/ is merged into these weights: load_adapter it onto its start"


def save_adapter(model: nn.Module, folder: str) -> None:
    """The adapter of ``model`` in peft's format (``adapter_config.json``, ``adapter_model.safetensors``), written
    atomically; a MaskLoRA / ScaleLoRA adapter records its kind (load it with :func:`load_adapter`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "default" not in (getattr(model, "peft_config", None) or {}):
        raise ValueError(
            f"{type(model).__name__} holds no peft adapter named 'default' to save: save_adapter saves the adapter of "
            "a PeftModel or of a model peft injected adapters into (hf_sms.load_adapter, get_peft_model)"
        )
    config = model.peft_config["default"]
    kinds = {getattr(type(m), "variant", None) for m in inner.modules() if hasattr(m, "lora_A")}
    kind = next((k.gating + "_lora" for k in kinds if k is not None), "lora")
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    with atomic_folder(folder, "replace") as tmp:
        config.save_pretrained(tmp)
        tensors = {k: v.contiguous() for k, v in state.items()}
        save_file(tensors, f"{tmp}/adapter_model.safetensors", metadata={"format": "pt", KIND_KEY: kind})


def load_adapter(model: nn.Module, folder: str, args=None) -> nn.Module:
    """``model`` (the plain pruned model) with the adapter saved in ``folder`` injected: a MaskLoRA / ScaleLoRA
    adapter as hf-sms trains it (peft alone would rebuild a plain LoRA layer); the weights are shared, not copied."""
    path = checkpoint_file(folder, "adapter_model.safetensors")
    config_path = checkpoint_file(folder, "adapter_config.json")
    if path is None or config_path is None:
        raise ValueError(f"{folder} holds no adapter_model.safetensors and adapter_config.json (a peft adapter)")
    for file in (path, config_path):
        if not os.access(file, os.R_OK):
            raise ValueError(f"{file} cannot be read (permission denied): give your user read access to it")
    with safe_open(path, "pt") as f:
        kind, state = (f.metadata() or {}).get(KIND_KEY, "lora"), {k: f.get_tensor(k) for k in f.keys()}
    if kind not in ("mask_lora", "scale_lora", "lora"):
        raise ValueError(f"{path} records adapter kind {kind!r}, not one hf-sms writes (mask_lora, scale_lora)")
    if kind == "lora":
        raise ValueError(f"{os.path.basename(folder)} is a plain LoRA adapter: load it with peft, then merge_adapters")
    args = args or _adapter_args(config_path, kind)
    _refuse_merged_twice(model, folder, state)
    replica = make_replica(model, args)
    state = {_with_adapter_name(k): v for k, v in state.items()}
    expected = trained_state(replica)
    for name, t in state.items():  # a rank or shape the config does not give: named, before any copy
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{path}: {name} has shape {tuple(t.shape)}, but r={args.lora_rank} on this model gives "
                f"{tuple(expected[name].shape)}: the adapter and its config (or the model) disagree"
            )
    load_trained_state(replica, state)
    _check_update(replica, path)
    return replica


def _adapter_args(config_path: str, kind: str) -> _AdapterArgs:
    """The adapter's settings from its ``adapter_config.json``, each checked (a hand-edited or crafted file is
    refused naming the field, never misread)."""
    try:
        with open(config_path, encoding="utf-8") as f:
            saved = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not JSON ({e}): re-save the adapter") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{config_path} holds a {type(saved).__name__}, not peft's adapter config: re-save it")
    for key in ("r", "lora_alpha"):
        if key not in saved:
            raise ValueError(f"{config_path} lacks {key!r}: re-save the adapter")
    rank, alpha = saved["r"], saved["lora_alpha"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise ValueError(f"{config_path}: lora_alpha must be a finite number > 0, got {alpha!r}")
    targets = saved.get("target_modules")
    if targets is not None and not isinstance(targets, str):  # a string is peft's regular expression, kept whole
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"{config_path}: target_modules must be a list of names or one regex, got {targets!r}")
        targets = sorted(targets)
    return _AdapterArgs(kind, rank, float(alpha), targets or None)


def _refuse_merged_twice(model: nn.Module, folder: str, state: dict[str, torch.Tensor]) -> None:
    """Refuse ``model`` if it already holds this adapter merged: ``save_model`` of an adapted trainer writes the
    merged model with its adapter in ``<folder>/adapter``; one adapted layer whose update is not zero and whose
    weight equals the merged folder's tells (loading it again would add the update twice)."""
    parent = os.path.dirname(os.path.abspath(folder))
    if os.path.basename(os.path.abspath(folder)) != ADAPTER_FOLDER or not os.path.isfile(
        os.path.join(parent, SPARSITY_NAME)
    ):
        return
    params = dict(model.named_parameters())
    for key, b in state.items():
        name = plain_name(key.replace(".lora_B.weight", ".weight"))
        if ".lora_B." not in key or name not in params or not b.any():
            continue
        merged = SparseCheckpoint(parent).read(name)
        if merged.shape == params[name].shape and torch.equal(merged.to(params[name]), params[name].detach()):
            raise ValueError(
                f"the model already holds the adapter in {folder} merged (its {name} is {parent}'s, the merged "
                "model save_model wrote): loading it again would add its update twice. Use that model as it is, or "
                "load_adapter onto the pruned start the adapter was trained from"
            )
        return


def _check_update(replica: nn.Module, path: str) -> None:
    """Refuse an adapter whose update cannot be finite (``s * r * max|A| * max|B|`` bounds every entry)."""
    for prefix, layer in lora_layers(replica):
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        bound = layer.scaling["default"] * a.shape[0] * float(a.detach().abs().max()) * float(b.detach().abs().max())
        if not math.isfinite(bound) or bound > 1e30:
            raise ValueError(
                f"{path}: {prefix}'s update can reach {bound:g} (lora_alpha / r x its factors): it would overflow "
                "the model's outputs; the adapter is corrupted or its lora_alpha wrong"
            )


def _with_adapter_name(key: str) -> str:
    """peft saves ``x.lora_A.weight``; the live module holds ``x.lora_A.default.weight``."""
    for factor in (".lora_A.", ".lora_B."):
        key = key.replace(f"{factor}weight", f"{factor}default.weight")
    return key


@dataclass
class _AdapterArgs:
    replica_params: str
    lora_rank: int
    lora_alpha: float
    lora_target_modules: list[str] | None
    lora_dropout: float = 0.0
