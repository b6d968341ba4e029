"""Merging replicas into a soup (METHOD.md §4). Merge methods live in a registry, mergekit-style.

Every merge is a weighted mean of state dicts: floating-point parameters and buffers are averaged,
integer buffers (``num_batches_tracked``) are taken from the first input. A mean of tensors that
are all zero at a position is exactly zero there, so inputs that share a mask give a soup with
that mask, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .pruning import Masks, apply_masks, compute_masks, masks_from_model

StateDict = dict[str, torch.Tensor]
MERGE_METHODS: dict[str, Callable] = {}


def register_merge(name: str):
    def deco(fn):
        if name in MERGE_METHODS:
            raise ValueError(f"merge method {name!r} is already registered")
        MERGE_METHODS[name] = fn
        return fn

    return deco


@torch.no_grad()
def average_state_dicts(state_dicts: Sequence[StateDict], weights: Sequence[float] | None = None) -> StateDict:
    """Weighted mean of state dicts (uniform if ``weights`` is None); accumulates in float64."""
    if not state_dicts:
        raise ValueError("nothing to average: pass at least one model")
    keys = list(state_dicts[0])
    for i, sd in enumerate(state_dicts[1:], 1):
        if list(sd) != keys:
            missing = sorted(set(keys) ^ set(sd))[:5]
            raise ValueError(f"input {i} has different tensors than input 0 (e.g. {missing}): architectures differ")
    weights = list(weights) if weights is not None else [1.0 / len(state_dicts)] * len(state_dicts)
    out = {}
    for k in keys:
        ref = state_dicts[0][k]
        if any(sd[k].shape != ref.shape for sd in state_dicts):
            raise ValueError(f"tensor {k!r} has different shapes across inputs: architectures differ")
        if not ref.is_floating_point():
            out[k] = ref.clone()
            continue
        acc = torch.zeros_like(ref, dtype=torch.float64)
        for w, sd in zip(weights, state_dicts):
            acc.add_(sd[k].to(acc.device, torch.float64), alpha=w)
        out[k] = acc.to(ref.dtype)
    return out


def check_same_masks(models: Sequence[nn.Module]) -> Masks:
    """The shared mask of ``models``; raises if any prunable tensor's zero pattern differs."""
    ref = masks_from_model(models[0])
    for i, model in enumerate(models[1:], 1):
        other = masks_from_model(model)
        for name, mask in ref.items():
            differ = int((mask != other[name]).sum())
            if differ:
                raise ValueError(
                    f"model {i} and model 0 have different masks ({differ} entries of {name!r} differ), so their "
                    "average would not be sparse. Merge only replicas retrained from the same pruned model, or "
                    "ask for IMP-RePrune behaviour with reprune_sparsity=<target>."
                )
    return ref


def _soup_model(template: nn.Module, state_dict: StateDict) -> nn.Module:
    soup = copy.deepcopy(template)
    soup.load_state_dict(state_dict)
    return soup


@register_merge("uniform")
def uniform_soup(
    models: Sequence[nn.Module], reprune_sparsity: float | None = None, allocation: str = "global", **_
) -> nn.Module:
    """UniformSoup: the elementwise mean of ``models`` (lambda_i = 1/m).

    Args:
        models: replicas retrained under the same mask.
        reprune_sparsity: IMP-RePrune: allow differing masks, average, then magnitude-prune the mean to
            this sparsity with ``allocation``.

    Returns:
        A new model; BatchNorm statistics are the mean ones, recalibrate before evaluating.
    """
    if reprune_sparsity is None:
        check_same_masks(models)
    soup = _soup_model(models[0], average_state_dicts([m.state_dict() for m in models]))
    if reprune_sparsity is not None:
        apply_masks(soup, compute_masks(soup, reprune_sparsity, allocation))
    return soup


def greedy_select(
    scores: Sequence[float], trial_metric: Callable[[list[int]], float], keep_ties: bool = False
) -> tuple[list[int], float]:
    """GreedySoup's selection (Wortsman et al. 2022): best-first, keep a candidate only if it helps.

    Args:
        scores: validation metric of each candidate (higher is better).
        trial_metric: validation metric of the soup of the candidates at the given indices.
        keep_ties: keep a candidate whose trial ties the current metric (``>=``, as the SMS code).

    Returns:
        ``(kept indices, metric of their soup)``; the metric is never below the best candidate's.
    """
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    kept, best = [order[0]], scores[order[0]]
    for i in order[1:]:
        metric = float(trial_metric(kept + [i]))
        if metric > best or (keep_ties and metric == best):
            kept, best = kept + [i], metric
    return kept, best


@register_merge("greedy")
def greedy_soup(
    models: Sequence[nn.Module],
    evaluate: Callable[[nn.Module], float],
    recalibrate: Callable[[nn.Module], object] | None = None,
    scores: Sequence[float] | None = None,
    keep_ties: bool = False,
    **_,
) -> nn.Module:
    """GreedySoup: add candidates best-first while the validation metric improves (METHOD §4).

    Args:
        models: replicas retrained under the same mask.
        evaluate: validation metric of a model, higher is better. Never pass test data.
        recalibrate: called on every trial soup (and candidate) before ``evaluate`` (BatchNorm).
        scores: the candidates' validation metrics if already known (else computed with ``evaluate``).
        keep_ties: keep a candidate whose trial soup ties the current metric.

    Returns:
        The soup, with ``soup.greedy_info = {"order", "kept", "scores", "metric"}`` attached.
    """
    check_same_masks(models)
    state_dicts = [m.state_dict() for m in models]

    def soup_of(indices: list[int]) -> nn.Module:
        return _soup_model(models[0], average_state_dicts([state_dicts[j] for j in indices]))

    def metric(indices: list[int]) -> float:
        trial = soup_of(indices)
        if recalibrate is not None:
            recalibrate(trial)
        return float(evaluate(trial))

    scores = list(scores) if scores is not None else [metric([i]) for i in range(len(models))]
    kept, best = greedy_select(scores, metric, keep_ties)
    soup = soup_of(kept)
    soup.greedy_info = {"order": sorted(range(len(scores)), key=lambda i: -scores[i]), "kept": kept,
                        "scores": scores, "metric": best}  # fmt: skip
    return soup


def merge(method: str, models: Sequence[nn.Module], **kwargs) -> nn.Module:
    if method not in MERGE_METHODS:
        raise ValueError(f"unknown merge method {method!r}; choose one of {sorted(MERGE_METHODS)}")
    return MERGE_METHODS[method](models, **kwargs)
