"""Evaluation: metrics (top-1 accuracy with the prediction ensemble, BLEU, mean IoU), named test sets, subgroup
recall, corrupted test sets (``hf_sms.evaluation.corruptions``, the ``ood`` extra), the replicas' diversity, the
FLOP count, and evaluation shared by a run's processes (``sharded``)."""

from .flops import theoretical_speedup
from .metrics import BleuMetric, ClassificationAccuracy, MeanIoU, MetricFn, NegativePerplexity, predict_proba
from .named import MeanOverSets, measure, metric_name, named_tests
from .sharded import evaluate, is_batch_metric
from .subgroups import SubgroupRecall

__all__ = [
    "BleuMetric",
    "ClassificationAccuracy",
    "MeanIoU",
    "NegativePerplexity",
    "MeanOverSets",
    "MetricFn",
    "SubgroupRecall",
    "evaluate",
    "is_batch_metric",
    "measure",
    "metric_name",
    "named_tests",
    "predict_proba",
    "theoretical_speedup",
]
