"""Sparsity allocations: how a target sparsity is spread over the prunable weights (docs/method.md §2).

Each allocation is a pure function ``(tensors, scores, masks, sparsity) -> masks`` in a registry, so a new
one is one function and one decorator line. ``scores`` are the criterion's (:mod:`hf_sms.pruning.criteria`;
``|w|`` for the default ``"magnitude"``), higher is kept; ``masks`` always exist (all-True when unpruned); each
tensor's ``uses`` tell which layers use it in which order (see :func:`hf_sms.pruning.prunable.first_use`).
Whole units (filters, neurons, heads) are the unit structures' (:mod:`hf_sms.plan.structures`).
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable

import torch

from ..registry import ALLOCATIONS
from .masks import PackedMasks
from .prunable import Masks, PrunableTensor, first_use, last_use
from .top_k import ElementwiseScores, Lazy, LazyMapping, top_k

Allocation = Callable[[list[PrunableTensor], dict[str, torch.Tensor], Masks, float], Masks]
register_allocation = ALLOCATIONS.register


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
    # an elementwise criterion's scores computed chunk by chunk from the weights, never all at once
    lazy = isinstance(scores, ElementwiseScores)
    if lazy or all(scores[t.name].dtype != torch.float64 for t in tensors):  # no concatenated copy (top_k.py)
        numel = sum(t.param.numel() for t in tensors)
        alive = sum(int(torch.count_nonzero(masks[t.name])) for t in tensors)  # a bool sum() upcasts to int64
        n_keep = _n_keep(numel, sparsity, alive)
        given, names = scores.weights if lazy else scores, [t.name for t in tensors]
        transform = scores.fn if lazy else None
        if lazy and isinstance(given, LazyMapping) and given.stored is not None:
            # a bf16 model's weights as stored, no fp32 copy: |w| and w**2 of each chunk in float32, the copy's values
            given, fn = given.stored, scores.fn

            def transform(part, fn=fn):
                return fn(part.float())

        # one tensor's scores (or float32 weights) and mask at a time: the masks may be made as they are read
        on = Lazy(tensors, lambda t: masks[t.name].to(t.param.device))
        like = [t.param for t in tensors]
        kept = top_k(Lazy(names, given.__getitem__), on, n_keep, transform=transform, like=like, packed_bits=True)
        return PackedMasks(names, [t.param.shape for t in tensors], kept)  # bits until each is used
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
def global_magnitude(tensors, scores, masks, sparsity):
    """One threshold on the scores of all prunable weights (with |w|: the paper's default)."""
    return _global_top(tensors, scores, masks, sparsity)


@register_allocation("uniform")
def uniform_magnitude(tensors, scores, masks, sparsity):
    """Every prunable tensor gets the same sparsity."""
    return _per_tensor_top(tensors, scores, masks, dict.fromkeys(scores, sparsity))


@register_allocation("uniform_plus")
def uniform_plus_magnitude(tensors, scores, masks, sparsity):
    """Uniform, but the first conv stays dense and the last linear layer is pruned to at most 80% (Gale 2019).

    First and last follow ``PrunableTensor.uses``: call order when masks get ``example_inputs``, else
    module order. A weight tied to a later Linear (T5's shared embedding and lm_head) is a linear use there.
    """
    sparsities = dict.fromkeys(scores, sparsity)
    first_conv, last_linear = first_use(tensors, "conv"), last_use(tensors, "linear")
    if first_conv is not None:
        sparsities[first_conv.name] = 0.0
    if last_linear is not None:
        sparsities[last_linear.name] = min(sparsity, 0.8)
    return _per_tensor_top(tensors, scores, masks, sparsities)


def erk_densities(shapes: dict[str, tuple[int, ...]], sparsity: float) -> dict[str, float]:
    """Erdos-Renyi-Kernel densities (Evci et al. 2019): density ~ sum(shape)/prod(shape), total matched.

    Layers whose density would exceed 1 are made dense and the rest re-solved.
    """
    numel = {n: math.prod(s) for n, s in shapes.items()}
    dense = {n for n, k in numel.items() if k == 0}  # a zero-size layer has nothing to prune (and no density)
    raw = {n: sum(s) / numel[n] for n, s in shapes.items() if n not in dense}
    budget = (1.0 - sparsity) * sum(numel.values())
    while True:
        rest = [n for n in shapes if n not in dense]
        if not rest:
            return dict.fromkeys(shapes, 1.0)
        eps = (budget - sum(numel[n] for n in dense)) / sum(raw[n] * numel[n] for n in rest)
        # The tolerance keeps float error from making every layer "too dense" (0/0 at sparsity 0).
        too_dense = {n for n in rest if eps * raw[n] > 1.0 + 1e-9}
        if not too_dense:
            return {n: 1.0 if n in dense else min(eps * raw[n], 1.0) for n in shapes}
        dense |= too_dense


@register_allocation("erk")
def erk_magnitude(tensors, scores, masks, sparsity):
    densities = erk_densities({t.name: tuple(t.param.shape) for t in tensors}, sparsity)
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
def lamp_magnitude(tensors, scores, masks, sparsity):
    """LAMP over the criterion's scores (with |w|, Lee et al.'s own); pruned weights rank first in each tensor."""
    return _global_top(tensors, {n: lamp_scores(s * masks[n]) for n, s in scores.items()}, masks, sparsity)


_N_OF_M = re.compile(r"(\d+):(\d+)")


def parse_n_of_m(name: str) -> tuple[int, int] | None:
    """``(n, m)`` of an allocation named ``"n:m"`` (e.g. ``"2:4"``), ``None`` for any other name."""
    match = _N_OF_M.fullmatch(name.strip()) if isinstance(name, str) else None
    if match is None:
        return None
    n, m = int(match[1]), int(match[2])
    if not 0 < n < m:
        raise ValueError(f"allocation={name!r}: n:m sparsity keeps n of every m weights, so it needs 0 < n < m")
    return n, m


def _n_of_m_allocation(name: str) -> Allocation | None:
    nm = parse_n_of_m(name)
    return functools.partial(n_of_m, n=nm[0], m=nm[1]) if nm is not None else None


ALLOCATIONS.parse = _n_of_m_allocation
get_allocation = ALLOCATIONS.get  # a registered allocation, or "n:m" (n_of_m); else a clear error


def n_of_m(tensors, scores, masks, sparsity, *, n: int, m: int) -> Masks:
    """n:m sparsity (Mishra et al. 2021; Zhou et al. 2021): in every group of ``m`` consecutive input weights of a
    linear layer (``nn.Linear``, attention projections, transformers' ``Conv1D``) exactly ``n`` are kept, those of
    highest score; the pattern torch's 2:4 semi-structured kernels run (``structure="2:4"``).

    Convolutions and embeddings (a tied lm_head included) and linear layers whose input size is not a multiple of
    ``m`` are left as they are (dense, or their earlier masks), with a warning naming the latter; ``ValueError`` if
    no layer fits the pattern. ``sparsity`` is the phase's target on the way to ``1 - n/m`` (more is refused): a
    phase keeps ``max(n, m - round(sparsity * m))`` of every ``m``, so one phase goes straight to n:m (NVIDIA's
    one-shot recipe) and several go through coarser patterns (3:4, then 2:4); masks only grow, so each phase
    chooses among the weights the last one kept.
    """
    if sparsity > 1 - n / m + 1e-9:
        raise ValueError(
            f"{n}:{m} keeps {n} of every {m} weights: its sparsity is at most {1 - n / m:g}, not {sparsity:g}"
        )
    keep = max(n, m - round(sparsity * m))
    out, skipped, pruned = dict(masks), [], 0
    for t in tensors:
        if t.kind != "linear" or t.param.dim() != 2:
            continue
        score, mask = scores[t.name], masks[t.name]
        if t.transposed:  # Conv1D stores (in, out): groups run along its first dimension
            score, mask = score.t(), mask.t()
        if score.shape[1] % m:
            skipped.append(t.name)
            continue
        groups = _masked_scores(score, mask).reshape(-1, m)
        kept = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(keep, dim=1).indices, True)
        kept = kept.reshape(score.shape) & mask
        out[t.name] = kept.t() if t.transposed else kept
        pruned += 1
    if not pruned:
        raise ValueError(
            f"{n}:{m} sparsity prunes linear layers whose input size is a multiple of {m}, and this model has none "
            f"(e.g. {skipped[:3]}): the run would train at sparsity 0. Choose m dividing the input sizes, or "
            "another structure"
        )
    if skipped:
        warnings.warn(
            f"{n}:{m} sparsity leaves dense the linear weights whose input size is not a multiple of {m}: "
            f"{skipped[:5]}",
            stacklevel=5,
        )
    return out
