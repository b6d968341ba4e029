"""``to_sparse_runtime``: swap every pruned layer whose sparse product is faster for a sparse inference layer.

Like torchao's ``sparsify_``: one entry point, a per-layer decision, in place. With ``layout="auto"`` each
candidate layer is timed dense against sparse on the very input it gets from ``sample_input`` (interleaved
repeats, medians) and swapped only where the sparse product wins by ``margin``; the whole model is timed
both ways at the end and left dense if the runtime were slower. The decisions and timings are in
``model.hf_sms_runtime`` (a :class:`~hf_sms.runtime.report.RuntimeReport`).
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..pruning.prunable import is_conv1d
from .csr import to_csr
from .layers import (
    SemiStructuredLinear,
    SparseConv2d,
    SparseEmbedding,
    SparseLinear,
    _InferenceOnly,
    check_csr_dtype,
    check_semi_structured,
    dense_module,
    guarded_apply,
    has_csr_kernel,
    has_sparse_product,
    is_two_four,
)
from .report import LayerChoice, RuntimeReport
from .timing import median_ms, time_pair, time_pair_spread

logger = logging.getLogger("hf_sms")
LAYOUTS = ("auto", "csr", "semi_structured", "dense")


_PLAIN = (nn.Linear, nn.Conv2d, nn.Embedding)


MARGIN = 1.1  # under "auto", a layer turns sparse only if its sparse product is this much faster
REPEATS = 7  # timed repeats per layer (medians)


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(name, module, kind, 2-D weight)`` of every layer the runtime can compute sparsely."""
    inside_mha = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    out = []
    for name, module in model.named_modules():
        # a subclass with its own forward (timm's Conv2dSame pads on the fly, LoRA layers add a branch)
        # computes something else than its weight alone: it stays as it is
        if any(isinstance(module, t) and type(module).forward is not t.forward for t in _PLAIN):
            continue
        if isinstance(module, nn.Linear) and id(module) not in inside_mha:
            out.append((name, module, "linear", module.weight))
        elif is_conv1d(module):  # transformers' GPT-2 layers: x @ W
            out.append((name, module, "linear", module.weight.t()))
        elif isinstance(module, nn.Conv2d):
            kind = "conv1x1" if module.kernel_size == (1, 1) and module.padding == (0, 0) else "conv"
            out.append((name, module, kind, module.weight.reshape(module.out_channels, -1)))
        elif isinstance(module, nn.Embedding):
            out.append((name, module, "embedding", module.weight))
    return out


def _sparse_module(module: nn.Module, kind: str, weight: torch.Tensor, layout: str, shared: dict) -> nn.Module:
    """The runtime layer for ``module``; ``shared`` maps a weight's id to its CSR, so tied weights (an embedding
    and its lm_head) share one."""
    bias = getattr(module, "bias", None)
    if layout == "semi_structured":
        return SemiStructuredLinear(weight.detach(), bias)
    if kind == "conv" or kind == "conv1x1":
        return SparseConv2d(module)
    transposed = is_conv1d(module)
    key = (id(module.weight), transposed)
    csr = shared.get(key)
    if csr is None:
        csr = shared[key] = to_csr(weight.detach())
    if kind == "embedding":
        return SparseEmbedding(csr, module.padding_idx)
    return SparseLinear(csr, bias, transposed)


def _unsupported(module: nn.Module, kind: str, layout: str) -> str | None:
    """Why ``module`` cannot run in ``layout`` (``None`` if it can)."""
    if kind == "embedding":
        return "max_norm renormalises looked-up rows: kept dense" if module.max_norm is not None else None
    if kind != "linear" and layout == "semi_structured":
        return "2:4 kernels take linear layers only"
    if kind != "linear" and not has_sparse_product(module):
        return "grouped, depthwise or non-zero-padded conv: no sparse product"
    return None  # a forced 2:4 layout checks the mask in plan(); auto picks 2:4 only for 2:4 weights


