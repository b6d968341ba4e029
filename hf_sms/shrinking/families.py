"""The one table of what each model family's own config can state (docs/extending.md "A model family").

Units are found from the model's graph (:mod:`hf_sms.pruning.graph`), never from this table. A family here says
how its library rebuilds a model at other widths (from a transformers config, timm's or smp's constructor
arguments), which of those values count units (a :class:`Knob`), and which batch traces its models. Registering a
family is one :class:`ConfigFamily` in ``FAMILY_CONFIGS``; detection is :func:`config_family`, which
:mod:`hf_sms.checkpoint.families` (saving and loading folders) asks too.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..registry import Registry


@dataclass(frozen=True)
class Knob:
    """A config field or constructor argument that sizes units of ``kind``.

    ``counts``: its value is the number of units (times a whole factor, e.g. LLaMA's ``num_attention_heads`` per
    key/value head), set directly; else it is searched for the smallest model holding the units kept (``ratio``:
    a float multiple of a layer's width, e.g. timm's ``mlp_ratio``; ``wider``: a larger value widens layers, False
    for timm's ``block_reduce_first``, which divides them). ``only``: the model classes that take it (default:
    those whose constructor names it)."""

    name: str
    kind: str
    counts: bool = False
    ratio: bool = False
    wider: bool = True
    only: tuple[str, ...] = ()


class ConfigFamily:
    """A library's models: how to tell one (:meth:`detects`), rebuild it with other knob values (:meth:`build`,
    under ``torch.device("meta")`` for shapes), write chosen values into its config (:meth:`commit`), and a batch
    to trace it (:meth:`example`). ``knobs``: what its config can state, tried in order."""

    library = "torch"
    knobs: tuple[Knob, ...] = ()

    def detects(self, model: nn.Module) -> bool:
        return True

    def values(self, model: nn.Module) -> dict:
        """The current value of every knob ``model`` has (``None``: its architecture's default)."""
        return {}

    def accepts(self, model: nn.Module, knob: Knob) -> bool:
        return False

    def default(self, model: nn.Module, knob: Knob):
        """The value a knob has when ``model``'s config does not name it (its constructor's default), or None."""
        return None

    def build(self, model: nn.Module, overrides: dict) -> nn.Module | None:
        """A new model of ``model``'s kind with ``overrides`` (knob name -> value; ``None`` drops an argument), or
        ``None`` where the family rebuilds nothing (plain torch: its code does)."""
        return None

    def commit(self, model: nn.Module, overrides: dict) -> None:
        """Write ``overrides`` into ``model``'s config, so that its own save writes them."""

    def example(self, model: nn.Module):
        """A small batch ``model`` takes, or ``None`` (plain torch: pass one)."""
        return None


def _head_size(config) -> int | None:
    for name in ("head_dim", "d_kv", "attention_head_size", "kv_channels"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


class TransformersConfig(ConfigFamily):
    library = "transformers"
    # The FFN width and head counts of transformers configs; a head count keeps the head size (``head_dim``).
    knobs = tuple(
        [
            Knob(n, "neurons", counts=True)
            for n in (
                "intermediate_size",
                "d_ff",
                "n_inner",
                "ffn_dim",
                "hidden_dim",
                "encoder_ffn_dim",
                "decoder_ffn_dim",
                "ffn_hidden_size",
                "inner_dim",
            )
        ]
        + [Knob("mlp_ratio", "neurons", ratio=True)]  # Swin, ...: the FFN width as a multiple of each stage's
        + [
            Knob(n, "heads", counts=True)
            for n in (
                "num_attention_heads",
                "num_key_value_heads",
                "num_heads",
                "n_heads",
                "n_head",
                "encoder_attention_heads",
                "decoder_attention_heads",
            )
        ]
    )

    def detects(self, model):
        from transformers import PreTrainedModel

        return isinstance(model, PreTrainedModel)

    def values(self, model):
        return {k.name: getattr(model.config, k.name) for k in self.knobs if self.accepts(model, k)}

    def accepts(self, model, knob):
        aliases = getattr(model.config, "attribute_map", {})  # T5's num_attention_heads is its num_heads
        return hasattr(model.config, knob.name) and knob.name not in aliases

    def _pinned(self, model, overrides: dict) -> dict:
        """``overrides`` with the head size stated, where they change a head count: fewer heads of the same size."""
        heads = any(k.kind == "heads" for k in self.knobs if k.name in overrides)
        size = _head_size(model.config)
        if heads and size is not None and getattr(model.config, "head_dim", None) is None:
            return {**overrides, "head_dim": size}
        return overrides

    def build(self, model, overrides):
        config = copy.deepcopy(model.config)
        for name, value in self._pinned(model, overrides).items():
            setattr(config, name, value)
        from transformers.initialization import no_init_weights

        with no_init_weights():
            built = type(model)._from_config(config)
        built.tie_weights()  # initialisation ties them, and no_init_weights skips it
        return built

    def commit(self, model, overrides):
        for name, value in self._pinned(model, overrides).items():
            setattr(model.config, name, value)

    def example(self, model):
        config, main = model.config, getattr(model, "main_input_name", "input_ids")
        g = torch.Generator().manual_seed(0)
        if main == "input_ids":
            vocab = getattr(config, "vocab_size", None) or 2
            ids = torch.randint(0, max(vocab, 2), (1, 8), generator=g)
            batch = {"input_ids": ids}
            if getattr(config, "is_encoder_decoder", False):
                batch["decoder_input_ids"] = ids
            return batch
        if main == "pixel_values":
            size = getattr(config, "image_size", 224)
            size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
            return {"pixel_values": torch.randn(1, getattr(config, "num_channels", 3), *size, generator=g)}
        return None


class TimmConfig(ConfigFamily):
    library = "timm"
    knobs = (
        Knob("channels", "filters"),  # ResNet planes per stage (a tuple, searched stage by stage): residual streams
        Knob("base_width", "filters"),  # ResNet bottleneck width per 64 channels
        Knob("stem_width", "filters"),  # ResNet and MaxViT stems
        Knob("block_reduce_first", "filters", wider=False),  # ResNet basic blocks: first conv planes // it
        Knob("conv_expand_ratio", "filters", ratio=True, only=("MaxxVit",)),  # MaxViT MBConv width
        Knob("mlp_ratio", "neurons", ratio=True),  # ViT, DeiT, Swin ... MLP width
        Knob("transformer_expand_ratio", "neurons", ratio=True, only=("MaxxVit",)),  # MaxViT MLP width
    )

    def detects(self, model):
        return type(model).__module__.startswith("timm.") and hasattr(model, "pretrained_cfg")

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
        size = dict(getattr(model, "_model_args", None) or {}).get("img_size")
        shape = model.pretrained_cfg.get("input_size", (3, 224, 224))
        if size is not None:
            shape = (shape[0], *((size, size) if isinstance(size, int) else size))
        return torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))


