"""segmentation_models_pytorch: models built from their constructor arguments (huggingface_hub's
``PyTorchModelHubMixin`` config), saved with ``save_pretrained``; a ``tu-`` encoder takes timm's arguments."""

from __future__ import annotations

import inspect

from .base import Family, Knob, literal
from .timm import KNOBS as TIMM_KNOBS


class _HubMixinConfig(dict):
    """smp's config is a plain dict; Trainer sets ``config.use_cache`` on it. As an attribute of this
    subclass the flag stays out of the dict, so smp's saved config.json is unchanged."""


class SmpFamily(Family):
    library = "segmentation_models_pytorch"
    hub_library_name = "segmentation-models-pytorch"
    knobs = (
        Knob("psp_out_channels", "filters"),
        Knob("decoder_channels", "filters"),  # DeepLabV3 (an int; Unet's tuple is not searched)
        Knob("decoder_pyramid_channels", "filters"),  # FPN
        Knob("decoder_segmentation_channels", "filters"),
        *(k for k in TIMM_KNOBS if not k.only),  # a tu- encoder takes timm's arguments
    )

    def detects(self, model):
        return type(model).__module__.startswith("segmentation_models_pytorch") and hasattr(model, "save_pretrained")

    # -- widths --------------------------------------------------------------------------------------------------
    def _config(self, model) -> dict:
        config = getattr(model, "_hub_mixin_config", None) or {}
        return {k: v for k, v in config.items() if not k.startswith("_")}

    def values(self, model):
        config = self._config(model)
        return {k.name: config.get(k.name) for k in self.knobs if self.accepts(model, k)}

    def accepts(self, model, knob):
        timm_encoder = str(self._config(model).get("encoder_name", "")).startswith("tu-")
        own = knob.name in inspect.signature(type(model).__init__).parameters
        return own or (timm_encoder and any(knob is k for k in TIMM_KNOBS))

    def default(self, model, knob):
        owner = type(model)
        name = str(self._config(model).get("encoder_name", ""))
        if knob.name not in inspect.signature(owner.__init__).parameters and name.startswith("tu-"):
            import timm
            import torch

            with torch.device("meta"):  # the class of the timm model the encoder wraps, for its defaults
                owner = type(timm.create_model(name[3:], pretrained=False))
        parameter = inspect.signature(owner.__init__).parameters.get(knob.name)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default

    def fit_hint(self, model):
        import timm

        name = str(self._config(model).get("encoder_name", ""))
        if name.startswith("tu-") or not timm.is_model(name):
            return ""
        # smp's own encoders fix their widths by name and keep the stages the decoder never reads
        return (
            f" smp's own encoder {name!r} has widths fixed by its name; timm's (encoder_name='tu-{name}') has "
            "widths smp's config states, and builds only the stages the decoder reads."
        )

    def build(self, model, overrides):
        args = {**self._config(model), **overrides}
        args = {k: v for k, v in args.items() if v is not None or k not in overrides}
        return type(model)(**{**args, "encoder_weights": None})  # never download weights

    def commit(self, model, overrides):
        model._hub_mixin_config.update(overrides)  # what smp's save_pretrained writes to config.json

    def example(self, model):
        import torch

        channels = self._config(model).get("in_channels", 3)
        return torch.randn(1, channels, 64, 64, generator=torch.Generator().manual_seed(0))

    # -- folders -------------------------------------------------------------------------------------------------
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
        from torch import nn

        config = {k: v for k, v in (ckpt.config or {}).items() if not k.startswith("_")}
        if "encoder_weights" in config:
            config["encoder_weights"] = None  # the checkpoint has the weights; never download
        cls = getattr(smp, str(ckpt.architecture), None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"{ckpt.directory}: architecture {ckpt.architecture!r} is not an smp model class")
        return cls(**{**config, **kwargs})

    def own_loader(self, architecture, fmt, location, hub):
        if fmt != "dense":
            return None
        return ["import segmentation_models_pytorch as smp", "", f"model = smp.from_pretrained({literal(location)})"]
