"""Model families: how each library's models are recognised, saved, built and loaded. One entry each.

Every place that depends on the library (saving, building from a folder, detecting a folder without
``sparsity.json``, patching ``config.json``, the loading snippet of model cards and ``hf-sms inspect``)
asks the family. Adding a family is a :class:`Family` subclass and one :func:`register_family` call.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import TYPE_CHECKING, Protocol

from ..registry import Registry
from .constants import CONFIG_NAME, FORMAT_VERSION, PROGRAM, QUANT_METHOD, QUANT_METHODS, TIMM_WIDTHS, WEIGHTS_NAME
from .folder import read_json, write_json
from .state import load_into, unique_tensors

if TYPE_CHECKING:  # torch is imported where a model is built or saved: reading a folder's files needs none
    from torch import nn


class CheckpointInfo(Protocol):
    """What a family reads of a checkpoint folder (:class:`hf_sms.checkpoint.reader.SparseCheckpoint` has it)."""

    directory: str
    config: dict | None
    architecture: str
    aliases: dict[str, str] | None


def _literal(text: str) -> str:
    return json.dumps(text)  # a double-quoted string that is also a valid Python literal


def plain_route_lines(route: str, location: str, hub: bool) -> list[str]:
    """The lines that load a smaller model cut in place by its plain ``route`` (:mod:`hf_sms.checkpoint.plain`)
    from ``location`` without hf-sms."""
    head = ["from huggingface_hub import hf_hub_download"] if hub else []

    def path(name: str) -> str:
        return f"hf_hub_download({_literal(location)}, {_literal(name)})" if hub else _literal(f"{location}/{name}")

    if route == "timm":
        source = _literal(f"{'hf-hub' if hub else 'local-dir'}:{location}")
        return [
            "import timm",
            *head,
            "from safetensors.torch import load_file",
            "from timm.models import adapt_model_from_string",
            "",
            f"model = timm.create_model({source}, pretrained=False)",
            f"model = adapt_model_from_string(model, open({path(TIMM_WIDTHS)}).read())",
            f"model.load_state_dict(load_file({path(WEIGHTS_NAME)}))",
        ]
    return [
        "import torch",
        *head,
        "",
        f"model = torch.export.load({path(PROGRAM)}).module()  # the forward only: no generate, no training",
    ]


class Family:
    """A model family. Subclasses set ``library`` (the name in ``sparsity.json``) and override what differs.

    ``transformers_loadable``: transformers' ``from_pretrained`` reads the family's folders, so in the
    bitmask format ``config.json`` gets the ``quantization_config`` through which transformers decodes.
    ``computes_loss``: the model returns its loss when given ``labels`` (else the trainer adds cross-entropy).
    """

    library = ""
    hub_library_name = "pytorch"  # library_name in the model card's front matter
    transformers_loadable = False
    computes_loss = False

    def detects(self, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family. The built-in families are found through the library
        :func:`hf_sms.shrinking.config_family` names; a family of another library claims its models here."""
        return False

    def prepare_training(self, model: nn.Module) -> None:
        """Adapt ``model``, in place, to what transformers' ``Trainer`` does to the models it trains."""

    def architecture_of_config(self, config: dict) -> str | None:
        """The architecture named by a ``config.json`` this family writes, else ``None``."""
        return None

    def save(self, model: nn.Module, folder: str) -> tuple[str, dict[str, str]]:
        """Write the family's own dense folder.

        Returns:
            ``(architecture, aliases)``: the class :meth:`build` recreates, and ``{name: kept name}`` of
            tensors stored once because they share storage.
        """
        raise NotImplementedError

    def instantiate(self, ckpt: CheckpointInfo, **kwargs) -> nn.Module:
        """A model of the checkpoint's architecture, with initial weights."""
        raise NotImplementedError

    def tie_weights(self, model: nn.Module) -> None:
        """Share the tensors the model ties (after it was built on the meta device, where ties are lost)."""

    def build(self, ckpt: CheckpointInfo, state_dict: dict, **kwargs) -> nn.Module:
        """The model of a checkpoint with ``state_dict`` (its decoded tensors) loaded strictly."""
        return load_into(self.instantiate(ckpt, **kwargs), state_dict, ckpt.aliases)

    def patch_config(self, config: dict, fmt: str) -> dict:
        """``config.json`` for ``fmt``: with (bitmask) or without (dense) hf-sms's quantization_config."""
        if not self.transformers_loadable:
            return config
        if (config.get("quantization_config") or {}).get("quant_method") in QUANT_METHODS:
            del config["quantization_config"]
        if fmt == "bitmask":
            config["quantization_config"] = {
                "quant_method": QUANT_METHOD,
                "format": "bitmask",
                "version": FORMAT_VERSION,
                "dequantize": True,
            }
        return config

    def write_config(self, folder: str, fmt: str) -> None:
        """Apply :meth:`patch_config` to the folder's ``config.json``; the file is rewritten only if it changes."""
        path = os.path.join(folder, CONFIG_NAME)
        config = read_json(path)
        if config is not None:
            patched = self.patch_config(copy.deepcopy(config), fmt)
            if patched != config:
                write_json(path, patched)

    def own_loader(self, architecture: str, fmt: str, location: str, hub: bool) -> list[str] | None:
        """Lines that load the checkpoint with the family's own loader, or ``None`` if it cannot."""
        return None

    def load_snippet(
        self, architecture: str, fmt: str, location: str, hub: bool = True, own: bool = True, plain: str | None = None
    ) -> str:
        """Python code that loads the checkpoint (shown in model cards and by ``hf-sms inspect``).

        Args:
            architecture: the checkpoint's architecture.
            fmt: ``"bitmask"`` or ``"dense"``.
            location: the Hub repository id, or a local folder.
            hub: whether ``location`` is a Hub repository.
            own: the family's own loader where it has one; ``False``: :func:`hf_sms.load_sparse` (a smaller model
                cut in place, which only hf-sms rebuilds), or its plain route.
            plain: a smaller model cut in place: the route that loads it without hf-sms (``ShrinkRecord.plain``).
        """
        if not own and plain is not None:
            return "\n".join(plain_route_lines(plain, location, hub))
        if architecture is not None and not re.fullmatch(
            r"[A-Za-z_]\w{0,200}(\.[A-Za-z_]\w{0,200}){0,20}", str(architecture), re.ASCII
        ):
            # the name goes into Python code that readers copy and run
            raise ValueError(f"architecture {architecture!r} is not a class name; re-save the checkpoint")
        lines = self.own_loader(architecture, fmt, location, hub) if own else None
        if lines is None:
            source = f"snapshot_download({_literal(location)})" if hub else _literal(location)
            template = ", model=MyModel(...)" if self.library == "torch" else ""  # plain models need a template
            download = ["from huggingface_hub import snapshot_download"] if hub else []
            lines = ["import hf_sms", *download, "", f"model = hf_sms.load_sparse({source}{template})"]
        return "\n".join(lines)


