"""Tiny models of every family structured pruning must handle, built from configs (no downloads), each with a
batch, the unit kinds it has, and how its own library loads a saved folder (for loading without hf-sms).

Sizes keep the units' layers the larger share of the weights, as in real models, so that "0.95x the parameters at
50 %" measures the pruning, not a tiny model's embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    make: Callable
    batch: Callable
    kinds: tuple[str, ...]  # the units its own config can state (fit_config=True)
    loader: str | None = None  # code loading folder {f!r} as `m` with the family's own library
    every: tuple[str, ...] = ()  # more kinds the graph finds, cut only with fit_config=False


def _tokens(vocab=64, n=2, length=7, **extra):
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(2, vocab, (n, length), generator=g), **extra}


def _seq2seq(vocab=64):
    g = torch.Generator().manual_seed(2)
    return _tokens(vocab, labels=torch.randint(2, vocab, (2, 5), generator=g))


def _image(size, channels=3):
    return lambda: torch.randn(2, channels, size, size, generator=torch.Generator().manual_seed(3))


def _pixels(size):
    return lambda: {"pixel_values": _image(size)()}


def _hf(cls_name: str, config_name: str, **config):
    def make(seed: int = 0):
        import transformers

        torch.manual_seed(seed)
        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**config))

    return make


def _auto(auto: str) -> str:
    return f"import transformers\nm = transformers.{auto}.from_pretrained({{f!r}})"


TIMM = "import timm\nm = timm.create_model('local-dir:' + {f!r}, pretrained=True)"
SMP = "import segmentation_models_pytorch as smp\nm = smp.from_pretrained({f!r})"


def _timm(name: str, **kwargs):
    def make(seed: int = 0):
        import timm

        torch.manual_seed(seed)
        return timm.create_model(name, pretrained=False, **kwargs)

    return make


def _smp(arch: str, **kwargs):
    def make(seed: int = 0):
        import segmentation_models_pytorch as smp

        torch.manual_seed(seed)
        return getattr(smp, arch)(encoder_weights=None, **kwargs)

    return make


_LM = dict(vocab_size=64, max_position_embeddings=32)
_TINY_MAXVIT = dict(embed_dim=(16, 32, 32, 32), depths=(1, 1, 1, 1), stem_width=16, transformer_dim_head=8)

ZOO: dict[str, Entry] = {
    "llama": Entry(
        _hf("LlamaForCausalLM", "LlamaConfig", hidden_size=16, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, **_LM),
        _tokens, ("neurons", "heads"), _auto("AutoModelForCausalLM")),
    "qwen2": Entry(
        _hf("Qwen2ForCausalLM", "Qwen2Config", hidden_size=16, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, **_LM),
        _tokens, ("neurons", "heads"), _auto("AutoModelForCausalLM")),
    "mistral": Entry(
        _hf("MistralForCausalLM", "MistralConfig", hidden_size=16, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, **_LM),
        _tokens, ("neurons", "heads"), _auto("AutoModelForCausalLM")),
    "t5": Entry(
        _hf("T5ForConditionalGeneration", "T5Config", vocab_size=64, d_model=16, d_ff=64, d_kv=8, num_heads=4,
            num_layers=2, num_decoder_layers=1, decoder_start_token_id=0, pad_token_id=0),
        _seq2seq, ("neurons", "heads"), _auto("AutoModelForSeq2SeqLM")),
    "t5_gated": Entry(
        _hf("T5ForConditionalGeneration", "T5Config", vocab_size=64, d_model=16, d_ff=48, d_kv=4, num_heads=4,
            num_layers=2, num_decoder_layers=1, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
            pad_token_id=0),
        _seq2seq, ("neurons", "heads"), _auto("AutoModelForSeq2SeqLM")),
    "gpt2": Entry(
        _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2),
        _tokens, ("neurons",), _auto("AutoModelForCausalLM"), ("heads",)),
    "bert": Entry(
        _hf("BertForSequenceClassification", "BertConfig", vocab_size=64, hidden_size=16, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=96, max_position_embeddings=32, num_labels=3),
        _tokens, ("neurons",), _auto("AutoModelForSequenceClassification"), ("heads",)),
    "opt": Entry(
        _hf("OPTForCausalLM", "OPTConfig", hidden_size=16, num_hidden_layers=2, ffn_dim=96, num_attention_heads=2,
            word_embed_proj_dim=16, **_LM),
        _tokens, ("neurons",), _auto("AutoModelForCausalLM"), ("heads",)),
    "vit": Entry(
        _hf("ViTForImageClassification", "ViTConfig", image_size=16, patch_size=8, hidden_size=16,
            num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=3),
        _pixels(16), ("neurons", "heads"), _auto("AutoModelForImageClassification")),
    "gpt_neox": Entry(
        _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_size=16, num_hidden_layers=2, intermediate_size=96,
            num_attention_heads=2, **_LM),
        _tokens, ("neurons",), _auto("AutoModelForCausalLM"), ("heads",)),
    "phi": Entry(
        _hf("PhiForCausalLM", "PhiConfig", hidden_size=16, num_hidden_layers=2, intermediate_size=96,
            num_attention_heads=2, **_LM),
        _tokens, ("neurons", "heads"), _auto("AutoModelForCausalLM")),
    "distilbert": Entry(
        _hf("DistilBertForSequenceClassification", "DistilBertConfig", vocab_size=64, dim=16, n_layers=2,
            n_heads=2, hidden_dim=96, max_position_embeddings=32, num_labels=3),
        _tokens, ("neurons",), _auto("AutoModelForSequenceClassification"), ("heads",)),
    "timm_resnet": Entry(
        _timm("resnet50", num_classes=4, layers=(1, 1, 1, 1), channels=(8, 8, 16, 16), stem_width=16),
        _image(32), ("filters",), TIMM),
    "timm_vit": Entry(
        _timm("vit_tiny_patch16_224", num_classes=4, img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2,
              mlp_ratio=4.0),
        _image(16), ("neurons",), TIMM, ("heads",)),
    "maxvit": Entry(
        _timm("maxvit_rmlp_nano_rw_256", num_classes=4, img_size=32, **_TINY_MAXVIT),
        _image(32), ("filters", "neurons"), TIMM),  # its heads add a relative-position bias read by index: whole
    "efficientnet_b0": Entry(_timm("efficientnet_b0", num_classes=4), _image(32), (), None, ("filters",)),
    "convnext_atto": Entry(_timm("convnext_atto", num_classes=4), _image(32), (), None, ("filters", "neurons")),
    "smp_unet": Entry(
        _smp("Unet", encoder_name="tu-resnet18", encoder_depth=3, decoder_channels=(32, 16, 8), classes=19),
        _image(32), ("filters",), SMP),
    "smp_pspnet": Entry(
        _smp("PSPNet", encoder_name="tu-resnet18", encoder_depth=3, psp_out_channels=32, classes=19),
        _image(32), ("filters",), SMP),
    # families no table names: found from the graph all the same
    "bart": Entry(
        _hf("BartForConditionalGeneration", "BartConfig", d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, **_LM),
        _seq2seq, ("neurons",), _auto("AutoModelForSeq2SeqLM"), ("heads",)),
    "swin": Entry(
        _hf("SwinForImageClassification", "SwinConfig", embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=2,
            image_size=32, patch_size=4, mlp_ratio=4.0, num_labels=3),
        _pixels(32), ("neurons",), _auto("AutoModelForImageClassification")),
    "densenet": Entry(_timm("densenet121", num_classes=4), _image(32), (), None, ("filters",)),
    "mobilenetv3": Entry(_timm("mobilenetv3_small_050", num_classes=4), _image(32), (), None, ("filters", "neurons")),
    "torchvision_resnet": Entry(
        lambda seed=0: (torch.manual_seed(seed), __import__("torchvision").models.resnet18(num_classes=4))[1],
        _image(32), ("filters",)),
    "transformer_encoder": Entry(
        lambda seed=0: (torch.manual_seed(seed), torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(16, 2, 64, batch_first=True), 2, enable_nested_tensor=False))[1],
        lambda: torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)), ("neurons",), None, ("heads",)),
}  # fmt: skip
