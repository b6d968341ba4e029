"""Streaming soups of checkpoint folders (``hf-sms merge``), without building models.

Any registered soup method that needs no validation data and keeps one mask runs here (:data:`hf_sms.registry.SOUPS`:
``uniform``, and any added one such as a TIES-style per-tensor function), with per-input weights. Memory is the
output plus about one tensor per input, not m models: inputs sharing an index combine only their stored values,
others are combined in chunks of the flattened tensor. The weighted mean goes through :mod:`hf_sms.soup.averaging`,
so the uniform soup equals :func:`hf_sms.uniform_soup` of the loaded models bit for bit. Inputs whose
architecture or masks differ are refused before anything is written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator

import torch

from ..registry import SOUPS
from ..soup.averaging import Accumulator
from ..soup.method import SoupMethod, Tensors
from .card import write_card
from .codec import decode_tensor, index_info, mask_part, restamp_index, verified
from .compressed_tensors import is_compressed_folder, load_compressed
from .constants import FORMATS, INDEX_SUFFIX, WEIGHTS_NAME
from .family_files import write_config
from .folder import atomic_folder, check_target, copy_companion_files, read_sparsity, weight_files, write_sparsity
from .integrity import weight_manifest
from .masks import eligible
from .reader import SparseCheckpoint
from .safetensors_io import WeightsWriter
from .sparse import save_sparse

CHUNK = 1 << 22  # elements per step of the dense merge: memory is the output plus a few such chunks


def streaming_methods() -> list[str]:
    """The soup methods ``hf-sms merge`` runs: those that need no validation data and keep one mask."""
    return [n for n, m in SOUPS.items() if not m.needs_validation and m.same_mask]


def _check_request(inputs, output, method, format, overwrite, weights, minimum: int = 2, base=None) -> SoupMethod:
    """Refuse a merge that cannot be right, from its arguments and paths alone; returns the soup method."""
    spec = SOUPS.get(method)
    if spec.needs_validation or not spec.same_mask:
        why = "evaluates trial soups on validation data" if spec.needs_validation else "re-prunes differing masks"
        raise ValueError(
            f"the {method!r} soup {why}: run it in Python (hf_sms.greedy_soup, hf_sms.soup.soup); hf-sms merge runs "
            f"{streaming_methods()}"
        )
    if spec.needs_base != (base is not None):
        raise ValueError(
            f"the {method!r} soup merges updates from the inputs' common start: pass --base <the pruned model they "
            "were retrained from>"
            if spec.needs_base
            else f"the {method!r} soup does not use a base; drop --base (model_stock, ties and dare use one)"
        )
    if weights is not None and (len(weights) != len(inputs) or any(not 0 < w < math.inf for w in weights)):
        raise ValueError(f"give one positive, finite weight per input ({len(inputs)}), got {weights}")
    if weights is not None and not 0 < sum(weights) < math.inf:  # 1e308 + 1e308 overflows to inf
        raise ValueError(f"the weights {weights} sum past the largest float; give relative weights such as 1 1")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if len(inputs) < minimum:
        raise ValueError("merge needs at least two checkpoint folders")
    if base is not None:
        inputs = [*inputs, base]  # the base is checked like an input: once, and not the output
    # realpath: "a", "./a/" and a symlink to a are one folder.
    real = [os.path.realpath(d) for d in inputs]
    first: dict[str, int] = {}
    for i, path in enumerate(real):
        if path in first:
            j = first[path]
            raise ValueError(
                f"input {i} ({inputs[i]}) is the same folder as input {j} ({inputs[j]}); list each checkpoint "
                "once (a folder given twice would count twice in the soup)"
            )
        first[path] = i
    out = os.path.realpath(output)
    for i, path in enumerate(real):
        if path == out:
            raise ValueError(
                f"the output {output} is input {i} ({inputs[i]}); write the soup to a new folder, e.g. "
                f"--output {os.path.join(os.path.dirname(path), 'soup')}"
            )
        if os.path.commonpath([path, out]) == out:
            raise ValueError(
                f"the output {output} contains input {i} ({inputs[i]}), which writing it would delete; "
                "choose an output folder outside the inputs"
            )
    check_target(output, "replace" if overwrite else "new", replace_hint="pass --overwrite to replace it")
    return spec


def _check_same_architecture(ckpts: list[SparseCheckpoint]) -> None:
    ref = ckpts[0]
    for i, c in enumerate(ckpts[1:], 1):
        where = f"input {i} ({c.directory}) and input 0 ({ref.directory})"
        if (c.library, c.architecture) != (ref.library, ref.architecture):
            raise ValueError(
                f"{where} are different architectures ({c.library} {c.architecture} vs {ref.library} "
                f"{ref.architecture}); only replicas of one model can be merged"
            )
        if set(c.names()) != set(ref.names()):
            diff = sorted(set(c.names()) ^ set(ref.names()))[:5]
            raise ValueError(f"{where} hold different tensors (e.g. {diff}); only replicas of one model can be merged")
        for name in ref.names():
            if c.spec(name) != ref.spec(name):
                (s1, d1), (s0, d0) = c.spec(name), ref.spec(name)
                raise ValueError(f"{where} differ in {name!r}: {tuple(s1)} {d1} vs {tuple(s0)} {d0}")


def _masks_differ(ckpts: list[SparseCheckpoint], i: int, name: str) -> ValueError:
    return ValueError(
        f"input {i} ({ckpts[i].directory}) and input 0 have different masks in {name!r}, so their average "
        "would not be sparse. Merge only replicas retrained from the same pruned model."
    )


def _base_differs(base: SparseCheckpoint, name: str) -> ValueError:
    return ValueError(
        f"the base ({base.directory}) has another mask than the inputs in {name!r}: pass the pruned model the "
        "inputs were retrained from (the phase's start), not the dense model or another phase's; its updates would "
        "count entries the inputs prune"
    )


def _check_base_mask(base: SparseCheckpoint, ref: SparseCheckpoint) -> None:
    """The base's zeros are the inputs' mask (recorded hashes where both have them, else the data), before work."""
    recorded = [(c.info or {}).get("per_tensor") or {} for c in (base, ref)]
    for name in (n for n in ref.names() if eligible(n, *ref.spec(n))):
        hashes = [r.get(name, {}).get("mask_hash") for r in recorded]
        same = hashes[0] == hashes[1] if all(hashes) else torch.equal(base.mask(name), ref.mask(name))
        if not same:
            raise _base_differs(base, name)


def _check_same_masks(ckpts: list[SparseCheckpoint]) -> None:
    ref = ckpts[0]
    recorded = [(c.info or {}).get("per_tensor") or {} for c in ckpts]
    for name in (n for n in ref.names() if eligible(n, *ref.spec(n))):
        hashes = [r.get(name, {}).get("mask_hash") for r in recorded]
        if all(hashes):  # recorded at save time; the merge pass re-checks the data itself
            for i, h in enumerate(hashes[1:], 1):
                if h != hashes[0]:
                    raise _masks_differ(ckpts, i, name)
            continue
        mask = ref.mask(name)
        for i, c in enumerate(ckpts[1:], 1):
            if not torch.equal(c.mask(name), mask):
                raise _masks_differ(ckpts, i, name)


def _same_zeros(tensors: Iterable[torch.Tensor], ckpts: list[SparseCheckpoint], name: str) -> Iterator[torch.Tensor]:
    """Pass the inputs' tensors (or chunks) through, raising as soon as one's zeros differ from input 0's."""
    mask = None
    for i, t in enumerate(tensors):
        if mask is None:
            mask = t != 0
        elif not torch.equal(t != 0, mask):
            raise _masks_differ(ckpts, i, name)
        yield t


