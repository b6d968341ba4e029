"""``save_sparse`` and ``load_sparse``: sparse checkpoints in the folder layout each family's loader knows."""

from __future__ import annotations

import dataclasses
import os

from accelerate import init_empty_weights
from torch import nn

from ..atomic import atomic_path
from ..families import family_of
from ..families.state import load_into
from ..pruning.prunable import prunable_tensors
from ..pruning.selection import ModuleSelection
from ..runtime.convert import to_sparse_runtime
from ..shrinking.cut import resize_to
from ..shrinking.fit import cut_unstated
from .card import write_card
from .codec import crc32
from .compressed_tensors import is_compressed_folder, load_compressed
from .constants import CARD_NAME, FORMATS, INDEX_NAME, WEIGHTS_NAME
from .family_files import write_config
from .folder import atomic_folder, weight_files, write_sparsity
from .integrity import weight_manifest
from .masks import MaskStats, eligible
from .plain import write_plain_route
from .reader import SparseCheckpoint, check_masks
from .runtime_load import load_runtime
from .safetensors_io import SafetensorsFile, WeightsWriter
from .shrink_record import IN_PLACE, SMALLER, ShrinkRecord


def _store_weights(folder: str, fmt: str) -> tuple[MaskStats, dict[str, int]]:
    """Turn the family's dense weight files in ``folder`` into ``fmt``; returns their mask statistics and the
    checksums ``sparsity.json`` records.

    The dense format keeps the family's files untouched (they load without hf-sms), so the CRC-32 of every tensor
    goes to ``sparsity.json``; the bitmask format re-encodes every tensor into one ``model.safetensors``, whose
    header and indexes hold them.
    """
    files = [SafetensorsFile(p) for p in weight_files(folder)]
    tensors = ((k, f.read(k)) for f in files for k in f.keys())
    if fmt == "dense":
        stats, crcs = MaskStats(), {}
        for name, t in tensors:
            crcs[name] = crc32(t)
            if eligible(name, t.shape, t.dtype):
                stats.add(name, t != 0, "dense")
        return stats, crcs
    writer = WeightsWriter(fmt, spool_dir=folder)  # spooled beside the file: one tensor in memory at a time
    for name, t in tensors:
        writer.add(name, t)
    with atomic_path(os.path.join(folder, WEIGHTS_NAME)) as new_path:
        stats = writer.save(new_path)
        for f in files:
            os.remove(f.path)
        if os.path.exists(os.path.join(folder, INDEX_NAME)):
            os.remove(os.path.join(folder, INDEX_NAME))
    return stats, {}


def save_sparse(
    model: nn.Module,
    directory: str,
    format: str | None = None,
    *,
    recipe: dict | None = None,
    metrics: dict | None = None,
    processing_class=None,
    example_inputs=None,
) -> str:
    """Save ``model`` as a checkpoint folder its family's loader knows, plus ``sparsity.json``.

    Args:
        model: a transformers, timm, segmentation_models_pytorch or plain torch model (plain models
            load back with ``load_sparse(directory, model=template)``).
        directory: the folder; created if missing. Weight files and ``sparsity.json`` already there are
            replaced, other files are kept. Everything is written to a temporary folder first, so an
            error leaves existing files intact.
        format: ``"bitmask"`` (small; loads with ``from_pretrained`` once ``hf_sms`` is imported, and with
            :func:`load_sparse`) or ``"dense"`` (plain family format, loads without hf-sms). Default: bitmask
            where at least :data:`COMPRESS_FROM` of the prunable weights are zero, else dense (a smaller model
            from :func:`hf_sms.shrink`, a dense one: nothing to compress), which its library, or its plain
            route, loads without hf-sms.
        recipe: the soup recipe, e.g. ``{"phases": [...], "m": 3, "varied": "seed", "merge_method": "uniform"}``.
        metrics: e.g. ``{"accuracy": 0.91}``.
        processing_class: a tokenizer / image processor to save alongside.
        example_inputs: a batch the model takes. Only a smaller model cut in place (:func:`hf_sms.shrink` where
            its library's config cannot state the widths) uses it: the plain route that loads it without hf-sms is
            checked on it (timm's ``pruned.txt``, else a ``torch.export`` program ``model.pt2``:
            :mod:`hf_sms.checkpoint.plain`). Default: a batch its family makes (transformers, timm, smp).

    Returns:
        ``directory``.
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    family = family_of(model)
    shrunk = ShrinkRecord.of({"recipe": recipe})
    if shrunk is None and family.library != "torch" and cut_unstated(model):  # a cut in place, unrecorded
        shrunk = ShrinkRecord(SMALLER, cut=IN_PLACE)
    if format is None:  # no zeros to compress (a smaller model, a dense one): the family's own folder
        format = "bitmask" if _zero_fraction(model) >= COMPRESS_FROM else "dense"
    pruned = _pruned_names(model, recipe)
    with atomic_folder(directory, "update") as tmp:
        architecture, aliases = family.save(model, tmp)
        if processing_class is not None:
            processing_class.save_pretrained(tmp)
        stats, checksums = _store_weights(tmp, format)
        write_config(family, tmp, format)
        if shrunk is not None and shrunk.cut_in_place:  # a route to load it without hf-sms, where one works
            example = example_inputs if example_inputs is not None else family.example(model)
            route = write_plain_route(model, tmp, family.library, format, example)
            recipe = {**(recipe or {}), "shrunk": dataclasses.replace(shrunk, **route).to_json()}
        write_sparsity(
            tmp,
            format=format,
            library=family.library,
            architecture=architecture,
            stats=stats.summary([n for n in stats.per_tensor if n in pruned] if pruned else None),
            recipe=recipe,
            metrics=metrics,
            aliases=aliases,
            checksums=checksums,
            files=weight_manifest(tmp, weight_files(tmp)),
        )
        write_card(tmp, os.path.basename(os.path.abspath(directory)), os.path.join(directory, CARD_NAME))
    return directory


COMPRESS_FROM = 0.05
"""The fraction of zero prunable weights from which ``save_sparse`` stores the bitmask format by default."""


def _zero_fraction(model: nn.Module) -> float:
    tensors = prunable_tensors(model)
    zeros = sum(t.param.numel() - int(t.param.count_nonzero()) for t in tensors)
    return zeros / max(sum(t.param.numel() for t in tensors), 1)


def _pruned_names(model: nn.Module, recipe: dict | None) -> set[str] | None:
    """The weights the run's selection prunes (``prune_modules`` / ``skip_modules`` in ``recipe``; a causal LM's
    decoder linears by default), where they are not every prunable weight: ``sparsity.json``'s figures and mask
    hash cover those, as the run's rows do (a 50% LLaMA is 50% of its decoder linears, its embeddings dense)."""
    recipe = recipe or {}
    try:
        chosen = ModuleSelection.of(recipe.get("prune_modules"), recipe.get("skip_modules")).tensors(model)
    except ValueError:  # a recipe written for another model: every eligible weight, as before
        return None
    every = prunable_tensors(model)
    return {t.name for t in chosen} if len(chosen) < len(every) else None


