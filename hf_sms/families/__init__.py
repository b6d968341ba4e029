"""Model families: one class per library (:class:`Family`: widths and folders), one registry. Adding a family is
a :class:`Family` subclass and one :func:`register_family` call (docs/extending.md, "A model family")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..registry import Registry
from .base import CONFIG_NAME, WEIGHTS_NAME, CheckpointInfo, Family, Knob, is_class_name, literal
from .smp import SmpFamily
from .timm import TimmFamily
from .torch import TorchFamily
from .transformers import TransformersFamily

if TYPE_CHECKING:
    from torch import nn

FAMILIES: Registry = Registry("model library", hint="(a newer hf-sms wrote it? upgrade hf-sms)")


def register_family(family: Family) -> Family:
    """Add a family under its ``library`` name; :func:`family_of` asks each one's ``detects`` in registration
    order (a family registered after the built-in ones is asked before plain torch, the fallback)."""
    return FAMILIES.add(family.library, family)


for _family in (TimmFamily(), SmpFamily(), TransformersFamily()):
    register_family(_family)
_TORCH = register_family(TorchFamily())


def family_of(model: nn.Module) -> Family:
    """The family of ``model``: the first registered one that detects it, else plain torch."""
    return next((f for f in FAMILIES.values() if f.detects(model)), _TORCH)


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


__all__ = [
    "CONFIG_NAME",
    "FAMILIES",
    "WEIGHTS_NAME",
    "CheckpointInfo",
    "Family",
    "Knob",
    "SmpFamily",
    "TimmFamily",
    "TorchFamily",
    "TransformersFamily",
    "family_of",
    "family_of_config",
    "get_family",
    "is_class_name",
    "literal",
    "register_family",
]
