"""Load a checkpoint straight into the sparse runtime: pruned layers are built from the stored positions and
values, never as dense tensors, so a soup loads in about the memory and time its nonzeros take.

The model is built with its parameters on the meta device (accelerate's ``init_empty_weights``; buffers are
made normally, so the ones a checkpoint does not hold, e.g. rotary frequencies, are right), then every
prunable layer that qualifies becomes a :mod:`hf_sms.runtime` layer from its CSR positions, and every other
tensor is read dense. Tensors the model ties together (T5's embedding and ``lm_head``) stay tied.
"""

from __future__ import annotations

import math
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from accelerate import init_empty_weights
from torch import nn

from ..pruning.prunable import is_conv1d
from ..runtime import RuntimeReport
from ..runtime.convert import MARGIN, REPEATS, Swap, _candidates, _set, check_request, finish, plan
from ..runtime.csr import CSRBuilder, csr_from_positions
from ..runtime.layers import SparseConv2d, SparseEmbedding, SparseLinear
from .codec import DENSE, position_chunks, verified
from .masks import MaskDigest, MaskStats, eligible
from .reader import SparseCheckpoint, check_masks
from .safetensors_io import workers


def _tensor_keys(model: nn.Module, ckpt: SparseCheckpoint) -> dict[str, str]:
    """``{model tensor name: checkpoint key}``, tied names sharing their group's stored key."""
    stored = set(ckpt.names())
    aliases = ckpt.aliases or {}
    groups: dict[int, list[str]] = defaultdict(list)
    for name, t in model.named_parameters(remove_duplicate=False):
        groups[id(t)].append(name)
    for name, t in model.named_buffers(remove_duplicate=False):
        if name in model.state_dict():  # persistent buffers only: the others are made by the model
            groups[id(t)].append(name)
    keys = {}
    for names in groups.values():
        key = next((n for n in names if n in stored), None) or next(
            (aliases[n] for n in names if aliases.get(n) in stored), None
        )
        if key is None:
            raise ValueError(
                f"{ckpt.directory} holds no tensor for {names[0]!r}; it was saved from another architecture or "
                "with other names: load it with runtime=None, or re-save it with save_sparse"
            )
        keys.update(dict.fromkeys(names, key))
    unused = sorted(stored - set(keys.values()))
    if unused:  # the dense path (load_into) refuses these too: a template of another architecture
        raise ValueError(
            f"{ckpt.directory} holds {len(unused)} tensors this model has no place for, e.g. {unused[:5]}: pass a "
            "template of the architecture it was saved from, or none (load_sparse builds it from the folder)"
        )
    return keys


def _transposed(positions: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]):
    """Positions and values of the (cols, rows) transpose of a (rows, cols) matrix, in row-major order."""
    rows, cols = shape
    moved = (positions % cols) * rows + positions // cols
    order = torch.argsort(moved)
    return moved[order], values[order], (cols, rows)


