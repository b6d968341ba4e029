"""File names hf-sms writes (checkpoints, run folders, trainer checkpoints) and the format version, in one place."""

from __future__ import annotations

import re

from ..families.base import CONFIG_NAME, WEIGHTS_NAME  # noqa: F401  (the libraries' own file names, named here too)

INDEX_NAME = "model.safetensors.index.json"  # a sharded family save; hf-sms itself writes one file
SPARSITY_NAME = "sparsity.json"
CARD_NAME = "README.md"
INDEX_SUFFIX = ".sp_index"  # "W.sp_index" holds the positions of the values stored under "W"
TMP_PREFIX = ".hf_sms-"  # temporary folders next to the target; hidden, and skipped by Hub uploads

FORMATS = ("bitmask", "dense")
# One version for everything on disk: the index header, sparsity.json, the quantization_config and the
# safetensors metadata. Readers refuse a newer version instead of misreading it.
# 2: sparsity.json always records its file manifest ("files"); a version-2 folder without one is refused.
FORMAT_VERSION = 2
MANIFEST_SINCE = 2
# Also the text of transformers' warning when hf_sms is not imported ("Unknown quantization type, got ..."), so it
# says how to load the folder; folders written before carry the short name, still registered.
# transformers without hf_sms prints this in its "Unknown quantization type" warning, then fails on the encoded
# tensors' sizes: the name says what to do, and that its advice (ignore_mismatched_sizes) gives random weights
QUANT_METHOD = (
    "hf-sms-sparse, loaded after `import hf_sms` (pip install hf-sms); "
    "never with ignore_mismatched_sizes=True (random weights)"
)
QUANT_METHODS = (QUANT_METHOD, "hf-sms-sparse, loaded after `import hf_sms` (pip install hf-sms)", "hf-sms-sparse")

TIMM_WIDTHS = "pruned.txt"  # a smaller timm model's widths, in timm's adapt_model_from_string form
PROGRAM = "model.pt2"  # a smaller model's torch.export program (hf_sms.checkpoint.plain)

# Files a save replaces in an existing folder, and a merge does not copy from its first input.
_WEIGHT_FILES = (WEIGHTS_NAME, INDEX_NAME, "pytorch_model.bin", SPARSITY_NAME, TIMM_WIDTHS, PROGRAM)
STALE_FILES = re.compile(r"^(" + "|".join(map(re.escape, _WEIGHT_FILES)) + r"|model-\d+-of-\d+\.safetensors)$")

# Files a checkpoint publishes (Hub upload, a merge's companion copy): weights, configs, tokenizer and processor
# files, sparsity.json, the card. Everything else stays: training_args.bin (a pickle holding the Hub token),
# optimizer/scheduler/RNG state, trainer logs.
_PUBLISHED = (
    r"(?!sparse_masks\.|replica\.)[^/]+\.safetensors",  # a trainer's mask file, a replica's state: not the model's
    r"model\.safetensors\.index\.json",
    r"(generation_)?config\.json",
    r"(pre)?processor_config\.json|image_processor(_config)?\.json|video_preprocessor_config\.json",
    r"(tokenizer|tokenizer_config|special_tokens_map|added_tokens|chat_template)\.(json|jinja)",
    r"(vocab\.(json|txt)|merges\.txt|[^/]*\.model|spiece\.model|sentencepiece\.bpe\.model)",
    re.escape(SPARSITY_NAME),
    re.escape(CARD_NAME),
    re.escape(TIMM_WIDTHS),
    re.escape(PROGRAM),
)
PUBLISHED_FILES = re.compile(r"^(" + "|".join(_PUBLISHED) + r")$")

# A run folder (hf_sms.loop.run_directory) and a SparseSoupTrainer checkpoint.
RUN_FILE, LOCK_FILE, RESULTS_FILE, FINAL_SOUP = "run.json", ".hf-sms.lock", "results.json", "final_soup"
MASKS_NAME = "sparse_masks.safetensors"
REPLICA_STATE = "replica.safetensors"  # a subset replica's trained tensors (hf_sms.adapters): its folder's only file
