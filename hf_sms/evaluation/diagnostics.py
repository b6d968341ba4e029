"""Whether a soup can gain: how differently the replicas of a phase predict (docs/method.md §8-§9).

A soup can only beat its candidates where they disagree in useful ways while staying in one basin. So
per phase the loop records the replicas' prediction ensemble and, on validation, how often two replicas
predict different classes and what the ensemble gains over the best replica; it warns when the replicas
are near copies, and says what to vary.
"""

from __future__ import annotations

import logging

from .sharded import predict_shared

logger = logging.getLogger("hf_sms")
# Below this mean pairwise disagreement (% of validation examples) replicas are near copies.
MIN_DISAGREEMENT = 0.5


def disagreement(labels: dict) -> float:
    """Mean over replica pairs of the % of examples on which two replicas' predicted labels differ."""
    keys = sorted(labels)
    rates = [100.0 * float((labels[i] != labels[j]).float().mean()) for i in keys for j in keys if i < j]
    return sum(rates) / len(rates) if rates else 0.0


def diversity(metric_fn, world, candidates: dict, val: list[float], eval_dataset, test_dataset) -> dict:
    """The ensemble per split and, on validation, disagreement and ensemble minus the best candidate.

    ``candidates`` are this process's replicas (``world`` gathers the rest), ``val`` the validation scores of
    all m. Needs a metric with
    ``predict`` (class probabilities, classes in the last dimension) and ``score``, as
    :class:`hf_sms.evaluation.metrics.ClassificationAccuracy`; otherwise ``{}``.
    """
    if not (hasattr(metric_fn, "predict") and hasattr(metric_fn, "score")):
        return {}
    shared = hasattr(metric_fn, "predict_targets") and hasattr(metric_fn, "score_targets")
    out = {}
    for split, dataset in (("val", eval_dataset), ("test", test_dataset)):
        if dataset is None:
            continue
        if shared:  # the processes holding a replica (its data-parallel group) share its predictions
            group = getattr(world, "group", None)
            predicted = {i: predict_shared(metric_fn, c, dataset, group) for i, c in candidates.items()}
            preds = {i: probs for i, (probs, _) in predicted.items()}
        else:
            preds = {i: metric_fn.predict(c, dataset) for i, c in candidates.items()}
        labels = world.gather({i: t.argmax(-1) for i, t in preds.items()})
        shape = next(iter(world.gather({i: tuple(t.shape) for i, t in preds.items()}).values()))  # a rank may own none
        mean = world.sum_tensors(preds, shape) / len(val)
        if shared:  # scored where this process has the targets (it holds a replica), the value shared
            targets = next((t for _, t in predicted.values()), None)
            scores = world.all_gather(metric_fn.score_targets(mean, targets) if targets is not None else None)
            out[f"ensemble_{split}"] = float(next(v for v in scores if v is not None))
        else:
            out[f"ensemble_{split}"] = float(metric_fn.score(mean, dataset))
        if split == "val":
            out["disagreement_val"] = disagreement(labels)
            out["ensemble_minus_best_val"] = out["ensemble_val"] - max(val)
    return out


def log_diversity(diag: dict) -> None:
    """One line per phase; a warning with what to vary when the replicas are near copies."""
    l2 = diag["pairwise_l2"]
    mean_l2 = _fmt(sum(l2) / len(l2) if l2 else None)
    if diag.get("disagreement_val") is None:  # a metric without class predictions: no ensemble to measure
        logger.info(
            "[hf-sms] phase %d replicas: mean pairwise L2 %s (disagreement and the ensemble need a metric with "
            "class predictions, as ClassificationAccuracy has)",
            diag["phase"],
            mean_l2,
        )
        return
    logger.info(
        "[hf-sms] phase %d replicas: disagreement %s%% of val, ensemble - best %s, mean pairwise L2 %s",
        diag["phase"],
        _fmt(diag.get("disagreement_val")),
        _fmt(diag.get("ensemble_minus_best_val")),
        mean_l2,
    )
    if len(diag["candidates_val"]) > 1 and diag.get("disagreement_val", MIN_DISAGREEMENT) < MIN_DISAGREEMENT:
        logger.warning(
            "[hf-sms] phase %d: the replicas disagree on only %.2f%% of validation examples, so a soup cannot gain "
            "over its candidates. Make them differ more: independent seeds with data augmentation, different "
            "weight decays (replica_weight_decays) or learning rates (replica_learning_rates), or longer "
            "retraining (num_train_epochs)",
            diag["phase"],
            diag["disagreement_val"],
        )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