@torch.no_grad()
def load_runtime(
    ckpt: SparseCheckpoint,
    model: nn.Module | None,
    layout: str,
    sample_input=None,
    min_sparsity: float = 0.5,
    verify: bool = True,
    mmap: bool = False,
    **kwargs,
) -> nn.Module:
    """The model of ``ckpt`` with its pruned layers in the sparse runtime (see :func:`hf_sms.load_sparse`)."""
    if layout == "semi_structured":  # 2:4 kernels compress dense GPU weights: load, move, then convert
        raise ValueError(
            "load_sparse(runtime='semi_structured') is not a loading layout: load with runtime=None, move the model "
            "to the GPU in fp16/bf16, then call hf_sms.to_sparse_runtime(model, 'semi_structured')"
        )
    stats = MaskStats() if verify else None  # mask digests taken while reading: each index is decoded once
    if model is None:
        with init_empty_weights(include_buffers=False):
            model = ckpt.family.instantiate(ckpt, **kwargs)
        ckpt.family.tie_weights(model)  # outside: init_empty_weights re-creates every parameter it sees set
    ckpt.check_claims(model)  # every claimed shape against the model's, before any index is decoded
    reads = _Prefetch(ckpt, stats, min_sparsity if layout != "dense" else 2.0, mmap)
    try:
        # Decoded before anything else runs, not beside it: while Python code runs in this thread, a pool thread
        # gets the GIL back only a switch interval (5 ms) after each numpy call, and decoding stalls (measured:
        # T5-small's indices took 15 s beside a busy Python loop instead of 0.08 s alone).
        reads.wait()
        model.eval()  # before any sample runs: BatchNorm statistics must not move
        device = check_request(model, layout, sample_input, min_sparsity)
        report = RuntimeReport(layout, str(device), torch.get_num_threads())
        keys = _tensor_keys(model, ckpt)
        swaps: dict[str, Swap] = {}
        shared: dict[tuple[str, bool], torch.Tensor] = {}  # (checkpoint key, transposed): its CSR, for tied weights
        done: set[str] = set()  # model tensor names already in place
        candidates = [] if layout == "dense" else _candidates(model)
        reads.submit([keys[f"{name}.weight"] for name, *_ in candidates])  # those stored dense, if any
        for name, module, kind, weight in candidates:
            key = keys[f"{name}.weight"]
            transposed = is_conv1d(module)  # stores (in, out); the runtime multiplies by (out, in)
            if (key, transposed) not in shared:
                nnz, shape, values, csr = reads.get(key)
                if tuple(shape) != tuple(module.weight.shape):
                    model_shape = tuple(module.weight.shape)
                    raise ValueError(f"{key}: checkpoint {tuple(shape)} vs model {model_shape}; re-save it")
                sparsity = 1.0 - nnz / max(weight.numel(), 1)
                choice = plan(report, name, module, kind, values, sparsity, "csr", min_sparsity)
                if choice.layout == "dense":
                    continue
                if transposed:  # rare (GPT-2's Conv1D): read again, in the order the runtime multiplies
                    positions, values, _ = ckpt.read_sparse(key)
                    csr = csr_from_positions(*_transposed(positions, values, (shape[0], shape[1])))
                shared[key, transposed] = csr
            else:  # a tied weight's second layer (T5's lm_head): its own decision, timed as a linear under auto
                first = next(c for c in report.layers if keys[f"{c.name}.weight"] == key)
                values = shared[key, transposed].values()
                if plan(report, name, module, kind, values, first.sparsity, "csr", min_sparsity).layout == "dense":
                    continue
            csr = shared[key, transposed]
            bias = getattr(module, "bias", None)
            if bias is not None:
                bias = ckpt.read(keys[f"{name}.bias"])
                done.add(f"{name}.bias")
            if kind == "embedding":
                sparse = SparseEmbedding(csr, module.padding_idx)
            elif kind == "linear":
                sparse = SparseLinear(csr, bias, transposed)
            else:
                sparse = SparseConv2d(module, csr, bias)
            _set(model, name, sparse)
            swaps[name] = Swap(None, sparse)
            done.add(f"{name}.weight")
    finally:
        reads.close()
    _load_dense_rest(model, ckpt, keys, done, stats)
    if stats is not None:
        check_masks(ckpt, None, stats)
    model.hf_sms_runtime = report
    if not swaps:
        model.eval()
        return model
    # the whole model is not timed here: that would densify every chosen layer (measure_speedup does it)
    finish(model, report, swaps, sample_input, MARGIN, REPEATS, device, measure=False)
    return model


