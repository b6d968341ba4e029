"""Several named evaluations per run: every row and the dense model carry each; OOD means are the means of
their parts; subgroup details are kept (docs/method.md §8)."""

import statistics

import pytest
import torch
from conftest import sms_config

from hf_sms import run_sms
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy, MeanOverSets, SubgroupRecall, named_tests
from hf_sms.records.results import format_table, reported_tests


def corrupted(test, kind: str, severity: int, seed: int = 0) -> TensorDictDataset:
    """Digits test images with Gaussian noise or a brightness shift of the given severity."""
    g = torch.Generator().manual_seed(seed)
    x = (
        test.x + 0.15 * severity * torch.randn(test.x.shape, generator=g)
        if kind == "noise"
        else test.x + 0.2 * severity
    )
    return TensorDictDataset(x, test.labels)


class Grouped(torch.utils.data.Dataset):
    """Digits with a group attribute: even image index or odd."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return {**self.base[i], "group": i % 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    train, val, test = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:128], train.labels[:128], train.augment)
    ood = {(kind, s): corrupted(test, kind, s) for kind in ("noise", "bright") for s in (1, 2)}
    tests = {
        "test": test,
        "ood": (ood, MeanOverSets(ClassificationAccuracy())),
        "groups": (Grouped(test), SubgroupRecall()),
    }
    args = sms_config(tmp_path_factory.mktemp("named"), baselines=["imp"])
    torch.manual_seed(0)
    _, results = run_sms(
        DigitsResNet(width=4), args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=tests
    )
    return results


def test_every_row_and_the_dense_model_carry_every_test_set(run):
    for method, rows in run["rows"].items():
        for row in rows:
            assert set(row["tests"]) == {"test", "ood", "groups"}, method
            assert row["test"] == row["tests"]["test"]
            assert all(0.0 <= v <= 100.0 for v in row["tests"].values())
    for method in ("sms_uniform", "imp"):  # measured models keep the metrics' details
        assert set(run["rows"][method][-1]["details"]) == {"ood", "groups"}
    dense = run["dense"]
    assert set(dense["tests"]) == {"test", "ood", "groups"} and dense["sparsity"] == 0.0
    assert reported_tests(run) == ["test", "ood", "groups"]
    table = format_table([run], "ood")
    assert "dense (unpruned)" in table and "SMS (uniform)" in table


def test_ood_value_is_the_mean_of_its_parts(run):
    for row in (run["dense"], run["rows"]["sms_uniform"][-1]):
        details = row["details"]["ood"]
        assert row["tests"]["ood"] == pytest.approx(statistics.mean(details["per_set"].values()))
        assert set(details["per_corruption"]) == {"noise", "bright"} and set(details["per_severity"]) == {"1", "2"}
        # equal-sized parts: the mean of the per-corruption means is the overall mean
        assert statistics.mean(details["per_corruption"].values()) == pytest.approx(row["tests"]["ood"])
        noise = [v for k, v in details["per_set"].items() if k.startswith("noise/")]
        assert details["per_corruption"]["noise"] == pytest.approx(statistics.mean(noise))


def test_subgroup_details_are_kept(run):
    groups = run["rows"]["sms_uniform"][-1]["details"]["groups"]
    assert groups["worst_group_recall"] == min(groups["per_group"].values()) == groups["value"]


def test_named_tests_accepts_a_dataset_a_mapping_and_pairs():
    metric = ClassificationAccuracy()
    other = MeanOverSets(metric)
    assert named_tests(None, metric) == {}
    assert named_tests([1], metric) == {"test": ([1], metric)}
    assert named_tests({"a": [1], "b": ([2], other)}, metric) == {"a": ([1], metric), "b": ([2], other)}


def test_the_table_command_prints_every_test_set(run, tmp_path, capsys):
    import json

    from hf_sms.cli import main

    path = tmp_path / "results.json"
    path.write_text(json.dumps(run))
    assert main(["table", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}:" in out for name in ("test", "ood", "groups")) and "dense (unpruned)" in out
    assert main(["table", str(path), "--split", "ood"]) == 0
    assert capsys.readouterr().out.startswith("ood:")
