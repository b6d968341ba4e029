"""Silent wrong results turned into errors (or warnings) before any work, and the paper's protocol where it
differed: each test here failed before its fix (issue 14)."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import sms_config
from torch import nn

from hf_sms import SparseModelSoup, run_sms
from hf_sms.data import load_digits_splits, split_validation
from hf_sms.demo import DigitsResNet
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.evaluation.subgroups import subgroup_recall


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits(seed=0)


# -- 14: the validation split never depends on the run's seed -------------------------------------------------------
def test_the_validation_split_is_the_same_for_every_seed(tmp_path, digits):
    train, _, _ = digits
    splits = []
    for seed in (0, 1):
        runner = SparseModelSoup(
            DigitsResNet(4), sms_config(tmp_path / str(seed), seed=seed), train, ClassificationAccuracy()
        )
        splits.append(sorted(runner.eval_dataset.indices))
    assert splits[0] == splits[1] == sorted(split_validation(train, 0.1)[1].indices)


def test_the_recipes_split_validation_with_a_fixed_seed(tmp_path):
    import datasets

    from hf_sms import SparseSoupConfig
    from hf_sms.scripts import DataArguments, prepared_splits

    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": list(range(100)), "labels": [0] * 100})})
    vals = []
    for seed in (0, 7):
        args = SparseSoupConfig(output_dir=str(tmp_path), seed=seed, report_to="none", use_cpu=True)
        _, val, _ = prepared_splits(raw, lambda data, training: data, args, DataArguments())
        vals.append(sorted(val["x"]))
    assert vals[0] == vals[1]


# -- 6: pruning-during-training combinations that ran something else than asked ------------------------------------
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pruning_method": "dpf", "merge_methods": ["greedy"]}, "DPF's copies each move their own mask"),
        ({"pruning_method": "gmp", "merge_methods": ["uniform", "greedy"]}, "runs one SMS trajectory"),
        ({"pruning_method": "gmp", "max_steps": 20, "num_train_epochs": 10, "sms_start_epoch": 9.5}, "after the last"),
        (
            {
                "pruning_method": "bimp",
                "max_steps": -1,
                "num_train_epochs": 10,
                "bimp_pretrain_epochs": 4,
                "n_phases": 2,
                "sms_start_epoch": 8,
            },
            "after the start of BIMP's last cycle",
        ),
    ],  # fmt: skip
)
def test_pruning_during_training_refuses_what_it_would_not_run(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        sms_config(tmp_path, num_replicas=2, pruning_steps=3, **fields)


# -- 7: a subgroup without test items is reported, not dropped --------------------------------------------------
def test_a_missing_subgroup_is_reported_as_missing():
    predicted, labels = torch.tensor([0, 1, 1, 0]), torch.tensor([0, 1, 1, 0])
    groups = ["female", "female", "male", "female"]  # no blond man: (male, 0) has no items
    with pytest.warns(UserWarning, match="no test items"):
        result = subgroup_recall(predicted, labels, groups)
    assert result["missing"] == ["group=male,class=0"]
    assert result["per_group"]["group=male,class=0"] is None and result["counts"]["group=male,class=0"] == 0
    assert "missing: group=male,class=0" in result["worst_group"]


# -- 8: structured pruning of a model without convolutions, and replicas trained under another mask ------------
def test_filter_pruning_without_convolutions_is_refused_before_work(tmp_path, digits):
    train, val, _ = digits
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with pytest.raises(ValueError, match="prunes conv layers only"):
        SparseModelSoup(mlp, sms_config(tmp_path, allocation="filter_l2"), train, ClassificationAccuracy(), val)
    assert not (tmp_path / "run").exists()


def _net():
    torch.manual_seed(0)
    return DigitsResNet(4)


def test_a_replica_trained_under_another_mask_is_refused_naming_its_folder(tmp_path, digits):
    train, val, _ = digits
    args = sms_config(tmp_path, n_phases=1, num_replicas=2, max_steps=2, measure_speedup=False)
    run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)
    other = sms_config(tmp_path / "other", n_phases=1, num_replicas=2, max_steps=2, target_sparsity=0.5)
    run_sms(_net(), other, train, ClassificationAccuracy(), eval_dataset=val)
    replica = tmp_path / "run" / "sms" / "phase1" / "replica1"
    shutil.rmtree(replica)
    shutil.copytree(tmp_path / "other" / "run" / "sms" / "phase1" / "replica1", replica)  # denser: another mask
    (tmp_path / "run" / "final_soup" / "sparsity.json").unlink()
    with pytest.raises(ValueError, match=r"phase1/replica1 holds weights where this phase's mask prunes them"):
        run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)
