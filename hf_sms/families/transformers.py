"""transformers: models built from their config (``PreTrainedModel``), saved with ``save_pretrained``; the FFN
width and head counts are config fields."""

from __future__ import annotations

import copy

from .base import Family, Knob, is_class_name, literal


def _head_size(config) -> int | None:
    for name in ("head_dim", "d_kv", "attention_head_size", "kv_channels"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


_FFN = ("intermediate_size", "d_ff", "n_inner", "ffn_dim", "hidden_dim", "encoder_ffn_dim", "decoder_ffn_dim")
_HEADS = (
    "num_attention_heads",
    "num_key_value_heads",
    "num_heads",
    "n_heads",
    "n_head",
    "encoder_attention_heads",
    "decoder_attention_heads",
)


class TransformersFamily(Family):
    library = hub_library_name = "transformers"
    transformers_loadable = computes_loss = True
    # The FFN width and head counts of transformers configs; a head count keeps the head size (``head_dim``).
    knobs = (
        *(Knob(n, "neurons", counts=True) for n in (*_FFN, "ffn_hidden_size", "inner_dim")),
        Knob("mlp_ratio", "neurons", ratio=True),  # Swin, ...: the FFN width as a multiple of each stage's
        *(Knob(n, "heads", counts=True) for n in _HEADS),
    )

    def detects(self, model):
        from transformers import PreTrainedModel

        return isinstance(model, PreTrainedModel)

    # -- widths --------------------------------------------------------------------------------------------------
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
        import torch

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

    # -- folders -------------------------------------------------------------------------------------------------
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

    def load(self, ckpt, state_dict, **kwargs):
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
        if not is_class_name(architecture):  # the name goes into Python code that readers copy and run
            raise ValueError(f"architecture {architecture!r} is not a class name; re-save the checkpoint")
        lines = [
            f"from transformers import {architecture}",
            "",
            f"model = {architecture}.from_pretrained({literal(location)})",
        ]
        if fmt == "bitmask":
            lines.insert(0, "import hf_sms  # registers the sparse checkpoint format with transformers")
        return lines