class _Prefetch:
    """Reads, mask digests and CSR builds of a checkpoint's sparse tensors on a thread pool (numpy, zlib, file
    reads and torch's ops release the GIL for their long loops).

    Every encoded tensor is submitted at once, in file order; what a job keeps is what the runtime keeps anyway
    (the CSR matrix, as stored: rows = the first dimension), or nothing for a tensor below ``min_sparsity``,
    which loads dense. Tensors stored dense are submitted once the model names them (:meth:`submit`).
    """

    def __init__(self, ckpt: SparseCheckpoint, stats: MaskStats | None, min_sparsity: float, mmap: bool = False):
        self.ckpt, self.stats, self.min_sparsity, self.mmap = ckpt, stats, min_sparsity, mmap
        self.pool = ThreadPoolExecutor(max_workers=workers())
        self.pending: dict[str, Future] = {}
        if min_sparsity <= 1.0:
            self.submit([key for key in ckpt.names() if ckpt.is_encoded(key)])

    def submit(self, keys: list[str]) -> None:
        for key in keys:
            if key not in self.pending:
                self.pending[key] = self.pool.submit(self._prepare, key)

    def _prepare(self, key: str):
        """``(nnz, shape, values, CSR or None)`` of ``key``; the index is decoded a chunk at a time, each chunk
        going to the mask digest and the CSR matrix while it is in cache."""
        # the runtime keeps the values: a copy, so that the model never follows a file rewritten under it (mmap: as
        # mapped, no copy)
        encoded = self.ckpt.read_encoded(key, mapped=self.mmap)
        head, values, payload = verified(*encoded, key) if encoded is not None else (None, None, None)
        if head is None or head["codec"] == DENSE:  # every value stored, zeros included: its nonzeros
            positions, values, shape = self.ckpt.read_sparse(key)
            chunks = [positions.numpy()]
        else:
            shape, chunks = head["shape"], position_chunks(head, payload, key)
        numel, nnz = math.prod(shape), values.numel()
        digest = MaskDigest(numel) if self.stats is not None else None
        builder = None
        if len(shape) >= 2 and 1.0 - nnz / max(numel, 1) >= self.min_sparsity:
            builder = CSRBuilder((shape[0], numel // shape[0]), nnz)
        consumers = [c for c in (digest, builder) if c is not None]
        for chunk in chunks if consumers else ():
            for consumer in consumers:
                consumer.add(chunk)
        if digest is not None:  # each key once, from one thread
            self.stats.add_digest(key, shape, nnz, digest.digest(), "")
        return nnz, shape, values[:0], builder.tensor(values) if builder is not None else None  # [:0]: the dtype

    def get(self, key: str):
        return self.pending[key].result()

    def wait(self) -> None:
        for future in list(self.pending.values()):
            future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _own_tensors(model: nn.Module):
    """``(owner, attr, full name, tensor)`` of every parameter and persistent buffer outside runtime layers
    (whose ``state_dict`` would densify them)."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, (SparseLinear, SparseConv2d, SparseEmbedding)):
            continue
        tensors = list(module._parameters.items())
        tensors += [(k, v) for k, v in module._buffers.items() if k not in module._non_persistent_buffers_set]
        for attr, t in tensors:
            if t is not None:
                yield module, attr, f"{prefix}.{attr}" if prefix else attr, t


def _load_dense_rest(model: nn.Module, ckpt: SparseCheckpoint, keys: dict[str, str], done: set[str], stats) -> None:
    """Read every tensor not yet in place into the model, dense; tied names get one shared tensor. Their masks go
    into ``stats`` (unless ``None``)."""
    loaded: dict[str, torch.Tensor] = {}
    for owner, attr, name, current in list(_own_tensors(model)):
        if name in done:
            continue
        key = keys[name]
        if key not in loaded:
            tensor = ckpt.read(key)
            if stats is not None and key not in stats.per_tensor and eligible(key, tensor.shape, tensor.dtype):
                stats.add(key, tensor != 0, "")
            if tuple(current.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(current.shape)}; re-save it"
                )
            if isinstance(current, nn.Parameter):
                tensor = nn.Parameter(tensor, requires_grad=False)
            loaded[key] = tensor
        if isinstance(current, nn.Parameter):
            owner._parameters[attr] = loaded[key]
        else:
            owner._buffers[attr] = loaded[key].to(current.dtype)
    left = [name for _, _, name, t in _own_tensors(model) if t.device.type == "meta"]
    if left:
        raise ValueError(f"{ckpt.directory} lacks {len(left)} tensors of the model, e.g. {left[:5]}; re-save it")