def load_sparse(
    directory: str,
    model: nn.Module | None = None,
    *,
    verify: bool = True,
    runtime: str | None = None,
    sample_input=None,
    min_sparsity: float = 0.5,
    mmap: bool = False,
    **kwargs,
) -> nn.Module:
    """Load a checkpoint folder written by :func:`save_sparse` (either format) or by a family's own saver.

    Args:
        directory: the folder.
        model: a template to load into (required for plain torch models); loaded strictly, in place.
        verify: check the loaded masks against the hash in ``sparsity.json``.
        runtime: ``None``: an ordinary dense model. ``"csr"`` / ``"auto"``: straight into the sparse inference
            runtime (:func:`hf_sms.to_sparse_runtime`): every pruned layer is built from the stored positions and
            values, never as a dense tensor; ``"auto"`` then times each one dense vs sparse on ``sample_input``
            (one layer densified at a time) and keeps the faster. Inference only.
        sample_input, min_sparsity: as in :func:`hf_sms.to_sparse_runtime`.
        mmap: with ``runtime``, the sparse layers' values stay mapped from the file instead of copied (no read, no
            copy). Only for files nobody rewrites: the model's values then follow the file, and truncating it kills
            the process (SIGBUS) when a layer runs.
        **kwargs: passed to the family's constructor (``from_pretrained`` for transformers,
            ``timm.create_model`` for timm, the model class for smp).

    Returns:
        The model, in eval mode. Raises ``ValueError`` if a tensor is missing, unexpected, misshapen or corrupted.
    """
    if kwargs.get("trust_remote_code"):
        raise ValueError(
            "load_sparse never runs code from a checkpoint folder (trust_remote_code=True): after `import hf_sms`, "
            "load it with transformers yourself (AutoModel.from_pretrained(dir, trust_remote_code=True)) if you trust "
            "it, or pass model=<template> of its architecture"
        )
    if mmap and runtime is None:
        raise ValueError("mmap=True maps the values of a runtime load (runtime='csr' or 'auto'); a dense load copies")
    if is_compressed_folder(directory):  # llm-compressor's sparse-bitmask / sparse-24-bitmask: decompressed exactly
        loaded = load_compressed(directory, model, **kwargs)
        return to_sparse_runtime(loaded, runtime, sample_input, min_sparsity=min_sparsity) if runtime else loaded
    ckpt = SparseCheckpoint(directory)
    if runtime is not None:
        return load_runtime(ckpt, model, runtime, sample_input, min_sparsity, verify, mmap, **kwargs)
    if ckpt.cut_in_place:  # a smaller model its config cannot state: the model it was cut from, cut the same way
        if model is None:
            model = ckpt.family.instantiate(ckpt, **kwargs)
            ckpt.family.tie_weights(model)
        resize_to(model, {name: ckpt.spec(name)[0] for name in ckpt.names()})
    if model is None:  # the shapes of the model the family builds, without its weights
        with init_empty_weights(include_buffers=False):
            ckpt.check_claims(ckpt.family.instantiate(ckpt, **kwargs))
    else:
        ckpt.check_claims(model)  # before anything is decoded
    state_dict = ckpt.state_dict()
    if verify:
        check_masks(ckpt, state_dict)
    if model is not None:
        return load_into(model, state_dict, ckpt.aliases).eval()
    return ckpt.family.load(ckpt, state_dict, **kwargs).eval()
