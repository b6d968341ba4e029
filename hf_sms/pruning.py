"""Magnitude pruning: which tensors are prunable, how sparsity is allocated, masks (METHOD.md §2).

A mask is a plain ``bool`` tensor per parameter name, ``True`` where the weight is kept.
Allocation methods are pure functions in a registry, so a new one is one function and one line.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from .batchnorm import forward_batch

Masks = dict[str, torch.Tensor]

# Module type -> (kind, weight attributes). Only these weights are prunable: biases and normalisation
# parameters never are. nn.MultiheadAttention packs q/k/v into ``in_proj_weight``, or keeps three matrices
# when kdim/vdim != embed_dim (unused slots are None); its out_proj is an nn.Linear subclass, found as such.
# nn.TransformerEncoderLayer/DecoderLayer are built from these, so they are covered too.
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
_WEIGHTS_BY_TYPE: list[tuple[type | tuple[type, ...], str, tuple[str, ...]]] = [
    (_CONV, "conv", ("weight",)),
    (nn.Linear, "linear", ("weight",)),
    (nn.Embedding, "embedding", ("weight",)),
    (nn.MultiheadAttention, "linear", _MHA_WEIGHTS),
]


def _kind_and_attributes(module: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    for types, kind, attributes in _WEIGHTS_BY_TYPE:
        if isinstance(module, types):
            return kind, attributes
    # transformers' GPT-2 style Conv1D is a linear layer with a transposed weight.
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return "linear", ("weight",)
    return None


def _layer_weights(module: nn.Module) -> tuple[str, list[nn.Parameter]] | None:
    """``(kind, prunable weights)`` that ``module`` itself holds, or None if it is not a prunable layer."""
    entry = _kind_and_attributes(module)
    if entry is None:
        return None
    kind, attributes = entry
    weights = [getattr(module, a, None) for a in attributes]
    return kind, [w for w in weights if isinstance(w, nn.Parameter) and w.is_floating_point()]


Use = tuple[int, str]  # (position in the forward or in module order, kind of the layer using the weight)


@dataclass(frozen=True)
class PrunableTensor:
    """A prunable weight, named as in ``model.named_parameters()``.

    ``kind`` is the layer type it was first found in; ``uses`` lists every layer that uses it as
    ``(position, kind)``, so a tied weight such as T5's ``shared.weight`` (an Embedding, and the
    weight of the lm_head Linear) shows both uses. Positions follow module registration order, or
    call order when masks are computed with ``example_inputs``.
    """

    name: str
    param: nn.Parameter
    kind: str  # "conv" | "linear" | "embedding"
    uses: tuple[Use, ...] = ()


def _registration_uses(model: nn.Module) -> dict[int, list[Use]]:
    """``{id(weight): uses}`` with positions in ``model.modules()`` order; a tied weight has one use per layer."""
    uses: dict[int, list[Use]] = defaultdict(list)
    for position, module in enumerate(model.modules()):
        entry = _layer_weights(module)
        for weight in entry[1] if entry else ():
            uses[id(weight)].append((position, entry[0]))
    return uses


def prunable_tensors(model: nn.Module) -> list[PrunableTensor]:
    """The prunable weights of ``model`` in module order, tied weights counted once.

    Works for transformers, timm, segmentation_models_pytorch and plain ``nn.Module``s: the decision
    is made on layer types (``_WEIGHTS_BY_TYPE``), so any model built from torch's layers is covered,
    attention included.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # de-duplicates tied parameters
    uses = _registration_uses(model)
    seen: set[int] = set()
    out = []
    for module in model.modules():
        entry = _layer_weights(module)
        for weight in entry[1] if entry else ():
            if id(weight) in seen or id(weight) not in names:
                continue
            seen.add(id(weight))
            out.append(PrunableTensor(names[id(weight)], weight, entry[0], tuple(uses[id(weight)])))
    return out


