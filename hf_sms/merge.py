"""Merging replicas into a soup (docs/method.md §4). Merge methods live in a registry, mergekit-style.

Every merge is a weighted mean of state dicts formed by :mod:`hf_sms.averaging` (float64 sums, integer
buffers from the first input), so inputs that share a mask give a soup with that mask, bit for bit.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .averaging import average_tensors
from .prunable import Masks
from .pruning import apply_masks, compute_masks, masks_from_model
from .registry import registrar

StateDict = dict[str, torch.Tensor]
# A soup method is a policy: (validation scores of the m candidates, trial(weights) -> validation score of
# the soup with those weights, config) -> one weight per candidate (0 leaves a candidate out).
SoupPolicy = Callable[[Sequence[float], Callable[[list[float]], float], object], list[float]]
MERGE_METHODS: dict[str, SoupPolicy] = {}
register_merge = registrar(MERGE_METHODS, "merge method")


def indicator_weights(indices: Sequence[int], n: int) -> list[float]:
    """Uniform weights over ``indices``, 0 for the other of ``n`` candidates."""
    return [1.0 / len(indices) if i in indices else 0.0 for i in range(n)]


@register_merge("uniform")
def uniform_policy(scores, trial, config) -> list[float]:
    """UniformSoup: lambda_i = 1/m."""
    return indicator_weights(range(len(scores)), len(scores))


@register_merge("greedy")
def greedy_policy(scores, trial, config) -> list[float]:
    """GreedySoup (Wortsman et al. 2022): candidates best-first, each kept only if the soup improves."""
    keep_ties = bool(getattr(config, "greedy_keep_ties", False))
    kept, _ = greedy_select(scores, lambda idx: trial(indicator_weights(idx, len(scores))), keep_ties)
    return indicator_weights(kept, len(scores))


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
    out = {}
    for k in keys:
        if any(sd[k].shape != state_dicts[0][k].shape for sd in state_dicts):
            raise ValueError(f"tensor {k!r} has different shapes across inputs: architectures differ")
        out[k] = average_tensors([sd[k] for sd in state_dicts], weights)
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


def uniform_soup(models: Sequence[nn.Module], reprune_sparsity: float | None = None, allocation: str = "global"):
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


def merge(
    models: Sequence[nn.Module],
    method: str = "uniform",
    evaluate: Callable[[nn.Module], float] | None = None,
    recalibrate: Callable[[nn.Module], object] | None = None,
    scores: Sequence[float] | None = None,
    config=None,
) -> nn.Module:
    """The ``method`` soup of ``models`` (any registered policy), recalibrated if asked.

    The soup carries ``soup_weights`` (one per candidate) and ``soup_scores`` (the candidates' scores).

    Args:
        models: replicas retrained under the same mask.
        method: a name in ``MERGE_METHODS``.
        evaluate: validation metric of a model, higher is better (policies that trial soups need it).
        recalibrate: called on every candidate and trial soup before ``evaluate`` (BatchNorm).
        scores: the candidates' validation metrics if already known.
        config: passed to the policy (e.g. a :class:`SparseSoupConfig` with ``greedy_keep_ties``).
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"unknown merge method {method!r}; choose one of {sorted(MERGE_METHODS)}")
    check_same_masks(models)
    state_dicts = [m.state_dict() for m in models]

    def soup_of(weights: list[float]) -> nn.Module:
        used = [i for i, w in enumerate(weights) if w]
        model = _soup_model(models[0], average_state_dicts([state_dicts[i] for i in used], [weights[i] for i in used]))
        if recalibrate is not None:
            recalibrate(model)
        return model

    def trial(weights: list[float]) -> float:
        if evaluate is None:
            raise ValueError(f"merge method {method!r} evaluates trial soups: pass evaluate=<validation metric>")
        return float(evaluate(soup_of(weights)))

    if scores is None:
        scores = (
            [trial(indicator_weights([i], len(models))) for i in range(len(models))]
            if evaluate
            else [0.0] * len(models)
        )
    weights = MERGE_METHODS[method](list(scores), trial, config)
    soup = soup_of(weights)
    soup.soup_weights, soup.soup_scores = weights, list(scores)
    return soup


def greedy_soup(
    models: Sequence[nn.Module],
    evaluate: Callable[[nn.Module], float],
    recalibrate: Callable[[nn.Module], object] | None = None,
    scores: Sequence[float] | None = None,
    keep_ties: bool = False,
) -> nn.Module:
    """GreedySoup: add candidates best-first while the validation metric improves (docs/method.md §4).

    Args:
        models: replicas retrained under the same mask.
        evaluate: validation metric of a model, higher is better. Never pass test data.
        recalibrate: called on every trial soup (and candidate) before ``evaluate`` (BatchNorm).
        scores: the candidates' validation metrics if already known (else computed with ``evaluate``).
        keep_ties: keep a candidate whose trial soup ties the current metric.

    Returns:
        The soup, with ``soup.greedy_info = {"order", "kept", "scores", "metric"}`` attached.
    """
    config = types.SimpleNamespace(greedy_keep_ties=keep_ties)
    soup = merge(models, "greedy", evaluate, recalibrate, scores, config)
    order = sorted(range(len(models)), key=lambda i: -soup.soup_scores[i])
    kept = [i for i in order if soup.soup_weights[i]]
    soup.greedy_info = {"order": order, "kept": kept, "scores": soup.soup_scores, "metric": float(evaluate(soup))}
    return soup