def _run(model: nn.Module, sample_input) -> None:
    if callable(sample_input) and not isinstance(sample_input, nn.Module):
        sample_input(model)
    elif isinstance(sample_input, Mapping):
        model(**sample_input)
    elif isinstance(sample_input, (tuple, list)):
        model(*sample_input)
    else:
        model(sample_input)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@dataclass
class Swap:
    """A layer the runtime may replace: the dense module (``None`` when loading sparse-first: ``dense_or_built``)
    and the sparse one (under ``"auto"``, made by ``build`` while the layer is timed; kept only if it wins)."""

    dense: nn.Module | None
    sparse: nn.Module | None
    build: Callable[[], nn.Module] | None = None

    def dense_or_built(self) -> nn.Module:
        return self.dense if self.dense is not None else dense_module(self.sparse)

    def sparse_or_built(self) -> nn.Module:
        if self.sparse is None:
            self.sparse = self.build()
        return self.sparse

    def drop_sparse(self) -> None:
        if self.build is not None:  # one it can make again
            self.sparse = None


@torch.no_grad()  # not inference_mode: its tensors could not be used outside it afterwards
def to_sparse_runtime(
    model: nn.Module,
    layout: str = "auto",
    sample_input=None,
    *,
    min_sparsity: float = 0.5,
    margin: float = MARGIN,
    repeats: int = REPEATS,
) -> nn.Module:
    """Make a pruned model compute with sparse kernels, in place, for inference.

    Every layer the pruner prunes and a sparse kernel can compute (``nn.Linear``, transformers' ``Conv1D``,
    ``nn.Conv2d`` with ``groups=1``: 1x1 directly, kxk on unfolded patches) whose weight is at least
    ``min_sparsity`` zeros is replaced by a :mod:`hf_sms.runtime.layers` module holding the sparse weight.
    Pruned embeddings become CSR lookup tables (for their memory: a lookup has no product to save; a tied
    embedding and lm_head share one CSR). ``nn.MultiheadAttention``'s projections stay dense (it computes
    with its weights directly).

    Args:
        model: a pruned model (transformers, timm, smp or plain torch), in eval mode after conversion; every
            parameter left dense stops requiring gradients.
        layout: ``"auto"``: time each layer dense vs sparse on ``sample_input`` and keep the faster (on a
            CUDA GPU of compute capability >= 8.0 also 2:4 ``semi_structured`` where the weights are 2:4);
            ``"csr"``: every eligible layer as a CSR product; ``"semi_structured"``: every 2:4 linear layer with
            torch's semi-structured kernels (fp16/bf16 on CUDA >= 8.0); ``"dense"``: change nothing.
        sample_input: a batch as the model takes it (a dict of keyword arguments, a tensor or a tuple), or a
            callable ``fn(model)`` that runs the workload to tune for (e.g. ``lambda m: m.generate(**batch)``:
            decoding multiplies one row at a time). Needed by ``"auto"``; with it, every layout also
            measures the whole model dense vs runtime.
        min_sparsity: layers with fewer zeros stay dense (their sparse product cannot win).
        margin: under ``"auto"``, a layer turns sparse only if its sparse product is this much faster.
        repeats: timed repeats per layer and for the whole model (medians).

    Returns:
        ``model``, with ``model.hf_sms_runtime`` (a :class:`RuntimeReport`) saying what runs where.
    """
    if any(isinstance(m, _InferenceOnly) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} already runs the sparse runtime (model.hf_sms_runtime says what runs where): "
            "convert the pruned model itself, not the converted one"
        )
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device (built without weights): load its weights "
            "first, or load a checkpoint straight into the runtime with hf_sms.load_sparse(dir, runtime=...)"
        )
    device = check_request(model, layout, sample_input, min_sparsity, repeats)
    report = RuntimeReport(layout, str(device), torch.get_num_threads())
    model.hf_sms_runtime = report
    if layout == "dense":
        return model
    was_training = model.training
    model.eval()
    use_semi = layout == "semi_structured" or (layout == "auto" and _semi_structured_device(device))
    swaps: dict[str, Swap] = {}
    shared = weakref.WeakValueDictionary()  # a tied weight's CSR, while a sparse module holds it
    for name, module, kind, weight in _candidates(model):
        sparsity = float((weight == 0).count_nonzero()) / max(weight.numel(), 1)
        target = "semi_structured" if use_semi and kind == "linear" and is_two_four(weight) else "csr"
        if layout == "semi_structured" and kind != "embedding":
            target = "semi_structured"
        choice = plan(report, name, module, kind, weight, sparsity, target, min_sparsity)
        if choice.layout != "dense":
            build = functools.partial(_sparse_module, module, kind, weight, target, shared)
            # "auto" makes a layer's sparse weight when it times it: the runtime never holds every layer's at once
            lazy = layout == "auto" and kind != "embedding"
            swaps[name] = Swap(module, None, build) if lazy else Swap(module, build())
    if not swaps:
        warnings.warn(
            f"to_sparse_runtime: no layer of {type(model).__name__} is pruned to min_sparsity={min_sparsity} in a "
            "form a sparse kernel computes; the model is unchanged (prune it first, e.g. hf_sms.prune)",
            stacklevel=3,
        )
        model.train(was_training)
        return model
    finish(model, report, swaps, sample_input, margin, repeats, device, measure=sample_input is not None)
    return model