class SmpConfig(ConfigFamily):
    library = "segmentation_models_pytorch"
    knobs = (
        Knob("psp_out_channels", "filters"),
        Knob("decoder_channels", "filters"),  # DeepLabV3 (an int; Unet's tuple is not searched)
        Knob("decoder_pyramid_channels", "filters"),  # FPN
        Knob("decoder_segmentation_channels", "filters"),
        *(k for k in TimmConfig.knobs if not k.only),  # a tu- encoder takes timm's arguments
    )

    def detects(self, model):
        return type(model).__module__.startswith("segmentation_models_pytorch") and hasattr(model, "save_pretrained")

    def _config(self, model) -> dict:
        config = getattr(model, "_hub_mixin_config", None) or {}
        return {k: v for k, v in config.items() if not k.startswith("_")}

    def values(self, model):
        config = self._config(model)
        return {k.name: config.get(k.name) for k in self.knobs if self.accepts(model, k)}

    def accepts(self, model, knob):
        timm_encoder = str(self._config(model).get("encoder_name", "")).startswith("tu-")
        own = knob.name in inspect.signature(type(model).__init__).parameters
        return own or (timm_encoder and any(knob is k for k in TimmConfig.knobs))

    def default(self, model, knob):
        owner = type(model)
        name = str(self._config(model).get("encoder_name", ""))
        if knob.name not in inspect.signature(owner.__init__).parameters and name.startswith("tu-"):
            import timm

            with torch.device("meta"):  # the class of the timm model the encoder wraps, for its defaults
                owner = type(timm.create_model(name[3:], pretrained=False))
        parameter = inspect.signature(owner.__init__).parameters.get(knob.name)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default

    def build(self, model, overrides):
        args = {**self._config(model), **overrides}
        args = {k: v for k, v in args.items() if v is not None or k not in overrides}
        return type(model)(**{**args, "encoder_weights": None})  # never download weights

    def commit(self, model, overrides):
        model._hub_mixin_config.update(overrides)  # what smp's save_pretrained writes to config.json

    def example(self, model):
        channels = self._config(model).get("in_channels", 3)
        return torch.randn(1, channels, 64, 64, generator=torch.Generator().manual_seed(0))


FAMILY_CONFIGS: Registry = Registry("model family config")


def register_config_family(family: ConfigFamily) -> ConfigFamily:
    """Add a family (tried in registration order; plain torch is the fallback for anything no family claims)."""
    return FAMILY_CONFIGS.add(family.library, family)


for _family in (TimmConfig(), SmpConfig(), TransformersConfig()):
    register_config_family(_family)
_TORCH = ConfigFamily()


def config_family(model: nn.Module) -> ConfigFamily:
    """The family of ``model``: the first registered one that detects it, else plain torch."""
    return next((f for f in FAMILY_CONFIGS.values() if f.detects(model)), _TORCH)
