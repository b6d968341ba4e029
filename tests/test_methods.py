"""Pruning during training through the loop: GMP, DPF, BIMP, each plain and +SMS (docs/method.md §7)."""

import json

import pytest
import torch
from conftest import sms_config

from hf_sms import SparseModelSoup, run_sms, sparsity_report
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.methods.gmp import gmp_phases, gmp_sparsity
from hf_sms.pruning.masks import masks_from_model


def _args(tmp_path, **kw):
    return sms_config(tmp_path, **{**dict(num_replicas=1, max_steps=16, pruning_steps=3), **kw})


def _net():
    torch.manual_seed(0)
    return DigitsResNet(width=4)


@pytest.fixture(scope="module")
def digits():
    train, val, test = load_digits_splits(seed=0)
    return TensorDictDataset(train.x[:64], train.labels[:64], train.augment), val, test


@pytest.mark.parametrize("method", ["gmp", "dpf"])
def test_plain_method_is_one_run_that_ends_at_the_target(tmp_path, digits, method):
    train, val, test = digits
    args = _args(tmp_path, pruning_method=method)
    soup, results = run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=test)
    assert sparsity_report(soup)["sparsity"] == pytest.approx(0.8, abs=1e-3)
    assert list(results["rows"]) == [method] and results["phases"] == [0.8]
    assert results["dense"]["sparsity"] == 0.0 and results["sms"] == []


@pytest.mark.parametrize("method", ["gmp", "dpf"])
def test_sms_variant_merges_exactly_at_the_pruning_steps(tmp_path, digits, method):
    train, val, test = digits
    args = _args(tmp_path, pruning_method=method, num_replicas=2)
    runner = SparseModelSoup(_net(), args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=test)
    trained, merged = [], []
    train_replica, run_phase = runner.train_replica, runner.run_phase

    def spy_train(start, step, hparams, name, callbacks=(), **kw):
        trained.append((name, hparams.max_steps, kw.get("step_offset", 0)))
        return train_replica(start, step, hparams, name, callbacks, **kw)

    def spy_phase(spec):
        result = run_phase(spec)
        merged.append(masks_from_model(result.soup))
        return result

    runner.train_replica, runner.run_phase = spy_train, spy_phase
    soup = runner.run()
    phases = gmp_phases(16, 3, 0.8)  # [(0, 4, 0), (4, 8, s1), (8, 12, s2), (12, 16, 0.8)]
    assert trained[0] == (f"{method}/plain", 4, 0)  # dense until the first pruning step
    expected = [
        (f"{method}-sms/phase{p + 1}/replica{i}", b - a, a) for p, (a, b, _) in enumerate(phases[1:]) for i in (0, 1)
    ]
    assert trained[1:] == expected
    rows = runner.results["rows"]["sms_uniform"]
    targets = [gmp_sparsity(k, 3, 0.8) for k in (1, 2, 3)]
    assert [r["sparsity"] for r in rows] == pytest.approx(targets, abs=2e-3)
    assert runner.results["phases"] == pytest.approx(targets)
    assert sparsity_report(soup)["sparsity"] == pytest.approx(0.8, abs=1e-3)
    if method == "gmp":  # every soup keeps its phase's mask, and masks only grow
        assert len(merged) == 3
        for before, after in zip(merged, merged[1:]):
            assert all(not bool((~before[n] & after[n]).any()) for n in before)


def test_sms_starts_from_the_chosen_epoch(tmp_path, digits):
    train, val, _ = digits
    # 64 items, batch 32: 2 steps per epoch; 8 epochs = 16 steps; copies from epoch 5 (step 10) on.
    args = _args(tmp_path, pruning_method="gmp", num_replicas=2, max_steps=-1, num_train_epochs=8, sms_start_epoch=5)
    runner = SparseModelSoup(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)
    names = []
    train_replica = runner.train_replica

    def spy(start, step, hparams, name, callbacks=(), **kw):
        names.append((name, hparams.max_steps))
        return train_replica(start, step, hparams, name, callbacks, **kw)

    runner.train_replica = spy
    runner.run()
    assert names == [("gmp/plain", 12), ("gmp-sms/phase1/replica0", 4), ("gmp-sms/phase1/replica1", 4)]


def test_bimp_splits_its_budget_into_pretraining_and_cycles(tmp_path, digits):
    train, val, _ = digits
    args = _args(
        tmp_path,
        pruning_method="bimp",
        num_replicas=2,
        max_steps=-1,
        num_train_epochs=5,
        bimp_pretrain_epochs=2,
        n_phases=3,
        sms_start_epoch=3,
        retrain_schedule="llr",
    )
    runner = SparseModelSoup(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)
    seen = []
    train_replica = runner.train_replica

    def spy(start, step, hparams, name, callbacks=(), **kw):
        seen.append((name, hparams.num_train_epochs))
        return train_replica(start, step, hparams, name, callbacks, **kw)

    runner.train_replica = spy
    soup = runner.run()
    assert seen == [("bimp-pretrain", 2)]  # dense pretraining inside the budget; the cycles are the SMS loop
    # Cycles of (5 - 2) / 3 = 1 epoch at epochs 2, 3, 4: one copy before sms_start_epoch=3, then m = 2.
    cycles = tmp_path / "run" / "bimp" / "sms"
    found = sorted(str(p.relative_to(cycles)) for p in cycles.glob("phase*/replica*"))
    assert found == ["phase1/replica0", "phase2/replica0", "phase2/replica1", "phase3/replica0", "phase3/replica1"]
    assert [len(d["candidates_val"]) for d in runner.results["sms"]] == [1, 2, 2]
    trained = json.loads((cycles.parent / "run.json").read_text())["config"]
    assert (trained["num_train_epochs"], trained["pretrain_epochs"], trained["replicas_per_phase"]) == (
        1.0,
        2,
        [1, 2, 2],
    )
    assert sparsity_report(soup)["sparsity"] == pytest.approx(0.8, abs=1e-3)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pruning_method": "gmp", "pruning_steps": 0}, "pruning_steps must be an integer >= 1"),
        ({"pruning_method": "dpf", "dpf_interval": 0}, "dpf_interval must be an integer >= 1"),
        ({"pruning_method": "gmp", "max_steps": -1, "num_train_epochs": 4, "sms_start_epoch": 4}, "sms_start_epoch"),
        ({"pruning_method": "bimp", "max_steps": -1, "num_train_epochs": 4}, "bimp needs 0 < bimp_pretrain_epochs"),
        ({"pruning_method": "gmp", "baselines": ["imp"]}, "baselines compare against IMP"),
        ({"pruning_method": "lth"}, "pruning_method='lth': unknown pruning method 'lth'; choose one of .* or 'imp'"),
    ],
)
def test_bad_parameters_are_rejected_before_work(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **fields)
