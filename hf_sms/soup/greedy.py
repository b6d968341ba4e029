"""GreedySoup (Wortsman et al. 2022): candidates best-first, each kept only if the soup's validation metric
improves, so the soup is never worse on validation than its best candidate."""

from collections.abc import Callable, Sequence

from ..registry import SOUPS
from .method import SoupMethod, indicator_weights


def greedy_select(
    scores: Sequence[float], trial_metric: Callable[[list[int]], float], keep_ties: bool = False
) -> tuple[list[int], float]:
    """GreedySoup's selection.

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


def greedy_weights(scores, trial, config) -> list[float]:
    keep_ties = bool(getattr(config, "greedy_keep_ties", False))
    kept, _ = greedy_select(scores, lambda idx: trial(indicator_weights(idx, len(scores))), keep_ties)
    return indicator_weights(kept, len(scores))


# never below its best candidate on validation: the contract tests hold it to that
SOUPS.add("greedy", SoupMethod(greedy_weights, needs_validation=True), never_worse=True)
