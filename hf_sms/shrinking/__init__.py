"""The smaller model: removed units cut out (``cut``), at widths the model family's own config states
(``fit``, with :mod:`hf_sms.families`), checked against the pruned model (``shrink``)."""

from ..pruning.prunable import parameter_count
from .shrink import dense_shaped, shrink, shrink_record

__all__ = [
    "dense_shaped",
    "parameter_count",
    "shrink",
    "shrink_record",
]