@contextmanager
def unfused_attention():
    """Turn off torch's fused attention fast path, so every matmul and layer call is visible.

    In eval mode without gradients nn.MultiheadAttention and nn.TransformerEncoderLayer run one fused
    kernel that neither calls their Linear submodules nor shows its matmuls to a dispatch mode.
    """
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def _accepts_labels(model: nn.Module) -> bool:
    # Seq2seq models derive their decoder inputs from labels, so they must get them when they take them.
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@torch.no_grad()
def call_order_uses(model: nn.Module, example_inputs) -> dict[int, list[Use]]:
    """``{id(weight): uses}`` with positions in the order layers are called on ``example_inputs``.

    ``example_inputs`` is a batch as :func:`hf_sms.batchnorm.forward_batch` takes it (a dict such as
    ``{"x": ...}`` or ``{"input_ids": ..., "labels": ...}``, or a tensor). The forward runs in eval mode
    without gradients; the training mode is restored. A weight whose layer is never called, like
    MHA's out_proj (MHA reads its weight without calling it), gets no use.
    """
    uses: dict[int, list[Use]] = defaultdict(list)
    calls = itertools.count()

    def record(module, args):
        kind, weights = _layer_weights(module)
        position = next(calls)
        for weight in weights:
            uses[id(weight)].append((position, kind))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if _layer_weights(m)]
    was_training = model.training
    model.eval()
    try:
        with unfused_attention():
            device = next(model.parameters()).device
            forward_batch(model, example_inputs, device, keep_labels=_accepts_labels(model))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return uses


def first_use(tensors: list[PrunableTensor], kind: str) -> PrunableTensor | None:
    """The tensor that a layer of ``kind`` uses first (e.g. the first conv), None if no layer of that kind."""
    found = [(position, i) for i, t in enumerate(tensors) for position, k in t.uses if k == kind]
    return tensors[min(found)[1]] if found else None


def last_use(tensors: list[PrunableTensor], kind: str) -> PrunableTensor | None:
    """The tensor that a layer of ``kind`` uses last: a tied lm_head makes its embedding the last linear."""
    found = [(position, i) for i, t in enumerate(tensors) for position, k in t.uses if k == kind]
    return tensors[max(found)[1]] if found else None


# ----------------------------------------------------------------------------------------------
# Allocation methods: (tensors, weights, current masks, sparsity) -> new masks.
# ``weights`` are detached float32 copies; ``masks`` always exist (all-True when unpruned); each
# tensor's ``uses`` tell which layers use it in which order (see ``first_use`` and ``last_use``).
Allocation = Callable[[list[PrunableTensor], dict[str, torch.Tensor], Masks, float], Masks]
ALLOCATIONS: dict[str, Allocation] = {}


def register_allocation(name: str):
    def deco(fn: Allocation) -> Allocation:
        if name in ALLOCATIONS:
            raise ValueError(f"allocation {name!r} is already registered")
        ALLOCATIONS[name] = fn
        return fn

    return deco


def _masked_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Already-pruned weights rank below everything, so they are removed first and stay removed.
    return scores.masked_fill(~mask, -math.inf)


