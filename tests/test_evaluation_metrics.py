"""Metrics: mean IoU by hand, theoretical speedup, accuracy and the ensemble score."""

import pytest
import torch
from torch import nn

from hf_sms import apply_masks, compute_masks
from hf_sms.data import TensorDictDataset
from hf_sms.evaluation import ClassificationAccuracy, MeanIoU, theoretical_speedup


class Fixed(nn.Module):
    """Returns stored logits for the batch's indices (x holds the index)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self, x):
        return self.logits[x.long()]


def test_mean_iou_by_hand():
    # one 2x2 image, 2 classes: labels [[0, 0], [1, -100]], prediction [[0, 1], [1, 1]]
    pred = torch.tensor([[[0, 1], [1, 1]]])
    logits = torch.nn.functional.one_hot(pred, 2).permute(0, 3, 1, 2).float()
    data = TensorDictDataset(torch.tensor([0]), torch.tensor([[[0, 0], [1, -100]]]))
    # class 0: inter 1, union 2 -> 0.5; class 1: inter 1, union 2 -> 0.5; ignored pixel skipped
    assert MeanIoU(num_classes=2)(Fixed(logits), data) == pytest.approx(50.0)


class Counting(torch.utils.data.Dataset):
    def __init__(self, inner):
        self.inner, self.reads = inner, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        self.reads += 1
        return self.inner[i]


def test_accuracy_and_ensemble_score():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    data = Counting(TensorDictDataset(torch.arange(3), torch.tensor([0, 1, 1])))
    metric = ClassificationAccuracy()
    assert metric(Fixed(logits), data) == pytest.approx(200 / 3)
    other = Fixed(torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 9.0]]))
    mean = (metric.predict(Fixed(logits), data) + metric.predict(other, data)) / 2
    reads = data.reads
    assert metric.score(mean, data) == pytest.approx(100.0)  # the ensemble fixes the third sample
    assert data.reads == reads  # the labels come from the last predict: the data is not read again


def test_theoretical_speedup_counts_only_live_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 10))
    x = torch.randn(4, 10)
    assert theoretical_speedup(model, x) == pytest.approx(1.0)
    apply_masks(model, compute_masks(model, 0.75, "uniform"))
    assert theoretical_speedup(model, x) == pytest.approx(4.0)
    conv = nn.Conv2d(2, 4, 3, groups=2)
    with torch.no_grad():
        conv.weight[:2] = 0  # half the filters
    assert theoretical_speedup(conv, torch.randn(1, 2, 5, 5)) == pytest.approx(2.0)


def test_an_evaluate_module_is_a_metric_and_metrics_read_with_the_runs_loader_settings(tmp_path):
    import evaluate
    from conftest import TOP1_METRIC_SCRIPT, sms_config

    from hf_sms import run_sms
    from hf_sms.cli.demo import DigitsResNet
    from hf_sms.data import load_digits_splits

    (tmp_path / "top1.py").write_text(TOP1_METRIC_SCRIPT)
    module = evaluate.load(str(tmp_path / "top1.py"))  # a local script: no download
    train, val, test = load_digits_splits(seed=0)
    accuracy, fixed = ClassificationAccuracy(), ClassificationAccuracy(batch_size=50)
    loading = {"dataloader_num_workers": 1, "per_device_eval_batch_size": 24}
    args = sms_config(tmp_path, n_phases=1, max_steps=2, measure_speedup=False, **loading)
    tests = {"test": test, "top1": (test, module), "fixed": (test, fixed)}
    _, results = run_sms(DigitsResNet(width=4), args, train, accuracy, eval_dataset=val, test_dataset=tests)
    row = results["rows"]["sms_uniform"][-1]
    assert row["tests"]["top1"] == pytest.approx(row["tests"]["test"] / 100)  # the same accuracy, as a fraction
    assert accuracy.loader_kwargs == {"num_workers": 1, "pin_memory": False}  # the run's settings
    assert accuracy.batch_size == 24 and fixed.batch_size == 50  # the run's eval batch size where left open
    assert row["tests"]["fixed"] == row["tests"]["test"]


def test_a_batch_metric_combines_to_the_value_of_one_pass_and_a_half_defined_one_is_refused():
    from hf_sms.evaluation import evaluate
    from hf_sms.evaluation.metrics import as_metric
    from hf_sms.evaluation.sharded import batch_statistics, owned_batches

    assert owned_batches(10, 3, 1, 2) == ([1, 3], [3, 4, 5, 9])  # batches 1 and 3 of 0..3; the last is short
    g = torch.Generator().manual_seed(0)
    data = [{"input": torch.randn(4, generator=g), "labels": torch.tensor(i % 3)} for i in range(50)]
    model = nn.Linear(4, 3)  # batch keys are forward's argument names: Linear.forward(input)
    metric = ClassificationAccuracy(batch_size=8)
    shards = [batch_statistics(metric, model, data, r, 3) for r in range(3)]
    assert sorted(b for s in shards for b in s) == list(range(7))  # every batch once
    merged = {b: v for s in shards for b, v in s.items()}
    assert metric.finish([merged[b] for b in sorted(merged)]) == evaluate(metric, model, data) == metric(model, data)
    with torch.no_grad():
        expected = 100.0 * sum(int(model(r["input"]).argmax() == r["labels"]) for r in data) / 50
    assert metric(model, data) == expected

    class OnlyStatistics:
        def batch_statistics(self, model, batch, device):
            return 0

        def __call__(self, model, dataset):
            return 0.0

    with pytest.raises(ValueError, match="defines only one of batch_statistics and finish"):
        as_metric(OnlyStatistics())
