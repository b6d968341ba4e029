"""timm: models built by ``timm.create_model`` from their architecture and constructor arguments (``_model_args``),
saved with ``save_for_hf``."""

from __future__ import annotations

import inspect
import json
import os

from .base import CONFIG_NAME, Family, Knob, literal

KNOBS = (
    Knob("channels", "filters"),  # ResNet planes per stage (a tuple, searched stage by stage): residual streams
    Knob("base_width", "filters"),  # ResNet bottleneck width per 64 channels
    Knob("stem_width", "filters"),  # ResNet and MaxViT stems
    Knob("block_reduce_first", "filters", wider=False),  # ResNet basic blocks: first conv planes // it
    Knob("conv_expand_ratio", "filters", ratio=True, only=("MaxxVit",)),  # MaxViT MBConv width
    Knob("mlp_ratio", "neurons", ratio=True),  # ViT, DeiT, Swin ... MLP width
    Knob("transformer_expand_ratio", "neurons", ratio=True, only=("MaxxVit",)),  # MaxViT MLP width
)


class TimmFamily(Family):
    library = hub_library_name = "timm"
    transformers_loadable = True  # as TimmWrapper, through AutoModelForImageClassification
    knobs = KNOBS

    def detects(self, model):
        return type(model).__module__.startswith("timm.") and hasattr(model, "pretrained_cfg")

    # -- widths --------------------------------------------------------------------------------------------------
    def values(self, model):
        args = dict(getattr(model, "_model_args", None) or {})
        return {k.name: args.get(k.name) for k in self.knobs if self.accepts(model, k)}

    def accepts(self, model, knob):
        if knob.only:
            return type(model).__name__ in knob.only
        return knob.name in inspect.signature(type(model).__init__).parameters

    def default(self, model, knob):
        parameter = inspect.signature(type(model).__init__).parameters.get(knob.name)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default

    def build(self, model, overrides):
        import timm

        args = {**(getattr(model, "_model_args", None) or {}), **overrides}
        args = {k: v for k, v in args.items() if v is not None or k not in overrides}
        return timm.create_model(model.pretrained_cfg["architecture"], pretrained=False, **args)

    def commit(self, model, overrides):
        model._model_args = {**(getattr(model, "_model_args", None) or {}), **overrides}  # what save_for_hf writes

    def example(self, model):
        import torch

        size = dict(getattr(model, "_model_args", None) or {}).get("img_size")
        shape = model.pretrained_cfg.get("input_size", (3, 224, 224))
        if size is not None:
            shape = (shape[0], *((size, size) if isinstance(size, int) else size))
        return torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))

    # -- folders -------------------------------------------------------------------------------------------------
    def architecture_of_config(self, config):
        return config.get("architecture") if "pretrained_cfg" in config else None

    def save(self, model, folder):
        from timm.models import save_for_hf

        save_for_hf(model, folder, safe_serialization=True)
        with open(os.path.join(folder, CONFIG_NAME), encoding="utf-8") as f:
            return json.load(f)["architecture"], {}

    def instantiate(self, ckpt, **kwargs):
        import timm

        return timm.create_model(f"local-dir:{os.path.abspath(ckpt.directory)}", pretrained=False, **kwargs)

    def own_config(self, config):
        # transformers' TimmWrapper passes num_classes itself; timm reads it from the top level too.
        config.get("model_args", {}).pop("num_classes", None)
        return config

    def own_loader(self, architecture, fmt, location, hub):
        if fmt != "dense":
            return None
        source = literal(f"{'hf-hub' if hub else 'local-dir'}:{location}")
        return ["import timm", "", f"model = timm.create_model({source}, pretrained=True)"]
