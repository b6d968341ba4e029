"""The soup of replicas that trained a subset of the model, from their trained tensors (docs/replicas.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..registry import SOUPS
from ..soup.method import SoupMethod
from .replica import make_replica, soup_of_states

StateDict = dict[str, torch.Tensor]


def subset_soup(
    start: nn.Module,
    states: Sequence[StateDict],
    method: str | SoupMethod,
    args,
    scores: Sequence[float | None],
    evaluate: Callable[[nn.Module], float] | None = None,
    recalibrate: Callable[[nn.Module], nn.Module] | None = None,
    template: nn.Module | None = None,
) -> tuple[nn.Module, list[float]]:
    """The soup of replicas that trained a subset of ``start`` (``args.replica_params``), from their trained states
    (:func:`hf_sms.adapters.replica.trained_state`, every replica's on every process): ``start`` plus the weighted
    sum of their updates, one layer at a time (never m models), with ``start``'s zeros exactly. ``method`` must be a
    weighted mean (``combine is None``, one mask): uniform, greedy. ``template``: a replica of ``start`` made with
    ``args``, built once for every trial soup."""
    spec = SOUPS.get(method) if isinstance(method, str) else method
    template = template if template is not None else make_replica(start, args)
    if not spec.weighted_mean:
        raise ValueError("a soup of subset replicas is a weighted mean under one mask: use uniform or greedy")

    def build(weights: list[float]) -> nn.Module:
        used = [i for i, w in enumerate(weights) if w]
        model = soup_of_states(start, [states[i] for i in used], [weights[i] for i in used], args, template)
        return recalibrate(model) if recalibrate is not None else model

    def trial(weights: list[float]) -> float:
        if evaluate is None:
            raise ValueError("this soup method evaluates trial soups: pass evaluate=<validation metric>")
        return float(evaluate(build(weights)))

    weights = spec.select(list(scores), trial, args)
    return build(weights), weights
