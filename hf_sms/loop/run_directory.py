"""A run's output folder: its layout, what it was made from, and who may write to it.

``run.json`` holds a fingerprint of everything a finished replica depends on: every config field that
can change results (derived from the dataclass, so a new field is covered without a list to maintain),
a hash of the pretrained weights, and a hash of each data split. A rerun into the same folder resumes
only if all of it matches; anything else is refused before any work. An exclusive lock keeps a second
process (another job, not another rank of this one) out while a run is in progress.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset
from transformers.trainer_utils import has_length

from ..checkpoint.constants import LOCK_FILE, REPLICA_STATE, RUN_FILE, SPARSITY_NAME, TMP_PREFIX
from ..data import peek
from ..records.results import save_results

logger = logging.getLogger(__name__)

# Config fields that cannot change a replica's weights or the metrics: where and how a run reports.
_NOT_RESULTS = (
    "output_dir",
    "measure_speedup",  # a timing after training; it changes no model
    "resume",
    "logging_",
    "log_",
    "report_to",
    "disable_tqdm",
    "run_name",
    "push_to_hub",
    "hub_",
    "save_",
    "overwrite_output_dir",
    "project",
    "trackio_",
    "local_rank",
    "eval_",
    "skip_memory_metrics",
    "dataloader_pin_memory",
    "dataloader_persistent_workers",
    "dataloader_prefetch_factor",
)


def config_fingerprint(config) -> dict:
    """The config fields that can change results, as JSON-able values."""
    return {k: v for k, v in sorted(config.to_dict().items()) if not k.startswith(_NOT_RESULTS)}


def default_config(config):
    """A config of the same class with every field at its default (what an older run that did not record a
    newer field ran with)."""
    try:
        return type(config)(output_dir=config.output_dir, report_to="none")
    except (TypeError, ValueError):  # a subclass with required fields: every field then counts as recorded
        return config


def run_fingerprint(config, model: nn.Module, splits: dict) -> tuple[dict, dict]:
    """``(fingerprint, defaults)``: what a run's finished replicas depend on (its config, the pretrained weights,
    each data split; run.json also says in words what each data hash covers), and the config at its defaults."""
    data = {name: data_identity(d) for name, d in splits.items()}
    fingerprint = {
        "config": config_fingerprint(config),
        "model": model_hash(model),
        "data": {name: h for name, (h, _) in data.items()},
        NOT_COMPARED: {name: how for name, (_, how) in data.items()},
    }
    return fingerprint, {"config": config_fingerprint(default_config(config))}


def _update(h, value) -> None:
    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # the buffer itself: no copy
    elif isinstance(value, np.ndarray):
        _update(h, torch.from_numpy(np.ascontiguousarray(value)))
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _update(h, value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            _update(h, v)
    else:
        h.update(repr(value).encode())


def model_hash(model: nn.Module) -> str:
    """sha256 of the model's state dict (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    _update(h, model.state_dict())
    return h.hexdigest()[:16]


# Items a set of unknown make is read in full up to (a set that builds items on the fly, a stream): above it, the
# length and ``samples`` items spread over a set, the first ``ITEMS`` items of a stream, and a resume says so.
ITEMS = 4096
PARTLY = "part of it: "  # what a resume warns about


def data_hash(dataset, samples: int = 16) -> str | None:
    """The hash :func:`data_identity` gives (``None``: a stream nothing identifies)."""
    return data_identity(dataset, samples)[0]


