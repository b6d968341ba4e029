"""Which prunable weights a plan prunes (``prune_modules`` / ``skip_modules``, docs/pruning.md).

Modules are named as peft's ``target_modules``: a list of names, each the module's full name or its last parts
(``"q_proj"``, ``"layers.0.mlp.down_proj"``), or one string, a regular expression the full name must match. By
default a plan prunes every prunable weight, except in a causal language model, where it prunes the decoder's linear
layers and leaves the token embeddings and ``lm_head`` dense, as Wanda, SparseGPT and llm-compressor do (the paper's
CNN and T5 settings keep every prunable weight).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from .prunable import PrunableTensor, prunable_tensors

Modules = tuple[str, ...] | str | None


def _module(tensor: PrunableTensor) -> str:
    return tensor.name.rsplit(".", 1)[0] if "." in tensor.name else ""


def matches(modules: Modules, name: str) -> bool:
    """``name`` is one of ``modules`` (peft's ``target_modules`` rule)."""
    if isinstance(modules, str):
        return re.fullmatch(modules, name) is not None
    return any(name == key or name.endswith("." + key) for key in modules)


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal language model, peft-wrapped or not: one of ``AutoModelForCausalLM``'s classes or a
    subclass of one, or by what it can do (a remote-code model): a decoder-only model that generates through an
    output embedding (its LM head)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        from transformers import PreTrainedModel
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if any(cls.__name__ in known for cls in type(inner).__mro__):
        return True
    if not isinstance(inner, PreTrainedModel) or getattr(inner.config, "is_encoder_decoder", False):
        return False
    can_generate = getattr(inner, "can_generate", lambda: False)
    return bool(can_generate()) and isinstance(inner.get_output_embeddings(), nn.Linear)


def _embedding_weights(model: nn.Module) -> set[int]:
    out = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if getattr(module, "weight", None) is not None:
            out.add(id(module.weight))
    return out


def _check(field: str, modules, tensors: list[PrunableTensor]) -> None:
    if modules is None:
        return
    if isinstance(modules, str):
        try:
            re.compile(modules)
        except re.error as e:
            raise ValueError(
                f"{field}={modules!r} is not a regular expression ({e}); or give a list of names"
            ) from None
        found = any(matches(modules, _module(t)) for t in tensors)
        missing = [] if found else [modules]
    else:
        missing = [key for key in modules if not any(matches((key,), _module(t)) for t in tensors)]
    if missing:
        names = list(dict.fromkeys(_module(t) for t in tensors))
        raise ValueError(
            f"{field}: {missing} names no prunable module of this model (linear, convolution or embedding layers), "
            f"e.g. {names[:4]}; name modules as peft's target_modules does (a full name or its last parts, or one "
            "regular expression as a string)"
        )


@dataclass(frozen=True)
class ModuleSelection:
    """``prune``: the modules to prune (``None``: the default above); ``skip``: modules left dense, of those."""

    prune: Modules = None
    skip: Modules = None

    @classmethod
    def of(cls, prune=None, skip=None) -> ModuleSelection:
        """Lists as tuples (hashable, compared by value); a string stays a regular expression."""

        def norm(value):
            if value is None or isinstance(value, str):
                return value
            if not all(isinstance(v, str) for v in value):
                raise ValueError(f"module names must be strings, got {value!r}")
            return tuple(value)

        return cls(norm(prune), norm(skip))

    def tensors(self, model: nn.Module) -> list[PrunableTensor]:
        """The prunable weights of ``model`` this selection prunes, in module order; ``ValueError`` for a name that
        matches no prunable module, or a selection of none."""
        every = prunable_tensors(model)
        _check("prune_modules", self.prune, every)
        _check("skip_modules", self.skip, every)
        if self.prune is not None:
            chosen = [t for t in every if matches(self.prune, _module(t))]
        elif is_causal_lm(model):  # the decoder's linear layers
            embeddings = _embedding_weights(model)
            chosen = [t for t in every if t.kind == "linear" and id(t.param) not in embeddings]
        else:
            chosen = every
        if self.skip is not None:
            chosen = [t for t in chosen if not matches(self.skip, _module(t))]
        if not chosen and every:
            raise ValueError(
                f"prune_modules={self.prune!r}, skip_modules={self.skip!r} leave no weight of this model to prune"
            )
        return chosen

    def default_note(self, model: nn.Module) -> str | None:
        """What the default leaves dense in ``model``, for the run's log and card (``None`` where it prunes all)."""
        if self.prune is not None or not is_causal_lm(model):
            return None
        chosen = {t.name for t in self.tensors(model)}
        dense = [t.name for t in prunable_tensors(model) if t.name not in chosen]
        if not dense:
            return None
        return (
            f"prunes the decoder's linear layers of this causal LM; {', '.join(dense[:3])}"
            f"{' ...' if len(dense) > 3 else ''} stay dense, as Wanda, SparseGPT and llm-compressor leave them "
            "(prune_modules names what to prune instead)"
        )

    def describe(self) -> dict:
        """The selection as names (results, sparsity.json, the card); ``{}`` for the default."""
        out = {}
        for key, value in (("prune_modules", self.prune), ("skip_modules", self.skip)):
            if value is not None:
                out[key] = value if isinstance(value, str) else list(value)
        return out