def _keep_top(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Bool mask keeping exactly ``n_keep`` largest scores (ties broken by position)."""
    flat = scores.reshape(-1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    if n_keep > 0:
        keep[torch.topk(flat, n_keep, sorted=False).indices] = True
    return keep.view_as(scores)


def _n_keep(numel: int, sparsity: float, alive: int) -> int:
    # Masks only grow: never keep more than what is still alive.
    return min(numel - round(sparsity * numel), alive)


def _global_top(tensors, scores: dict[str, torch.Tensor], masks: Masks, sparsity: float) -> Masks:
    flat = torch.cat([_masked_scores(scores[t.name], masks[t.name]).reshape(-1) for t in tensors])
    alive = int(sum(int(masks[t.name].sum()) for t in tensors))
    keep = _keep_top(flat, _n_keep(flat.numel(), sparsity, alive))
    out, i = {}, 0
    for t in tensors:
        n = t.param.numel()
        out[t.name] = keep[i : i + n].view_as(t.param)
        i += n
    return out


def _per_tensor_top(tensors, scores, masks: Masks, sparsities: dict[str, float]) -> Masks:
    return {
        t.name: _keep_top(
            _masked_scores(scores[t.name], masks[t.name]),
            _n_keep(t.param.numel(), sparsities[t.name], int(masks[t.name].sum())),
        )
        for t in tensors
    }


@register_allocation("global")
def global_magnitude(tensors, weights, masks, sparsity):
    """One threshold on |w| over all prunable weights (the paper's default)."""
    return _global_top(tensors, {n: w.abs() for n, w in weights.items()}, masks, sparsity)


@register_allocation("uniform")
def uniform_magnitude(tensors, weights, masks, sparsity):
    """Every prunable tensor gets the same sparsity."""
    return _per_tensor_top(tensors, {n: w.abs() for n, w in weights.items()}, masks, dict.fromkeys(weights, sparsity))


@register_allocation("uniform_plus")
def uniform_plus_magnitude(tensors, weights, masks, sparsity):
    """Uniform, but the first conv stays dense and the last linear layer is pruned to at most 80% (Gale 2019).

    First and last follow ``PrunableTensor.uses``: call order when masks get ``example_inputs``, else
    module order. A weight tied to a later Linear (T5's shared embedding and lm_head) is a linear use there.
    """
    sparsities = dict.fromkeys(weights, sparsity)
    first_conv, last_linear = first_use(tensors, "conv"), last_use(tensors, "linear")
    if first_conv is not None:
        sparsities[first_conv.name] = 0.0
    if last_linear is not None:
        sparsities[last_linear.name] = min(sparsity, 0.8)
    return _per_tensor_top(tensors, {n: w.abs() for n, w in weights.items()}, masks, sparsities)


def erk_densities(shapes: dict[str, tuple[int, ...]], sparsity: float) -> dict[str, float]:
    """Erdos-Renyi-Kernel densities (Evci et al. 2019): density ~ sum(shape)/prod(shape), total matched.

    Layers whose density would exceed 1 are made dense and the rest re-solved.
    """
    numel = {n: math.prod(s) for n, s in shapes.items()}
    raw = {n: sum(s) / numel[n] for n, s in shapes.items()}
    budget = (1.0 - sparsity) * sum(numel.values())
    dense: set[str] = set()
    while True:
        rest = [n for n in shapes if n not in dense]
        eps = (budget - sum(numel[n] for n in dense)) / sum(raw[n] * numel[n] for n in rest)
        # The tolerance keeps float error from making every layer "too dense" (0/0 at sparsity 0).
        too_dense = {n for n in rest if eps * raw[n] > 1.0 + 1e-9}
        if not too_dense:
            return {n: 1.0 if n in dense else min(eps * raw[n], 1.0) for n in shapes}
        dense |= too_dense


@register_allocation("erk")
def erk_magnitude(tensors, weights, masks, sparsity):
    densities = erk_densities({t.name: tuple(t.param.shape) for t in tensors}, sparsity)
    scores = {n: w.abs() for n, w in weights.items()}
    return _per_tensor_top(tensors, scores, masks, {n: 1.0 - d for n, d in densities.items()})


def lamp_scores(weight: torch.Tensor) -> torch.Tensor:
    """LAMP (Lee et al. 2021): ``w_u^2 / sum_{v >= u} w_v^2`` over weights sorted by ``w^2`` ascending."""
    sq = weight.reshape(-1).double() ** 2
    sorted_sq, order = torch.sort(sq)
    tail = sorted_sq.flip(0).cumsum(0).flip(0)  # sum over v >= u
    scores = torch.empty_like(sq)
    scores[order] = sorted_sq / tail.clamp_min(torch.finfo(torch.float64).tiny)
    return scores.view_as(weight)


@register_allocation("lamp")
def lamp_magnitude(tensors, weights, masks, sparsity):
    # Pruned weights are zero, so they already rank first within each tensor.
    return _global_top(tensors, {n: lamp_scores(w * masks[n]) for n, w in weights.items()}, masks, sparsity)


# ----------------------------------------------------------------------------------------------
def _check_sparsity(sparsity: float) -> None:
    if not (isinstance(sparsity, (int, float)) and 0.0 <= sparsity < 1.0):
        raise ValueError(f"sparsity must be a fraction in [0, 1), got {sparsity!r}; e.g. 0.9 removes 90% of weights")


def validate_masks(model: nn.Module, masks: Masks) -> dict[str, PrunableTensor]:
    """Check that every mask names a prunable parameter of ``model`` with the same shape."""
    tensors = {t.name: t for t in prunable_tensors(model)}
    for name, mask in masks.items():
        if name not in tensors:
            hint = ", ".join(list(tensors)[:5])
            raise ValueError(
                f"mask names {name!r}, which is not a prunable weight of this model; prunable weights are e.g. "
                f"{hint}. Compute masks with hf_sms.compute_masks(model, ...) on the same architecture."
            )
        if tuple(mask.shape) != tuple(tensors[name].param.shape):
            raise ValueError(
                f"mask for {name!r} has shape {tuple(mask.shape)} but the weight has shape "
                f"{tuple(tensors[name].param.shape)}; the masks belong to a different architecture."
            )
        if mask.dtype != torch.bool:
            raise ValueError(f"mask for {name!r} has dtype {mask.dtype}; masks are bool tensors (True = kept)")
    return tensors


@torch.no_grad()
def compute_masks(
    model: nn.Module,
    sparsity: float,
    allocation: str = "global",
    masks: Masks | None = None,
    example_inputs=None,
) -> Masks:
    """Magnitude-prune masks for ``model`` at ``sparsity`` (fraction of prunable weights removed).

    Args:
        model: any torch model; prunable tensors are found by :func:`prunable_tensors`.
        sparsity: target fraction in [0, 1) of all prunable weights (tied weights counted once).
        allocation: a name in ``ALLOCATIONS`` ("global", "uniform", "uniform_plus", "erk", "lamp").
        masks: masks of an earlier phase; weights they prune stay pruned (masks only grow).
        example_inputs: optional batch (see :func:`call_order_uses`); with it, one forward pass orders the
            layers by call, so "first conv" and "last linear" (``uniform_plus``) mean execution order.

    Returns:
        ``{parameter name: bool tensor}`` on the weights' devices, ``True`` where the weight is kept.
        Exactly ``round(sparsity * n)`` weights are pruned per allocation unit (all weights for global
        allocations, each tensor for per-layer ones) unless earlier masks already prune more.
    """
    _check_sparsity(sparsity)
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {allocation!r}; choose one of {sorted(ALLOCATIONS)}")
    tensors = list(validate_masks(model, masks or {}).values())
    if not tensors:
        raise ValueError("model has no prunable weights (linear, convolution or embedding layers)")
    if example_inputs is not None:
        uses = call_order_uses(model, example_inputs)
        tensors = [replace(t, uses=tuple(uses.get(id(t.param), ()))) for t in tensors]
    current = {t.name: torch.ones_like(t.param, dtype=torch.bool) for t in tensors}
    current.update({n: m.to(current[n].device) for n, m in (masks or {}).items()})
    weights = {t.name: t.param.detach().float() * current[t.name] for t in tensors}
    return ALLOCATIONS[allocation](tensors, weights, current, float(sparsity))


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Masks) -> nn.Module:
    """Zero the pruned weights of ``model`` in place; returns ``model``."""
    tensors = validate_masks(model, masks)
    for name, mask in masks.items():
        param = tensors[name].param
        param.masked_fill_(~mask.to(param.device), 0.0)  # +0.0, not the -0.0 a multiply leaves
    return model


def masks_from_model(model: nn.Module) -> Masks:
    """Masks read off the zeros of the prunable weights (a weight that is exactly 0 counts as pruned)."""
    return {t.name: t.param.detach() != 0 for t in prunable_tensors(model)}


@torch.no_grad()
def sparsity_report(model: nn.Module, masks: Masks | None = None) -> dict:
    """Measured sparsity: fraction of exact zeros in the prunable weights, globally and per tensor.

    If ``masks`` is given, also reports the mask's sparsity, so the two can be compared.
    """
    per_tensor, zeros, numel = {}, 0, 0
    for t in prunable_tensors(model):
        z = int((t.param == 0).sum())
        per_tensor[t.name] = {"sparsity": z / t.param.numel(), "zeros": z, "numel": t.param.numel()}
        zeros, numel = zeros + z, numel + t.param.numel()
    report = {"sparsity": zeros / max(numel, 1), "zeros": zeros, "numel": numel, "per_tensor": per_tensor}
    all_params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in all_params)
    report["model_sparsity"] = sum(int((p == 0).sum()) for p in all_params) / max(total, 1)
    if masks is not None:
        pruned = sum(int((~m).sum()) for m in masks.values())
        report["mask_sparsity"] = pruned / max(sum(m.numel() for m in masks.values()), 1)
    return report


