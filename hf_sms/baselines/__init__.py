"""Baselines run beside SMS, registered in :data:`hf_sms.registry.BASELINES` (one file per family of baselines)."""

from ..registry import import_submodules
from .imp import run_imp

__all__ = ["run_imp"]

import_submodules(__name__, __path__)  # every file registers its entries: a new one needs no import line