def _mean(tensors: Iterable[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The weighted mean through the one averaging kernel, holding one input at a time (``tensors`` may be a
    generator)."""
    acc = None
    for t, w in zip(tensors, weights):
        acc = Accumulator(t) if acc is None else acc
        acc.add(t, w)
    return acc.result()


def _merge_combined(ckpts: list[SparseCheckpoint], name: str, weight: list[float], spec: SoupMethod, seen: dict):
    """A method's own ``combine`` gets whole tensors, as its contract says (a per-tensor top-k or trim would
    differ on stored values or chunks); a prunable tensor keeps the inputs' shared mask."""
    tensors = [c.read(name) for c in ckpts]
    shape, dtype = ckpts[0].spec(name)
    base = seen["base"].read(name) if seen["base"] is not None else None
    context = Tensors(name, base, seen["options"], seen["seed"])
    if not eligible(name, shape, dtype):
        return spec.combine(tensors, weight, context)
    tensors = list(_same_zeros(tensors, ckpts, name))
    if base is not None and not torch.equal(base != 0, tensors[0] != 0):  # the data, whatever the record says
        raise _base_differs(seen["base"], name)
    return spec.combine(tensors, weight, context) * (tensors[0] != 0)


def _merge_encoded(ckpts: list[SparseCheckpoint], name: str, weight: list[float]):
    """Inputs stored with the same index: combine their stored values only; ``(values, index)`` or None."""
    if not all(c.is_encoded(name) for c in ckpts):
        return None
    indexes = [c.read_raw(name + INDEX_SUFFIX) for c in ckpts]
    if any(mask_part(i) != mask_part(indexes[0]) for i in indexes[1:]):
        return None
    values = (verified(c.read_raw(name), i, name)[1] for c, i in zip(ckpts, indexes))  # corrupt inputs refused
    if index_info(indexes[0])["codec"] == "dense":  # zeros are among the values: compare them
        values = _same_zeros(values, ckpts, name)
    values = _mean(values, weight)
    return values, restamp_index(indexes[0], values)


def _merge_dense(ckpts: list[SparseCheckpoint], name: str, weight: list[float]) -> torch.Tensor:
    """Combine in chunks of the flattened tensor, checking masks on the way (dense or mixed inputs)."""
    shape, dtype = ckpts[0].spec(name)
    readers = [c.chunk_reader(name) for c in ckpts]
    out = torch.empty(math.prod(shape), dtype=dtype)
    for start in range(0, out.numel(), CHUNK):
        stop = min(start + CHUNK, out.numel())
        chunks = (read(start, stop) for read in readers)
        if eligible(name, shape, dtype):
            chunks = _same_zeros(chunks, ckpts, name)
        out[start:stop] = _mean(chunks, weight)
    return out.reshape(shape)


def _merge_tensor(ckpts, name: str, weight: list[float], spec: SoupMethod, writer: WeightsWriter, seen: dict) -> None:
    if not ckpts[0].spec(name)[1].is_floating_point:
        writer.add(name, ckpts[0].read(name))  # integer buffers (num_batches_tracked): input 0's
        return
    if spec.combine is not None:
        writer.add(name, _merge_combined(ckpts, name, weight, spec, seen))
        return
    merged = _merge_encoded(ckpts, name, weight)
    if merged is not None and 0 not in merged[0]:  # the usual case: the index is kept as it is
        writer.add_encoded(name, *merged)
        return
    # A kept weight that averaged to exactly zero drops out of the mask: re-encode the dense result.
    dense = decode_tensor(*merged, name) if merged is not None else _merge_dense(ckpts, name, weight)
    writer.add(name, dense)


def convert_checkpoint(directory: str, output: str, format: str = "dense", overwrite: bool = False) -> dict:
    """A copy of a checkpoint folder in ``format`` (``"dense"``: the family's plain format, loads without hf-sms),
    streamed tensor by tensor with its recipe, results and companion files; any family, plain torch models too.
    Returns the ``sparsity.json`` written; ``directory`` is never changed. A compressed-tensors sparse folder
    (:mod:`hf_sms.checkpoint.compressed_tensors`) becomes an hf-sms folder of its model, its mask kept."""
    if is_compressed_folder(directory):
        if os.path.isdir(output) and os.listdir(output) and not overwrite:
            raise ValueError(f"{output} exists and is not empty: pass overwrite=True (--overwrite) to replace it")
        if os.path.abspath(output) == os.path.abspath(directory):
            raise ValueError("the output folder is the input folder: give another --output")
        model = load_compressed(directory)
        with atomic_folder(output, "replace" if overwrite else "new") as tmp:
            copy_companion_files(directory, tmp)  # the tokenizer and generation config, as every convert keeps them
            save_sparse(model, tmp, format, recipe={"converted_from": "compressed-tensors"})
        return read_sparsity(output)
    return merge_checkpoints([directory], output, "uniform", format, overwrite, _copy=True)


def merge_checkpoints(
    inputs: list[str],
    output: str,
    method: str = "uniform",
    format: str = "bitmask",
    overwrite: bool = False,
    weights: list[float] | None = None,
    _copy: bool = False,
    *,
    base: str | None = None,
    options: dict | None = None,
    seed: int = 0,
) -> dict:
    """The soup of checkpoint folders by ``method``, streamed tensor by tensor; ``"uniform"`` equals
    :func:`hf_sms.uniform_soup`.

    Args:
        inputs: folders written by :func:`hf_sms.save_sparse` (either format) or a family's own saver;
            each folder once.
        output: the folder to write; must be new or empty unless ``overwrite``, and not one of the inputs.
        method: a soup method that needs no validation data (:func:`streaming_methods`); greedy needs an
            evaluation function: use :func:`hf_sms.greedy_soup`.
        format: ``"bitmask"`` or ``"dense"``, independent of the inputs' formats.
        overwrite: replace an existing non-empty ``output`` (swapped in when complete).
        weights: one positive weight per input, normalised to sum 1 (default: the method's own, e.g. 1/m).
        base: the folder of the pruned model the inputs were retrained from, for methods that merge updates
            (model_stock, ties, dare); same architecture as the inputs.
        options: the method's options (e.g. ``{"density": 0.2}`` for ties), checked against the ones it declares.
        seed: the soup's random stream (dare's drop).

    Returns:
        The ``sparsity.json`` written. Raises ``ValueError`` before writing anything if the arguments,
        architectures or masks do not allow the merge.
    """
    spec = _check_request(inputs, output, method, format, overwrite, weights, 1 if _copy else 2, base)
    seen = {"options": spec.resolve(method, options), "seed": seed, "base": None}
    ckpts = [SparseCheckpoint(d) for d in inputs]
    seen["base"] = SparseCheckpoint(base) if base is not None else None
    _check_same_architecture([*ckpts, seen["base"]] if base is not None else ckpts)
    _check_same_masks(ckpts)  # Step 1: refuse before writing anything
    if seen["base"] is not None:
        _check_base_mask(seen["base"], ckpts[0])
    ref = ckpts[0]
    if weights is None:
        weight = spec.select([0.0] * len(ckpts), None, None)
    else:
        weight = [w / sum(weights) for w in weights]
    with atomic_folder(output, "replace" if overwrite else "new") as tmp:
        # Step 2: average tensor by tensor, as hf_sms.soup.soup.average_state_dicts does (same kernel, same order)
        writer = WeightsWriter(format, spool_dir=tmp)
        for name in ref.names():
            _merge_tensor(ckpts, name, weight, spec, writer, seen)
        stats = writer.save(os.path.join(tmp, WEIGHTS_NAME))
        del writer
        for ckpt in ckpts:  # the inputs' masks as read (and kept) are the ones each records, or nothing is written
            hashed = ckpt.hashed_names(stats.per_tensor)
            if hashed is not None:
                ckpt.check_mask_hash(stats, hashed)
        # Step 3: the folder: input 0's config and processor files, the merged weights, sparsity.json
        copy_companion_files(ref.directory, tmp)
        write_config(ref.family, tmp, format)
        recipe = dict((ref.info or {}).get("recipe") or {})
        names = [os.path.basename(os.path.normpath(d)) for d in inputs]  # never a local absolute path
        if not _copy:  # a copy keeps what made the soup, and its results
            recipe.update(m=len(ckpts), merge_method=method, merged_from=names, weights=weight)
            if base is not None:
                recipe.update(merge_base=os.path.basename(os.path.normpath(base)), merge_options=seen["options"])
        info = write_sparsity(
            tmp,
            format=format,
            library=ref.library,
            architecture=ref.architecture,
            stats=stats.summary(),
            recipe=recipe,
            metrics=(ref.info or {}).get("metrics") if _copy else None,
            aliases=ref.aliases,
            files=weight_manifest(tmp, weight_files(tmp)),
        )
        write_card(tmp, os.path.basename(os.path.normpath(output)))
    return info
