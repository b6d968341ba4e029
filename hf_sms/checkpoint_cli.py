"""``hf-sms merge`` and ``hf-sms inspect``: work on checkpoint folders without building models.

``merge`` streams tensor by tensor (memory: the output plus about one tensor per input, not m models),
refuses inputs whose architecture or masks differ before writing anything, and writes atomically.
Greedy soups need an evaluation function, so they are Python API (:func:`hf_sms.greedy_soup`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from .sparse_format import (
    FORMATS,
    INDEX_SUFFIX,
    SPARSITY_NAME,
    STALE_FILES,
    WEIGHTS_NAME,
    MaskStats,
    SparseCheckpoint,
    _encode,
    decode_tensor,
    eligible,
    index_info,
    index_mask,
    install_folder,
    mask_part,
    new_tmpdir,
    patch_config,
    restamp_index,
    write_json,
)

STREAMING_METHODS = ("uniform",)


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


def _check_same_masks(ckpts: list[SparseCheckpoint]) -> None:
    ref = ckpts[0]
    names = [n for n in ref.names() if eligible(n, *ref.spec(n))]
    recorded = [(c.info or {}).get("per_tensor") or {} for c in ckpts]

    def fail(i: int, name: str):
        raise ValueError(
            f"input {i} ({ckpts[i].directory}) and input 0 have different masks in {name!r}, so their average "
            "would not be sparse. Merge only replicas retrained from the same pruned model."
        )

    for name in names:
        hashes = [r.get(name, {}).get("mask_hash") for r in recorded]
        if all(hashes):  # recorded at save time; the merge pass re-checks the data itself
            for i, h in enumerate(hashes[1:], 1):
                if h != hashes[0]:
                    fail(i, name)
            continue
        mask = ref.mask(name)
        for i, c in enumerate(ckpts[1:], 1):
            if not torch.equal(c.mask(name), mask):
                fail(i, name)


CHUNK = 1 << 22  # elements per step of the dense merge: memory is the output plus a few such chunks


def _merge_encoded(ckpts: list[SparseCheckpoint], name: str, dtype: torch.dtype, w: float):
    """Inputs stored with the same index: average their stored values only; ``(values, index)`` or None."""
    if not all(c.is_encoded(name) for c in ckpts):
        return None
    indexes = [c.read_raw(name + INDEX_SUFFIX) for c in ckpts]
    if any(mask_part(i) != mask_part(indexes[0]) for i in indexes[1:]):
        return None
    all_stored = index_info(indexes[0])["codec"] == "dense"  # zeros are among the values: compare them
    acc, mask = None, None
    for i, c in enumerate(ckpts):
        values = c.read_raw(name)
        if all_stored:
            mask = values != 0 if mask is None else mask
            if not torch.equal(values != 0, mask):
                raise ValueError(f"input {i} ({c.directory}) and input 0 have different masks in {name!r}")
        acc = torch.zeros(values.shape, dtype=torch.float64) if acc is None else acc
        acc.add_(values.to(torch.float64), alpha=w)
    values = acc.to(dtype)
    return values, restamp_index(indexes[0], values)


def _merge_dense(ckpts: list[SparseCheckpoint], name: str, shape, dtype: torch.dtype, w: float) -> torch.Tensor:
    """Average in chunks of the flattened tensor, checking masks on the way (dense or mixed inputs)."""
    readers = [c.chunk_reader(name) for c in ckpts]
    check = eligible(name, shape, dtype)
    out = torch.empty(torch.Size(shape).numel(), dtype=dtype)
    for start in range(0, out.numel(), CHUNK):
        stop = min(start + CHUNK, out.numel())
        acc, mask = torch.zeros(stop - start, dtype=torch.float64), None
        for i, read in enumerate(readers):
            chunk = read(start, stop)
            if check:
                if mask is None:
                    mask = chunk != 0
                elif not torch.equal(chunk != 0, mask):
                    raise ValueError(f"input {i} ({ckpts[i].directory}) and input 0 have different masks in {name!r}")
            acc.add_(chunk.to(torch.float64), alpha=w)
        out[start:stop] = acc.to(dtype)
    return out.reshape(shape)


def merge_checkpoints(
    inputs: list[str], output: str, method: str = "uniform", format: str = "bitmask", overwrite: bool = False
) -> dict:
    """Uniform soup of checkpoint folders, streamed tensor by tensor; equals :func:`hf_sms.uniform_soup`.

    Args:
        inputs: folders written by :func:`hf_sms.save_sparse` (either format) or a family's own saver.
        output: the folder to write; must be new or empty unless ``overwrite``.
        method: ``"uniform"`` (greedy needs an evaluation function: use :func:`hf_sms.greedy_soup`).
        format: ``"bitmask"`` or ``"dense"``, independent of the inputs' formats.
        overwrite: replace an existing non-empty ``output`` (swapped in when complete).

    Returns:
        The ``sparsity.json`` written.
    """
    if method not in STREAMING_METHODS:
        hint = (
            " GreedySoup needs an evaluation function: use hf_sms.greedy_soup in Python." if method == "greedy" else ""
        )
        raise ValueError(f"unknown streaming merge method {method!r}; choose one of {STREAMING_METHODS}.{hint}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if len(inputs) < 2:
        raise ValueError("merge needs at least two checkpoint folders")
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise ValueError(f"{output} exists and is not empty; pass --overwrite to replace it")
    ckpts = [SparseCheckpoint(d) for d in inputs]
    _check_same_architecture(ckpts)
    _check_same_masks(ckpts)  # Step 1: refuse before writing anything
    ref, w = ckpts[0], 1.0 / len(ckpts)
    tmp = new_tmpdir(output)
    try:
        # Step 2: average tensor by tensor, exactly as merge.average_state_dicts does (float64, same order)
        out, stats = {}, MaskStats()
        for name in ref.names():
            shape, dtype = ref.spec(name)
            if not dtype.is_floating_point:
                out[name] = ref.read(name)  # integer buffers (num_batches_tracked) from the first input
                continue
            merged = _merge_encoded(ckpts, name, dtype, w)
            if merged is not None and 0 not in merged[0]:  # the usual case: the index is kept as it is
                values, index = merged
                if eligible(name, shape, dtype):
                    mask = index_mask(index, name)
                    stats.add(name, values.numpy() != 0 if mask is None else mask, index_info(index)["codec"], shape)
                if format == "bitmask":
                    out[name], out[name + INDEX_SUFFIX] = values, index
                else:
                    out[name] = decode_tensor(values, index, name)
                continue
            dense = decode_tensor(*merged, name) if merged is not None else _merge_dense(ckpts, name, shape, dtype, w)
            if eligible(name, shape, dtype):
                keep, codec = (dense.reshape(-1) != 0).numpy(), "dense"
                if format == "bitmask":
                    out[name], out[name + INDEX_SUFFIX] = _encode(dense.reshape(-1), keep, tuple(shape))
                    codec = index_info(out[name + INDEX_SUFFIX])["codec"]
                stats.add(name, keep, codec, shape)
            if name not in out:
                out[name] = dense
        # Step 3: the folder: input 0's config and tokenizer files, the merged weights, sparsity.json
        from safetensors.torch import save_file

        save_file(out, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt", "hf_sms": f"{format}-v1"})
        del out
        for fname in os.listdir(ref.directory):
            src = os.path.join(ref.directory, fname)
            if (
                os.path.isfile(src)
                and not STALE_FILES.match(fname)
                and fname != "README.md"
                and not fname.startswith(".")
            ):
                shutil.copy2(src, os.path.join(tmp, fname))
        patch_config(tmp, ref.library, format)
        recipe = dict((ref.info or {}).get("recipe") or {})
        recipe.update({"m": len(ckpts), "merge_method": method, "merged_from": [os.path.abspath(d) for d in inputs]})
        info = {
            "hf_sms_format_version": 1,
            "format": format,
            "library": ref.library,
            "architecture": ref.architecture,
            **stats.summary(),
            "recipe": recipe,
            "metrics": None,
        }
        if (ref.info or {}).get("aliases"):
            info["aliases"] = ref.info["aliases"]
        write_json(os.path.join(tmp, SPARSITY_NAME), info)
        install_folder(tmp, output, replace=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def inspect_checkpoint(directory: str) -> dict:
    """Format, size on disk, global and per-layer sparsity, recipe and metrics of a checkpoint folder."""
    ckpt = SparseCheckpoint(directory)
    info = ckpt.info or {}
    per_tensor = info.get("per_tensor")
    if per_tensor is None:  # a folder without sparsity.json: measure
        stats = MaskStats()
        for name in ckpt.names():
            if eligible(name, *ckpt.spec(name)):
                stats.add(name, ckpt.mask(name), "dense")
        info = {**info, **stats.summary()}
        per_tensor = info["per_tensor"]
    dense_bytes = 0
    for name in ckpt.names():
        shape, dtype = ckpt.spec(name)
        dense_bytes += torch.Size(shape).numel() * dtype.itemsize
    weights_bytes = sum(os.path.getsize(f.path) for f in ckpt.files)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return {
        "directory": os.path.abspath(directory),
        "format": ckpt.format,
        "library": ckpt.library,
        "architecture": ckpt.architecture,
        "size_on_disk": size,
        "weights_bytes": weights_bytes,
        "dense_weights_bytes": dense_bytes,
        "sparsity": info.get("sparsity"),
        "nnz": info.get("nnz"),
        "numel": info.get("numel"),
        "mask_hash": info.get("mask_hash"),
        "recipe": info.get("recipe"),
        "metrics": info.get("metrics"),
        "per_tensor": per_tensor,
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def format_report(report: dict) -> str:
    ratio = report["dense_weights_bytes"] / max(report["weights_bytes"], 1)
    lines = [
        f"directory:    {report['directory']}",
        f"model:        {report['library']} {report['architecture']}",
        f"format:       {report['format']}",
        f"size on disk: {_mb(report['size_on_disk'])} (weights {_mb(report['weights_bytes'])}, dense equivalent "
        f"{_mb(report['dense_weights_bytes'])}: {ratio:.1f}x compression)",
        f"sparsity:     {100 * (report['sparsity'] or 0):.2f}% of {report['numel'] or 0:,} prunable weights "
        f"({report['nnz'] or 0:,} kept), mask {report['mask_hash']}",
    ]
    for key in ("recipe", "metrics"):
        if report.get(key):
            lines.append(f"{key + ':':<13} {json.dumps(report[key])}")
    rows = report["per_tensor"]
    if rows:
        width = max(len(n) for n in rows)
        lines.append(f"\n{'tensor':<{width}}  {'shape':<20} {'sparsity':>9}  codec")
        for name, t in rows.items():
            shape = "x".join(map(str, t["shape"]))
            lines.append(f"{name:<{width}}  {shape:<20} {100 * t['sparsity']:>8.2f}%  {t['codec']}")
    return "\n".join(lines)


def _run_merge(args: argparse.Namespace) -> int:
    info = merge_checkpoints(args.inputs, args.output, args.method, args.format, args.overwrite)
    print(f"merged {len(args.inputs)} checkpoints into {args.output} ({args.format}, sparsity {info['sparsity']:.4f})")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.directory)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _guarded(run):
    def func(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ValueError as e:
            print(f"hf-sms {args.command}: error: {e}", file=sys.stderr)
            return 2

    return func


def add_parsers(subparsers) -> None:
    """Add the ``merge`` and ``inspect`` subcommands to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "merge",
        help="average checkpoint folders into a soup, streaming tensor by tensor",
        description="Uniform soup of checkpoints retrained under the same mask (e.g. hf-sms merge r1 r2 r3 "
        "--output soup). Greedy soups need an evaluation function: use hf_sms.greedy_soup in Python.",
    )
    p.add_argument("inputs", nargs="+", metavar="DIR", help="checkpoint folders (save_sparse or save_pretrained)")
    p.add_argument("--method", default="uniform", choices=STREAMING_METHODS, help="merge method (default: uniform)")
    p.add_argument("--output", "-o", required=True, metavar="DIR", help="folder to write")
    p.add_argument("--format", default="bitmask", choices=FORMATS, help="output format (default: bitmask)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.set_defaults(func=_guarded(_run_merge))

    q = subparsers.add_parser("inspect", help="format, size, sparsity and recipe of a checkpoint folder")
    q.add_argument("directory", metavar="DIR")
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.set_defaults(func=_guarded(_run_inspect))
