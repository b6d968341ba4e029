"""Baselines run beside SMS, registered in :data:`hf_sms.registry.BASELINES` (one file per family of baselines)."""

from . import imp  # noqa: F401  (registers imp, imp_mx, imp_reprune)
from .imp import run_imp

__all__ = ["run_imp"]