def data_identity(dataset, samples: int = 16) -> tuple[str | None, str]:
    """``(hash, what it covers)`` of a data split, for run.json: every item where that is cheap (``datasets``'
    fingerprint, in-memory tensors and lists, the indices of a subset, any set of at most :data:`ITEMS` items), else
    the length and ``samples`` items spread over the set; a stream by its source and settings (``datasets``: builder,
    files with their sizes, shards, take/skip/shuffle) and its items, all of them up to :data:`ITEMS`. Items are read
    under fixed seeds, so augmentation inside ``__getitem__`` gives the same hash each time."""
    if dataset is None:
        return None, "none"
    if hasattr(dataset, "_fingerprint"):
        return f"datasets:{dataset._fingerprint}", "datasets' fingerprint (every row and transform)"
    if isinstance(dataset, Mapping):  # several sets, e.g. corrupted copies of a test set
        parts = {str(k): data_identity(v, samples) for k, v in dataset.items()}
        digest = hashlib.sha256(json.dumps({k: h for k, (h, _) in parts.items()}).encode()).hexdigest()[:16]
        return digest, "; ".join(sorted({how for _, how in parts.values()}))
    if not has_length(dataset):
        return _stream_hash(dataset, samples)
    h = hashlib.sha256(str(len(dataset)).encode())
    if isinstance(dataset, Subset):
        inner, how = data_identity(dataset.dataset, samples)
        _update(h, [int(i) for i in dataset.indices])
        _update(h, inner)
        return h.hexdigest()[:16], f"its {len(dataset)} indices into a set compared by {how}"
    tensors = [v for v in vars(dataset).values() if torch.is_tensor(v)] if hasattr(dataset, "__dict__") else []
    if isinstance(dataset, (list, tuple)) or any(t.shape[0] == len(dataset) for t in tensors if t.dim()):
        _update(h, list(dataset) if isinstance(dataset, (list, tuple)) else tensors)  # in memory: all of it
        _update(h, [peek(dataset, i) for i in range(min(len(dataset), samples))])  # its transform, if any
        return h.hexdigest()[:16], f"every one of its {len(dataset)} items"
    n = len(dataset)
    if n <= ITEMS:  # built on the fly, but few enough to read: every item
        for i in range(n):
            _update(h, peek(dataset, i))
        return h.hexdigest()[:16], f"every one of its {n} items"
    for i in sorted({round(k * (n - 1) / max(samples - 1, 1)) for k in range(samples)}):
        _update(h, peek(dataset, i))
    return h.hexdigest()[:16], f"{PARTLY}its length and {samples} of its {n} items, spread over it"


def _describe(iterable, depth: int = 0):
    """A ``datasets`` stream's pipeline (take/skip/shuffle/shards, each stage's settings, local files with size and
    modification time), as plain values."""
    if iterable is None or depth > 20:
        return None
    out = {"type": type(iterable).__name__}
    for k, v in sorted(vars(iterable).items()):
        if isinstance(v, (int, float, str, bool)) and not k.startswith("_"):
            out[k] = v
    kwargs = getattr(iterable, "kwargs", None)
    if isinstance(kwargs, dict):
        out["kwargs"] = repr(sorted(kwargs.items(), key=str))
        files = [f for v in kwargs.values() for f in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(f, str)]
        out["files"] = [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files if os.path.isfile(f)]
    out["inner"] = _describe(getattr(iterable, "ex_iterable", None), depth + 1)
    return out


