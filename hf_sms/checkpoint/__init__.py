"""Sparse checkpoints: small on disk, loadable with each model family's own loader.

A checkpoint is the folder the family writes (``config.json``, tokenizer/processor files, timm's
``config.json`` with ``pretrained_cfg``, smp's hub-mixin ``config.json``) plus ``sparsity.json``
(sparsity, mask hash, soup recipe, metrics). Weights live in ``model.safetensors``:

- ``format="dense"``: the family's own file, untouched; loads without hf-sms.
- ``format="bitmask"``: every eligible weight ``W`` (:func:`~hf_sms.checkpoint.masks.eligible`) is stored as
  its nonzero values under ``W`` and an index ``W.sp_index`` (:mod:`~hf_sms.checkpoint.codec`). With
  ``hf_sms`` imported, ``AutoModel*.from_pretrained(dir)`` decodes it
  (:mod:`~hf_sms.checkpoint.transformers_integration`); :func:`load_sparse` loads every family. A loader
  that does not know the format fails loudly on the shape mismatch instead of loading random weights.

Pruned weights are exact zeros and load as ``+0.0``. Only safetensors and JSON are ever read.

Modules: ``constants`` (file names, versions), ``codec`` (one tensor <-> values and index), ``masks``
(eligibility, sparsity statistics), ``safetensors_io`` (reading and writing weight files), ``folder``
(atomic folders, ``sparsity.json``), ``family_files`` (what the format adds to a family's folder: hf-sms's
``quantization_config``, loading lines; the families themselves: :mod:`hf_sms.families`),
``reader`` (:class:`SparseCheckpoint`), ``sparse`` (save/load), ``merge``,
``inspect``, ``transformers_integration`` and ``prefetch``.
"""

from ..lazy import lazy_exports
from .constants import FORMAT_VERSION, FORMATS, INDEX_SUFFIX, SPARSITY_NAME, WEIGHTS_NAME

_EXPORTS = {
    "inspect_checkpoint": ".inspect",
    "eligible": ".masks",
    "merge_checkpoints": ".merge",
    "streaming_methods": ".merge",
    "SparseCheckpoint": ".reader",
    "load_sparse": ".sparse",
    "save_sparse": ".sparse",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["FORMATS", "FORMAT_VERSION", "INDEX_SUFFIX", "SPARSITY_NAME", "WEIGHTS_NAME", *sorted(_EXPORTS)]
