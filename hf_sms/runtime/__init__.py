"""A sparse inference runtime: pruned layers computed with sparse kernels, decided per layer by measurement."""

from .convert import LAYOUTS, to_sparse_runtime
from .layers import SemiStructuredLinear, SparseConv2d, SparseEmbedding, SparseLinear, weight_bytes
from .report import LayerChoice, RuntimeReport
from .speed import measure_speedup
from .timing import time_pair

__all__ = [
    "LAYOUTS",
    "LayerChoice",
    "RuntimeReport",
    "SemiStructuredLinear",
    "SparseConv2d",
    "SparseEmbedding",
    "SparseLinear",
    "measure_speedup",
    "time_pair",
    "to_sparse_runtime",
    "weight_bytes",
]