def lock_folder(folder: str, doing: str, option: str) -> int:
    """An exclusive lock on ``folder`` (created if missing) for this process: a file descriptor to ``os.close``
    when done (the lock also goes when the process dies). Raises at once if another process holds it."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, LOCK_FILE), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"another hf-sms process is {doing} in {folder}; wait for it to finish or use another {option}"
        ) from None
    return fd


def _stream_hash(dataset, samples: int) -> tuple[str | None, str]:
    """A stream (``IterableDataset``): what ``datasets`` says of it and its pipeline, plus its items up to
    :data:`ITEMS`, read under fixed seeds; ``None`` if nothing identifies it (it cannot be read twice, or gives
    nothing)."""
    h = hashlib.sha256(b"stream")
    info, source = getattr(dataset, "info", None), ""
    if info is not None:  # a datasets.IterableDataset: its builder, config, split and files
        _update(h, [repr(getattr(info, k, None)) for k in ("builder_name", "config_name", "version", "splits")])
        _update(h, json.dumps(_describe(getattr(dataset, "_ex_iterable", None)), default=repr))
        _update(h, repr(getattr(dataset, "n_shards", None)))
        source = "its source (builder, files with size and time), shards, take/skip/shuffle settings and "
    n = 0
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for item in dataset:
                _update(h, item)
                n += 1
                if n == ITEMS:
                    break
    except Exception:  # noqa: BLE001  (any failure to re-read means: not identifiable)
        return None, "nothing (a stream that cannot be read again)"
    if not n:
        return None, "nothing (a stream that gives no item)"
    how = f"{PARTLY}{source}its first {n} items" if n == ITEMS else f"{source}all its {n} items"
    return "stream:" + h.hexdigest()[:16], how


class RunDirectory:
    """Owns ``root``: the layout of a run, its fingerprint check and its lock.

    Args:
        root: the run's output directory.
        fingerprint: what the run's results depend on (see :func:`config_fingerprint`, :func:`model_hash`,
            :func:`data_hash`).
        is_main: this process writes run-level files and holds the lock (rank 0 of a launch).
    """

    def __init__(
        self, root: str, fingerprint: dict, is_main: bool = True, defaults: dict | None = None, force: bool = False
    ):
        self.root, self.is_main, self._lock, self.force = root, is_main, None, force
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as run.json will read back (tuples -> lists)
        self.defaults = json.loads(json.dumps(defaults or {}))

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def open(self) -> None:
        """Take the lock, then check that ``root`` is empty or holds this very run; write ``run.json``."""
        if not self.is_main:
            return
        self._lock = lock_folder(self.root, "running", "--output_dir")
        try:
            self._check_or_write()
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the lock (also when the process dies)
            self._lock = None

    def _check_or_write(self) -> None:
        run_file = self.path(RUN_FILE)
        if os.path.isfile(run_file):
            try:
                with open(run_file) as f:
                    old = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{run_file} is corrupt ({e}); delete it or choose another --output_dir") from e
            unknown = [name for name, h in (self.fingerprint.get("data") or {}).items() if h is None]
            if unknown and self.force:  # vouched for: the stream is the one the run recorded
                for name in unknown:
                    self.fingerprint["data"][name] = (old.get("data") or {}).get(name)
                unknown = []
            changed = _changed(old, self.fingerprint, self.defaults)
            if unknown and not self.force and not self._trained_nothing():
                raise ValueError(
                    f"{self.root} holds a run, but the {unknown} data is a stream hf-sms cannot identify, so it cannot "
                    "tell whether the finished replicas were trained on this data: pass resume='force' (--resume "
                    "force) if it is the same data, or use a fresh --output_dir"
                )
            if changed:
                raise ValueError(
                    f"{self.root} holds a run made from something else (changed: {changed}); use a fresh "
                    "--output_dir, or delete the old run to start over"
                )
            elif old != self.fingerprint:  # only fields added since, at their defaults (the old behaviour)
                save_results(self.fingerprint, run_file)
            partly = {
                name: how
                for name, how in (self.fingerprint.get(NOT_COMPARED) or {}).items()
                if str(how).startswith(PARTLY)
            }
            for name, how in partly.items():
                logger.warning(
                    "[hf-sms] resuming %s: its %s data was compared with the run's by %s; a change elsewhere in it "
                    "goes unseen (use a fresh --output_dir if the data changed)",
                    self.root,
                    name,
                    how.removeprefix(PARTLY),
                )
            self._remove_stale_temporaries()
            return
        if any(e.name != LOCK_FILE for e in os.scandir(self.root)):
            raise ValueError(f"{self.root} is not empty and holds no hf-sms {RUN_FILE}; use a fresh --output_dir")
        save_results(self.fingerprint, run_file)

    def _trained_nothing(self) -> bool:
        """No replica finished (no checkpoint's ``sparsity.json`` anywhere): nothing a rerun could reuse."""
        return not any(SPARSITY_NAME in files or REPLICA_STATE in files for _, _, files in os.walk(self.root))

    def _remove_stale_temporaries(self) -> None:
        """Folders and files a killed run was writing (never installed, so never taken as finished); safe under the
        lock. Both prefixes start ``.hf_sms-``."""
        for parent, dirs, files in os.walk(self.root):
            for name in [d for d in dirs if d.startswith(TMP_PREFIX)]:
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                dirs.remove(name)
            for name in [f for f in files if f.startswith(TMP_PREFIX)]:
                os.remove(os.path.join(parent, name))


_ABSENT = object()
NOT_COMPARED = "data_compared"  # run.json's plain words on what each data hash covers, never compared


def _changed(old: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """What differs between two fingerprints, by name. A config field the old run did not record (a newer
    hf-sms added it) counts as changed only if its new value is not its default (the default keeps the old
    behaviour); a field the old run recorded that no longer exists is ignored."""
    defaults = (defaults or {}).get("config", {})
    out = []
    for section in sorted((set(old) | set(new)) - {NOT_COMPARED}):
        a, b = old.get(section), new.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                before, after = a.get(k, _ABSENT), b.get(k, _ABSENT)
                if before is _ABSENT:
                    before = defaults.get(k, _ABSENT) if section == "config" else _ABSENT
                if after is not _ABSENT and before != after:
                    out.append(f"{section}.{k}")
        elif a != b:
            out.append(section)
    return out
