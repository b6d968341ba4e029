"""State dicts with shared tensors: stored once on save, loaded strictly on load."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the families that import this module read folders without torch
    import torch
    from torch import nn


def unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict of ``model`` with each storage kept once (safetensors refuses shared tensors).

    Args:
        model: any module.

    Returns:
        ``(tensors, aliases)``: the CPU tensors to store, and ``{dropped name: kept name}`` for the tensors
        that share storage, offset and shape with a kept one (tied weights).
    """
    seen: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    return tensors, aliases


def load_into(model: nn.Module, state_dict: dict[str, torch.Tensor], aliases: dict | None = None) -> nn.Module:
    """Strictly load ``state_dict`` into ``model``, in place.

    Args:
        model: the template.
        state_dict: the checkpoint's tensors.
        aliases: ``{name: kept name}`` of tensors stored once; a key may also be missing if it shares storage
            with a loaded one in ``model`` (a tie the model makes itself).

    Returns:
        ``model``. Raises ``ValueError`` on unexpected, misshapen or missing tensors, before or instead of
        leaving any tensor at its random initial value.
    """
    own = model.state_dict()
    if not set(state_dict) <= set(own):  # stored under transformers' former names (_renamed)
        names = _renamed(model, [*state_dict, *(n for pair in (aliases or {}).items() for n in pair)], own)
        state_dict = {names[k]: v for k, v in state_dict.items()}
        aliases = {names[d]: names[k] for d, k in (aliases or {}).items()}
    for dup, kept in (aliases or {}).items():
        if kept in state_dict:
            state_dict.setdefault(dup, state_dict[kept])
    unexpected = sorted(set(state_dict) - set(own))
    mismatched = [k for k in state_dict if k in own and tuple(own[k].shape) != tuple(state_dict[k].shape)]
    if unexpected or mismatched:
        what = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(own[k].shape)}" for k in mismatched[:5]]
        raise ValueError(
            f"the checkpoint does not fit this model: unexpected tensors {unexpected[:5]}, shape mismatches {what}. "
            "Pass a template of the architecture the checkpoint was saved from."
        )
    on_meta = any(t.device.type == "meta" for t in own.values())  # a template built without weights
    model.load_state_dict(state_dict, strict=False, assign=on_meta)
    if on_meta:
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # ties are lost on the meta device; transformers models restore theirs
        left = [k for k, t in model.state_dict().items() if t.device.type == "meta"]
        if left:
            raise ValueError(
                f"the template was on the meta device and {left[:5]} got no weights from the checkpoint: build the "
                "template on a real device (e.g. cpu), or let the family build it (load_sparse(dir))"
            )
    loaded = {own[k].untyped_storage().data_ptr() for k in state_dict if own[k].numel()}
    missing = [
        k for k in own if k not in state_dict and not (own[k].numel() and own[k].untyped_storage().data_ptr() in loaded)
    ]
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[:5]}; they would keep their "
            "current (random) values. Re-save the checkpoint or pass the matching template."
        )
    return model


def _renamed(model: nn.Module, names: list[str], own: dict) -> dict[str, str]:
    """``{stored name: the name model uses}``: transformers 5 saves some architectures under their former names
    (ViT's ``encoder.layer.0.attention.attention.query`` for ``layers.0.attention.q_proj``) and renames them when it
    loads; a template is loaded the same way (renamings only: a tensor transformers would fuse stays unexpected)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without these: names as stored
        return {n: n for n in names}
    if not isinstance(model, PreTrainedModel):
        return {n: n for n in names}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    prefix = getattr(model, "base_model_prefix", None)
    return {n: rename_source_key(n, renamings, [], prefix, own)[0] for n in names}
