"""The smaller model: removed units cut out (``cut``), at widths the model family's own config states
(``families``, ``fit``), checked against the pruned model (``shrink``)."""

from ..pruning.prunable import parameter_count
from .families import FAMILY_CONFIGS, ConfigFamily, Knob, config_family, register_config_family
from .shrink import dense_shaped, shrink, shrink_record

__all__ = [
    "FAMILY_CONFIGS",
    "ConfigFamily",
    "Knob",
    "dense_shaped",
    "config_family",
    "parameter_count",
    "register_config_family",
    "shrink",
    "shrink_record",
]