def check_request(model: nn.Module, layout: str, sample_input, min_sparsity: float, repeats: int = 1) -> torch.device:
    """Validate a runtime request before any work; returns the model's device."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats is how often each timing runs (medians of them): an integer >= 1, got {repeats!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "auto" and sample_input is None:
        raise ValueError(
            "layout='auto' times every layer on the input it gets: pass sample_input (a batch as the model takes "
            "it, or a callable fn(model)), or choose layout='csr'"
        )
    if not 0.0 <= min_sparsity < 1.0:
        raise ValueError(f"min_sparsity must be in [0, 1), got {min_sparsity}")
    param = next((p for p in model.parameters() if p.device.type != "meta"), None)
    device = param.device if param is not None else torch.device("cpu")
    if layout == "semi_structured" and not _semi_structured_device(device):
        check_semi_structured(torch.zeros(0, device=device))  # raises with the fix
    return device


def _semi_structured_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def plan(report, name, module, kind, weight, sparsity, target, min_sparsity) -> LayerChoice:
    """Record the layer in ``report`` and whether it may turn ``target``; raises where a forced layout cannot.
    ``weight`` gives the dtype and device (loading sparse-first passes the stored values: it has no dense weight)."""
    choice = LayerChoice(name, kind, tuple(module.weight.shape), sparsity)
    report.layers.append(choice)
    why = _unsupported(module, kind, target)
    if not why and target == "csr" and report.layout == "auto" and not has_csr_kernel(weight.dtype, weight.device):
        why = f"no csr kernel for {str(weight.dtype).removeprefix('torch.')} on {weight.device.type}"  # forced: raises
    if kind == "embedding" and not why and sparsity >= min_sparsity:  # a lookup: kept for its memory, not timed
        check_csr_dtype(weight.dtype, weight.device)
        choice.layout, choice.reason = "csr", "memory: rows gathered from CSR (the whole model is timed)"
        return choice
    if report.layout == "semi_structured" and kind == "linear" and sparsity >= min_sparsity:
        check_semi_structured(weight)  # a forced 2:4 layout refuses a mask that is not 2:4
    if sparsity < min_sparsity:
        choice.reason = f"sparsity below min_sparsity={min_sparsity}"
    elif why:
        choice.reason = why
    else:
        if target == "csr":
            check_csr_dtype(weight.dtype, weight.device)
        choice.layout, choice.reason = target, "forced by layout" if report.layout != "auto" else ""
    return choice


def finish(model, report, swaps: dict[str, Swap], sample_input, margin, repeats, device, measure: bool) -> None:
    """Decide (``auto``), install the chosen modules, time the whole model if ``measure``, freeze the rest."""
    by_name = {c.name: c for c in report.layers}
    if report.layout == "auto":
        _decide(model, swaps, by_name, sample_input, margin, repeats, device)
    for name, swap in swaps.items():
        _set(model, name, swap.sparse if by_name[name].layout != "dense" else swap.dense_or_built())
    if measure:
        _time_whole_model(model, swaps, by_name, report, sample_input, repeats, device)
    for p in model.parameters():
        p.requires_grad_(False)
    if not isinstance(model, _InferenceOnly):  # bound to the model: copy.deepcopy and torch.load rebind it
        model._apply = functools.partial(guarded_apply, model)  # a partial pickles (torch.save) and deep-copies
    model.eval()


def _decide(model, swaps: dict[str, Swap], by_name, sample_input, margin, repeats, device) -> None:
    """Time each candidate dense vs sparse on the input it gets from ``sample_input``; keep the faster."""
    seen: set[str] = set()

    def hook(name):
        def pre(module, args):
            if name in seen or not args or not torch.is_tensor(args[0]):
                return
            seen.add(name)
            x, swap, choice = args[0], swaps[name], by_name[name]
            dense = swap.dense_or_built()  # one layer's dense weight at a time when loading sparse-first
            sparse = swap.sparse_or_built()
            dense_ms, sparse_ms = time_pair(lambda: dense.forward(x), lambda: sparse(x), repeats, device)
            choice.dense_ms, choice.sparse_ms = dense_ms, sparse_ms
            expected, got = dense.forward(x), sparse(x)
            tol = 1e-2 if x.dtype in (torch.float16, torch.bfloat16) else 1e-4
            atol = tol * float(expected.abs().max()) if expected.numel() else tol
            if got.shape != expected.shape or not torch.allclose(got.float(), expected.float(), rtol=tol, atol=atol):
                choice.layout, choice.reason = "dense", "sparse output differs from dense (kept dense)"
            elif sparse_ms * margin > dense_ms:
                choice.layout, choice.reason = "dense", f"sparse not {margin}x faster on the sample"
            else:
                choice.reason = "faster on the sample"
            if choice.layout == "dense":
                swap.drop_sparse()

        return pre

    # the hooks sit on whichever module the model holds now (dense, or sparse when loaded sparse-first)
    timed = [n for n in swaps if by_name[n].kind != "embedding"]
    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in timed]
    try:
        _run(model, sample_input)
    finally:
        for h in handles:
            h.remove()
    for name in timed:
        if name not in seen:
            by_name[name].layout, by_name[name].reason = "dense", "not called by the sample input"
            swaps[name].drop_sparse()


def _time_whole_model(model, swaps: dict[str, Swap], by_name, report, sample_input, repeats, device) -> None:
    """Dense vs runtime latency of the whole model on the sample; a runtime slower than dense is undone."""
    chosen = [n for n in swaps if by_name[n].layout != "dense"]
    if not chosen:  # nothing runs sparse: the runtime is the dense model, timed once
        (report.dense_ms,) = median_ms([lambda: _run(model, sample_input)], max(3, repeats // 2), device)
        report.runtime_ms = report.dense_ms
        return
    dense = {n: swaps[n].dense_or_built() for n in chosen}

    def use(sparse: bool):
        for name in chosen:
            _set(model, name, swaps[name].sparse if sparse else dense[name])

    def run_dense():
        use(False)
        _run(model, sample_input)

    def run_runtime():
        use(True)
        _run(model, sample_input)

    rounds = max(3, repeats // 2)
    report.dense_ms, report.runtime_ms, report.speedup_range = time_pair_spread(run_dense, run_runtime, rounds, device)
    report.repeats = rounds
    if report.layout == "auto" and report.runtime_ms > report.dense_ms:
        use(False)
        for name in chosen:
            by_name[name].layout, by_name[name].reason = "dense", "the whole model was slower with it"
        logger.warning("[hf-sms] the sparse runtime was slower than dense on the sample; every layer stays dense")
        report.runtime_ms, report.speedup_range = report.dense_ms, [1.0, 1.0]
    else:
        use(True)
