"""The in-memory soups of the README: :func:`uniform_soup` (also IMP-RePrune's re-pruned mean) and
:func:`greedy_soup`, each one call of :func:`hf_sms.soup.soup` on models held in this process."""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Sequence

from torch import nn

from ..plan import compute_masks
from .soup import soup


def uniform_soup(models: Sequence[nn.Module], reprune_sparsity: float | None = None, allocation: str = "global"):
    """UniformSoup: the elementwise mean of ``models`` (lambda_i = 1/m).

    Args:
        models: replicas retrained under the same mask.
        reprune_sparsity: IMP-RePrune: allow differing masks, average, then magnitude-prune the mean to
            this sparsity with ``allocation`` (the ``"reprune"`` soup).

    Returns:
        A new model; BatchNorm statistics are the mean ones, recalibrate before evaluating.
    """
    method = "uniform" if reprune_sparsity is None else "reprune"
    return soup(models, method, sparsity=reprune_sparsity, reprune=lambda m, s: compute_masks(m, s, allocation))[0]


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

    def recal(model):
        if recalibrate is not None:
            recalibrate(model)
        return model

    if scores is None:
        scores = [float(evaluate(recal(copy.deepcopy(m)))) for m in models]
    config = types.SimpleNamespace(greedy_keep_ties=keep_ties)
    result, weights = soup(models, "greedy", scores=scores, evaluate=evaluate, recalibrate=recal, config=config)
    order = sorted(range(len(models)), key=lambda i: -scores[i])
    kept = [i for i in order if weights[i]]
    result.greedy_info = {"order": order, "kept": kept, "scores": list(scores), "metric": float(evaluate(result))}
    return result