def phase_sparsities(target: float, n_phases: int) -> list[float]:
    """Sparsity after each of ``n_phases`` IMP phases reaching ``target`` (METHOD §1).

    Each phase removes the same fraction ``q = 1 - (1 - target) ** (1 / n_phases)`` of the weights
    still alive: ``phase_sparsities(0.9, 3)`` is about ``[0.536, 0.785, 0.9]``.
    """
    _check_sparsity(target)
    if not isinstance(n_phases, int) or n_phases < 1:
        raise ValueError(f"n_phases must be a positive integer, got {n_phases!r}")
    q = 1.0 - (1.0 - target) ** (1.0 / n_phases)
    out = [1.0 - (1.0 - q) ** p for p in range(1, n_phases + 1)]
    out[-1] = float(target)  # exact, not 1 - (1 - q)**P with rounding error
    return out


@torch.no_grad()
def pruned_norm_fraction(model: nn.Module, masks: Masks) -> float:
    """``d = sqrt(|‖θ‖² - ‖θ_pruned‖²|) / ‖θ‖`` for pruning ``model`` with ``masks`` (ALLR, METHOD §3).

    Norms run over all parameters (weights and biases); ``model`` is the model before pruning.
    """
    tensors = validate_masks(model, masks)
    total = sum(float(p.detach().float().pow(2).sum()) for p in {id(p): p for p in model.parameters()}.values())
    removed = sum(
        float(tensors[n].param.detach().float().pow(2)[~m.to(tensors[n].param.device)].sum()) for n, m in masks.items()
    )
    return math.sqrt(removed) / math.sqrt(total) if total > 0 else 0.0


