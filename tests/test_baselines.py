"""The paper's appendix baselines beside SMS (issue 38 item 3): IMP + SWA ends each phase on the average of its
epochs' end weights, mask kept; IMP with m phases (its schedule: tests/test_loop_schedule.py; 1 vs 2 processes:
tests/test_loop_parallel.py)."""

import copy
from pathlib import Path

import pytest
import torch
from conftest import sms_config
from transformers import TrainerCallback

from hf_sms import load_sparse, run_sms
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
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


def _tracks(n: int, sparsity: float) -> list[torch.nn.Module]:
    """``n`` small models, each magnitude-pruned on its own (their masks differ, as independent IMP runs')."""
    from hf_sms import compute_masks
    from hf_sms.pruning.masks import apply_masks

    models = []
    for i in range(n):
        torch.manual_seed(i)
        model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
        apply_masks(model, compute_masks(model, sparsity))
        models.append(model)
    return models


def _superposed_reference(models, weights, sparsity):
    """Sup-tickets' superposition written out: the running soup re-pruned (global magnitude) after every join."""
    from hf_sms import compute_masks
    from hf_sms.pruning.masks import apply_masks

    running = copy.deepcopy(models[0])
    for model, w in zip(models[1:], weights):
        mixed = {k: (1 - w) * v.double() + w * model.state_dict()[k].double() for k, v in running.state_dict().items()}
        running.load_state_dict({k: v.float() for k, v in mixed.items()})
        apply_masks(running, compute_masks(running, sparsity))
    return running


@pytest.mark.parametrize(("method", "weights"), [("reprune_caa", [1 / 2, 1 / 3, 1 / 4]), ("reprune_cia", [0.5] * 3)])
def test_cia_and_caa_superpose_one_at_a_time_and_reprune_after_each(method, weights):
    from hf_sms import compute_masks, uniform_soup
    from hf_sms.soup import soup

    models = _tracks(4, 0.6)
    merged, _ = soup(models, method, sparsity=0.6, reprune=lambda m, s: compute_masks(m, s))
    reference = _superposed_reference(models, weights, 0.6)
    for (name, got), want in zip(merged.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(got, want, atol=1e-6), name
    kept = sum(int((p != 0).sum()) for n, p in merged.named_parameters() if n.endswith("weight"))
    assert kept == round(0.4 * (12 * 10 + 10 * 3))  # the phase's sparsity, exactly
    plain = uniform_soup(models, reprune_sparsity=0.6)  # re-pruning once at the end is another model
    assert not torch.allclose(plain[0].weight, merged[0].weight)
    if method == "reprune_caa":  # nothing to re-prune: the cumulative mean is the plain mean
        dense, _ = soup(models, method, sparsity=0.0, reprune=lambda m, s: compute_masks(m, s))
        assert torch.allclose(dense[0].weight, uniform_soup(models, reprune_sparsity=0.0)[0].weight, atol=1e-6)


def test_cia_decay_is_an_option_of_its_baseline(tmp_path):
    args = sms_config(tmp_path, baselines=["imp_reprune_cia"], soup_options={"reprune_cia": {"decay": 0.25}})
    assert args.soup_options["reprune_cia"] == {"decay": 0.25}
    with pytest.raises(ValueError, match="does not run"):
        sms_config(tmp_path, baselines=["imp_reprune"], soup_options={"reprune_cia": {"decay": 0.25}})
    with pytest.raises(ValueError, match="decay"):
        sms_config(tmp_path, baselines=["imp_reprune_cia"], soup_options={"reprune_cia": {"decay": 0}})


def test_imp_reprune_cia_and_caa_merge_the_same_tracks(tmp_path):
    """One set of m IMP tracks serves every IMP-RePrune asked for; each row is its own merge of those tracks."""
    from hf_sms import compute_masks
    from hf_sms.soup import soup

    train, val, test = load_digits_splits(seed=0)
    args = sms_config(tmp_path, baselines=["imp_reprune_caa", "imp_reprune_cia"], recalibrate_bn=False, n_phases=1)
    torch.manual_seed(0)
    model, accuracy = DigitsResNet(width=4), ClassificationAccuracy()
    _, results = run_sms(model, args, train, accuracy, eval_dataset=val, test_dataset=test)
    rows = results["rows"]
    assert {"imp", "imp_reprune_cia", "imp_reprune_caa"} <= set(rows) and "imp_reprune" not in rows
    folder = tmp_path / "run" / "imp" / "phase1"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["track0", "track1"]  # trained once
    tracks = [load_sparse(str(folder / f"track{i}"), DigitsResNet(width=4)) for i in range(2)]
    for name in ("reprune_caa", "reprune_cia"):
        merged, _ = soup(tracks, name, sparsity=0.8, reprune=lambda m, s: compute_masks(m, s))
        assert rows["imp_" + name][0]["test"] == accuracy(merged, test)
