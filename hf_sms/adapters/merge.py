"""``merge_adapters``: peft's ``merge_and_unload`` for a pruned model: the plain model back, with exactly its zeros.

Plain LoRA trains a dense update ``s B A``; merged as it is, it fills every pruned weight (a 50% sparse LLaMA is 0%
sparse after ``merge_and_unload``). Here each layer's update is added only where the mask keeps a weight, and how
much of the update that drops is reported. MaskLoRA / ScaleLoRA (:mod:`hf_sms.adapters.lora`) drop nothing: their
update is zero on pruned weights by construction.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..pruning.prunable import Masks

logger = logging.getLogger("hf_sms")


def plain_name(name: str) -> str:
    """A parameter's name in the model without adapters: peft's ``base_model.model.`` prefix and ``.base_layer``
    dropped."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def check_mergeable(model: nn.Module) -> None:
    """Refuse, naming them, adapters hf-sms cannot merge under a mask: other tuners than LoRA (IA3, LoHa, LoKr,
    VeRA, ...) and prompt learning (its virtual tokens are no weights of the model)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    configs = getattr(model, "peft_config", None)
    prompt = [n for n, c in (configs or {}).items() if getattr(c, "is_prompt_learning", False)] if configs else []
    if prompt:
        raise ValueError(
            f"adapter(s) {prompt} are prompt learning ({type(configs[prompt[0]]).__name__}): their virtual tokens are "
            "not weights of the model, so there is nothing to merge and merging would drop them; save the PeftModel "
            "with save_pretrained and load it with peft"
        )
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tuners = [m for m in base.modules() if isinstance(m, BaseTunerLayer)]
    others = sorted(
        {f"{type(m).__module__.split('.')[-2]}.{type(m).__name__}" for m in tuners if not isinstance(m, LoraLayer)}
    )
    if others:
        raise ValueError(
            f"hf-sms merges LoRA adapters (DoRA, lora_bias and Embedding LoRA included) under a pruned model's mask; "
            f"this model has {others}: merge those with peft (merge_and_unload), then hf_sms.prune keeps the zeros"
        )


@torch.no_grad()
def merge_adapters(model: nn.Module, masks: Masks | None = None, return_report: bool = False):
    """Merge every LoRA adapter of ``model`` (a peft ``PeftModel``, or a model peft injected adapters into) into its
    base weights under the mask, and return the plain model (modified in place, as ``merge_and_unload``).

    Args:
        model: the adapted model.
        masks: ``{name: bool tensor}`` (True keeps a weight) under the plain model's parameter names; default: each
            base weight's own zeros (a pruned weight is exactly zero).
        return_report: also return ``{"layers", "dropped_fraction", "dropped_entries"}``: the share of the updates'
            squared norm that fell on pruned weights and was left out.

    Returns:
        The plain model (``model.get_base_model()`` for a ``PeftModel``), with exactly the mask's zeros.
    """
    from peft.tuners.lora import LoraLayer

    check_mergeable(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kept_sq = dropped_sq = 0.0
    dropped_entries = layers = 0
    for name, layer in [(n, m) for n, m in base.named_modules() if isinstance(m, LoraLayer)]:
        if layer.merged:
            layer.unmerge()  # the dense update is in the weight: take it out, then merge it under the mask
        inner = layer.get_base_layer()
        weight = inner.weight
        key = plain_name(f"{name}.weight")
        keep = masks[key].to(weight.device) if masks is not None and key in masks else weight != 0
        before = weight.detach().float()
        # peft's own merge of every variant (DoRA's magnitude, lora_bias, an Embedding's lora_embedding_A/B, MaskLoRA
        # and ScaleLoRA through theirs), then the mask: what falls on a pruned weight is left out, and said
        active = [a for a in layer.active_adapters if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {})]
        layer.merge(safe_merge=True, adapter_names=active)
        update = weight.detach().float() - before
        del before
        dropped = update[~keep]
        dropped_sq += float(dropped.double().square().sum())
        kept_sq += float(update[keep].double().square().sum())
        dropped_entries += int(torch.count_nonzero(dropped))
        weight.masked_fill_(~keep, 0)
        _replace(base, name, inner)
        layers += 1
    for name, wrapper in [(n, m) for n, m in base.named_modules() if hasattr(m, "modules_to_save")]:
        trained = wrapper.modules_to_save[wrapper.active_adapters[0]]  # a head trained in full: keep its zeros
        for pname, p in trained.named_parameters():
            original = wrapper.original_module.get_parameter(pname)
            if p.dim() > 1:
                keep = original != 0
                dropped = (p - original)[~keep]
                dropped_sq += float(dropped.double().square().sum())
                kept_sq += float((p - original)[keep].double().square().sum())
                dropped_entries += int(torch.count_nonzero(dropped))
                p.masked_fill_(~keep, 0)
        _replace(base, name, trained)
    if not hasattr(model, "get_base_model") and "peft_config" in vars(base):
        del base.peft_config  # peft's record of injected adapters: none are left
    total = kept_sq + dropped_sq
    fraction = dropped_sq / total if total else 0.0
    report = {"layers": layers, "dropped_fraction": fraction, "dropped_entries": dropped_entries}
    if dropped_entries:
        logger.warning(
            "[hf-sms] merge_adapters: %d update entries fell on pruned weights and were left out (%.1f%% of the "
            "updates' squared norm); train with replica_params='mask_lora' to train exactly what the merge keeps",
            dropped_entries,
            100 * report["dropped_fraction"],
        )
    return (base, report) if return_report else base
