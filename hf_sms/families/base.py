"""A model family: one class per library that owns everything hf-sms does differently for its models.

Widths (the smaller model, :func:`hf_sms.shrink`): how to tell the library's models (:meth:`Family.detects`),
rebuild one with other values of its config (:meth:`Family.build`, under ``torch.device("meta")`` for shapes),
write chosen values into its config (:meth:`Family.commit`), which values count units (:class:`Knob`), and a batch
that traces it (:meth:`Family.example`). Units are found from the model's graph (:mod:`hf_sms.pruning.graph`),
never from this table.

Folders (:func:`hf_sms.save_sparse`, :func:`hf_sms.load_sparse`, cards, ``hf-sms inspect``): how a model is saved
in the library's own format (:meth:`Family.save`), the architecture a ``config.json`` names, how a model is built
from a folder and loaded (:meth:`Family.instantiate`, :meth:`Family.load`), and the library's own loading lines.

Torch is imported where a model is built or saved: reading a folder's files needs none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .state import load_into

if TYPE_CHECKING:
    from torch import nn

CONFIG_NAME = "config.json"  # the libraries' config file (transformers, timm's save_for_hf, smp)
WEIGHTS_NAME = "model.safetensors"


def is_class_name(architecture) -> bool:
    """Whether ``architecture`` is a dotted name a reader's code can import (not ``make.<locals>.C``, a class
    defined inside a function, nor a crafted string meant to run as code)."""
    return bool(re.fullmatch(r"[A-Za-z_]\w{0,200}(\.[A-Za-z_]\w{0,200}){0,20}", str(architecture), re.ASCII))


def literal(text: str) -> str:
    """A double-quoted string that is also a valid Python literal (for loading lines readers copy and run)."""
    return json.dumps(text)


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


class CheckpointInfo(Protocol):
    """What a family reads of a checkpoint folder (:class:`hf_sms.checkpoint.reader.SparseCheckpoint` has it)."""

    directory: str
    config: dict | None
    architecture: str
    aliases: dict[str, str] | None


class Family:
    """A library's models. Subclasses set ``library`` (the name in ``sparsity.json``) and override what differs;
    :func:`hf_sms.families.register_family` adds one (tried in registration order; plain torch is the fallback).

    ``knobs``: what its config can state, tried in order. ``transformers_loadable``: transformers'
    ``from_pretrained`` reads the family's folders (in the bitmask format ``config.json`` gets the
    ``quantization_config`` through which transformers decodes). ``computes_loss``: the model returns its loss when
    given ``labels`` (else the trainer adds cross-entropy).
    """

    library = ""
    hub_library_name = "pytorch"  # library_name in the model card's front matter
    transformers_loadable = False
    computes_loss = False
    knobs: tuple[Knob, ...] = ()

    # -- which models --------------------------------------------------------------------------------------------
    def detects(self, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family."""
        return False

    # -- widths: the smaller model -------------------------------------------------------------------------------
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

    def fit_hint(self, model: nn.Module) -> str:
        """How to get a model whose config states more widths, for the warning about units it leaves dense."""
        return ""

    def commit(self, model: nn.Module, overrides: dict) -> None:
        """Write ``overrides`` into ``model``'s config, so that its own save writes them."""

    def example(self, model: nn.Module):
        """A small batch ``model`` takes, or ``None`` (plain torch: pass one)."""
        return None

    # -- folders: saving and loading -----------------------------------------------------------------------------
    def prepare_training(self, model: nn.Module) -> None:
        """Adapt ``model``, in place, to what transformers' ``Trainer`` does to the models it trains."""

    def architecture_of_config(self, config: dict) -> str | None:
        """The architecture named by a ``config.json`` this family writes, else ``None``."""
        return None

    def save(self, model: nn.Module, folder: str) -> tuple[str, dict[str, str]]:
        """Write the family's own dense folder.

        Returns:
            ``(architecture, aliases)``: the class :meth:`instantiate` recreates, and ``{name: kept name}`` of
            tensors stored once because they share storage.
        """
        raise NotImplementedError

    def instantiate(self, ckpt: CheckpointInfo, **kwargs) -> nn.Module:
        """A model of the checkpoint's architecture, with initial weights."""
        raise NotImplementedError

    def tie_weights(self, model: nn.Module) -> None:
        """Share the tensors the model ties (after it was built on the meta device, where ties are lost)."""

    def load(self, ckpt: CheckpointInfo, state_dict: dict, **kwargs) -> nn.Module:
        """The model of a checkpoint with ``state_dict`` (its decoded tensors) loaded strictly."""
        return load_into(self.instantiate(ckpt, **kwargs), state_dict, ckpt.aliases)

    def own_config(self, config: dict) -> dict:
        """``config.json`` as the family's own loader and transformers both read it (hf-sms adds its
        ``quantization_config`` after)."""
        return config

    def own_loader(self, architecture: str, fmt: str, location: str, hub: bool) -> list[str] | None:
        """Lines that load the checkpoint with the family's own loader, or ``None`` if it cannot."""
        return None
