"""The paper's appendix baselines beside SMS (issue 38 item 3): IMP + SWA ends each phase on the average of its
epochs' end weights, mask kept; IMP with m phases (its schedule: tests/test_loop_schedule.py; 1 vs 2 processes:
tests/test_loop_parallel.py)."""

from pathlib import Path

import torch
from conftest import sms_config
from transformers import TrainerCallback

from hf_sms import load_sparse, run_sms
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.demo import DigitsResNet
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.pruning.masks import masks_from_model


class EpochEnds(TrainerCallback):
    """Every training's weights at each epoch's end, by output folder (runs before the baseline's own callback)."""

    def __init__(self):
        self.seen: dict[str, list[dict]] = {}

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.seen.setdefault(args.output_dir, []).append(weights)


def test_imp_swa_ends_each_phase_on_the_mean_of_its_epochs(tmp_path):
    train, val, test = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:96], train.labels[:96], train.augment)
    args = sms_config(tmp_path, baselines=["imp_swa"], max_steps=-1, num_train_epochs=3, num_replicas=1)
    ends = EpochEnds()
    torch.manual_seed(0)
    model, accuracy = DigitsResNet(width=4), ClassificationAccuracy()
    _, results = run_sms(model, args, train, accuracy, eval_dataset=val, test_dataset=test, callbacks=[ends])
    assert [r["phase"] for r in results["rows"]["imp_swa"]] == [1, 2]
    for p in (1, 2):
        folder = str(tmp_path / "run" / "imp_swa" / f"phase{p}" / "track0")
        snapshots = ends.seen[folder]
        assert len(snapshots) == 3  # one per epoch
        saved = load_sparse(folder, DigitsResNet(width=4))
        for name, param in saved.named_parameters():
            mean = sum(s[name].double() for s in snapshots) / 3
            assert torch.allclose(param.double(), mean, atol=1e-6), name
        assert not torch.equal(saved.fc.weight, snapshots[-1]["fc.weight"])  # not the last epoch's weights
        for name, kept in masks_from_model(saved).items():  # the phase's mask, exactly: zeros where it prunes
            assert torch.equal(kept, snapshots[-1][name] != 0), name
    assert Path(tmp_path / "run" / "imp_swa" / "phase2").is_dir()


def test_swamp_averages_swa_particles_and_keeps_the_mask(tmp_path):
    """SWAMP: each phase's m particles end on their own epoch averages and the next phase starts from their mean;
    its rows sit beside the SMS ones at the same sparsities."""
    from hf_sms import uniform_soup

    train, val, test = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:96], train.labels[:96], train.augment)
    args = sms_config(tmp_path, baselines=["swamp"], max_steps=-1, num_train_epochs=2, recalibrate_bn=False)
    ends = EpochEnds()
    torch.manual_seed(0)
    model, accuracy = DigitsResNet(width=4), ClassificationAccuracy()
    _, results = run_sms(model, args, train, accuracy, eval_dataset=val, test_dataset=test, callbacks=[ends])
    rows = results["rows"]
    assert [r["sparsity"] for r in rows["swamp"]] == [r["sparsity"] for r in rows["sms_uniform"]]
    particles = []
    for i in range(2):
        folder = str(tmp_path / "run" / "swamp" / "phase1" / f"replica{i}")
        saved = load_sparse(folder, DigitsResNet(width=4))
        mean = sum(s["fc.weight"].double() for s in ends.seen[folder]) / 2
        assert torch.allclose(saved.fc.weight.double(), mean, atol=1e-6)  # the particle's own SWA
        particles.append(saved)
    soup = uniform_soup(particles)  # the phase's result, which the row scored (BatchNorm averaged: recalibration off)
    assert rows["swamp"][0]["test"] == accuracy(soup, test)