class TransformersFamily(Family):
    library = hub_library_name = "transformers"
    transformers_loadable = computes_loss = True

    def architecture_of_config(self, config):
        return (config.get("architectures") or [None])[0]

    def save(self, model, folder):
        # Inside a process group transformers writes on rank 0 only (``should_save_on_this_rank``), but a
        # replica is saved by whichever process owns it, into a folder no other process writes.
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        try:
            model.save_pretrained(folder, is_main_process=True)
        finally:
            del model.should_save_on_this_rank
        return type(model).__name__, {}

    @staticmethod
    def _class_and_config(ckpt):
        import transformers

        # never run code a folder names in auto_map, and never ask about it at a prompt
        config = transformers.AutoConfig.from_pretrained(ckpt.directory, trust_remote_code=False)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the state dict is decoded already
        cls = getattr(transformers, str(ckpt.architecture), None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            raise ValueError(
                f"{ckpt.directory}: architecture {ckpt.architecture!r} is not a transformers model class; fix "
                "sparsity.json / config.json, or pass model=<template>"
            )
        return cls, config

    def instantiate(self, ckpt, **kwargs):
        from transformers.initialization import no_init_weights

        cls, config = self._class_and_config(ckpt)
        with no_init_weights():  # every weight comes from the checkpoint: random init is wasted time
            return cls._from_config(config, **kwargs)

    def tie_weights(self, model):
        model.tie_weights()  # from_pretrained ties after loading; a model built on the meta device, before

    def build(self, ckpt, state_dict, **kwargs):
        cls, config = self._class_and_config(ckpt)
        # transformers applies its own key renaming to the names the checkpoint was saved with.
        model, info = cls.from_pretrained(
            None, config=config, state_dict=state_dict, output_loading_info=True, **kwargs
        )
        problems = {k: sorted(map(str, v))[:5] for k, v in info.items() if v}
        if problems:
            raise ValueError(f"{ckpt.directory} does not load cleanly into {ckpt.architecture}: {problems}; re-save it")
        return model

    def own_loader(self, architecture, fmt, location, hub):
        lines = [
            f"from transformers import {architecture}",
            "",
            f"model = {architecture}.from_pretrained({_literal(location)})",
        ]
        if fmt == "bitmask":
            lines.insert(0, "import hf_sms  # registers the sparse checkpoint format with transformers")
        return lines


class TimmFamily(Family):
    library = hub_library_name = "timm"
    transformers_loadable = True  # as TimmWrapper, through AutoModelForImageClassification

    def architecture_of_config(self, config):
        return config.get("architecture") if "pretrained_cfg" in config else None

    def save(self, model, folder):
        from timm.models import save_for_hf

        save_for_hf(model, folder, safe_serialization=True)
        return read_json(os.path.join(folder, CONFIG_NAME))["architecture"], {}

    def instantiate(self, ckpt, **kwargs):
        import timm

        return timm.create_model(f"local-dir:{os.path.abspath(ckpt.directory)}", pretrained=False, **kwargs)

    def patch_config(self, config, fmt):
        # transformers' TimmWrapper passes num_classes itself; timm reads it from the top level too.
        config.get("model_args", {}).pop("num_classes", None)
        return super().patch_config(config, fmt)

    def own_loader(self, architecture, fmt, location, hub):
        if fmt != "dense":
            return None
        source = _literal(f"{'hf-hub' if hub else 'local-dir'}:{location}")
        return ["import timm", "", f"model = timm.create_model({source}, pretrained=True)"]


class _HubMixinConfig(dict):
    """smp's config is a plain dict; Trainer sets ``config.use_cache`` on it. As an attribute of this
    subclass the flag stays out of the dict, so smp's saved config.json is unchanged."""


class SmpFamily(Family):
    library = "segmentation_models_pytorch"
    hub_library_name = "segmentation-models-pytorch"

    def prepare_training(self, model):
        if type(getattr(model, "_hub_mixin_config", None)) is dict:
            model._hub_mixin_config = _HubMixinConfig(model._hub_mixin_config)

    def architecture_of_config(self, config):
        return config.get("_model_class")

    def save(self, model, folder):
        model.save_pretrained(folder)  # huggingface_hub's PyTorchModelHubMixin
        return type(model).__name__, {}

    def instantiate(self, ckpt, **kwargs):
        import segmentation_models_pytorch as smp

        config = {k: v for k, v in (ckpt.config or {}).items() if not k.startswith("_")}
        if "encoder_weights" in config:
            config["encoder_weights"] = None  # the checkpoint has the weights; never download
        from torch import nn

        cls = getattr(smp, str(ckpt.architecture), None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"{ckpt.directory}: architecture {ckpt.architecture!r} is not an smp model class")
        return cls(**{**config, **kwargs})

    def own_loader(self, architecture, fmt, location, hub):
        if fmt != "dense":
            return None
        return ["import segmentation_models_pytorch as smp", "", f"model = smp.from_pretrained({_literal(location)})"]


class TorchFamily(Family):
    """Any other ``nn.Module``: the state dict (shared tensors once) in ``model.safetensors``; loads into a template."""

    library = "torch"

    def save(self, model, folder):
        from safetensors.torch import save_file

        tensors, aliases = unique_tensors(model)
        save_file(tensors, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
        return f"{type(model).__module__}.{type(model).__qualname__}", aliases

    def instantiate(self, ckpt, **kwargs):
        raise ValueError(
            f"{ckpt.directory} holds a plain torch model ({ckpt.architecture}); pass a template: "
            "load_sparse(directory, model=MyModel(...))"
        )


FAMILIES: Registry = Registry("model library", hint="(a newer hf-sms wrote it? upgrade hf-sms)")


def register_family(family: Family) -> Family:
    """Add a family, under its ``library`` name (:func:`hf_sms.checkpoint.sparse.family_of_model` asks each one's
    ``detects`` first, in registration order)."""
    return FAMILIES.add(family.library, family)


for _family in (TimmFamily(), SmpFamily(), TransformersFamily(), TorchFamily()):
    register_family(_family)


def get_family(library: str) -> Family:
    """The family named ``library`` (as written to ``sparsity.json``)."""
    return FAMILIES.get(library)


def family_of_config(config: dict | None) -> tuple[Family, str] | None:
    """``(family, architecture)`` named by a ``config.json``, or ``None`` if no family wrote it."""
    for family in FAMILIES.values():
        architecture = family.architecture_of_config(config or {})
        if architecture:
            return family, architecture
    return None