@dataclass
class PruningStep:
    """The masks of one pruning step plus what ALLR needs to know about it.

    Attributes:
        masks: ``{name: bool tensor}``, True where kept.
        norm_fraction: d, relative norm of the weights this step removed.
        phase_fraction: q, fraction of the then-alive prunable weights this step removed.
    """

    masks: Masks
    norm_fraction: float
    phase_fraction: float

    @classmethod
    @torch.no_grad()
    def measure(cls, model: nn.Module, masks: Masks) -> PruningStep:
        """Describe pruning ``model`` (not yet masked) with ``masks``."""
        tensors = validate_masks(model, masks)
        alive = newly = 0
        for name, mask in masks.items():
            nz = tensors[name].param.detach() != 0
            alive += int(nz.sum())
            newly += int((nz & ~mask.to(nz.device)).sum())
        return cls(masks, pruned_norm_fraction(model, masks), newly / alive if alive else 0.0)


def prune(
    model: nn.Module,
    sparsity: float,
    allocation: str = "global",
    masks: Masks | None = None,
    sync: Callable[[Masks], Masks] | None = None,
    example_inputs=None,
) -> PruningStep:
    """Compute masks for ``sparsity``, measure the step for ALLR, and zero the pruned weights in place.

    ``sync`` replaces the computed masks before use, e.g. with rank 0's masks in a distributed run.
    ``example_inputs`` orders layers by call for ``uniform_plus`` (see :func:`compute_masks`).
    """
    new = compute_masks(model, sparsity, allocation, masks, example_inputs)
    step = PruningStep.measure(model, sync(new) if sync is not None else new)
    apply_masks(model, step.masks)
    return step
