"""Independent replicas: their own random streams, diversity diagnostics, and the paper's retraining settings."""

import dataclasses
import itertools
import logging
import math

import pytest
import torch
from conftest import sms_config
from torch import nn

from hf_sms import SparseModelSoup, SparseSoupTrainer
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.seeding import EpochShuffleSampler, derive_seed


class Recording(torch.utils.data.Dataset):
    """Items ``{"x": features, "labels": class}`` that log every index asked for, in order."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y, self.seen = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g), []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return {"x": self.x[i], "labels": self.y[i]}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _config(tmp_path, **kw):
    epochs = dict(
        max_steps=-1, num_train_epochs=2, per_device_train_batch_size=64
    )  # whole epochs: one permutation each
    return sms_config(tmp_path, **{**dict(target_sparsity=0.5, num_replicas=3, **epochs), **kw})


def _epochs(seen: list[int], n: int) -> list[tuple[int, ...]]:
    assert len(seen) % n == 0
    return [tuple(seen[k : k + n]) for k in range(0, len(seen), n)]


def test_derived_seeds_differ_and_are_stable():
    keys = [(0, "sms", p, i) for p in range(3) for i in range(5)] + [(0, "imp", p, 0) for p in range(3)]
    seeds = [derive_seed(*k) for k in keys]
    assert len(set(seeds)) == len(seeds)
    assert derive_seed(0, "sms", 1, 2) == derive_seed(0, "sms", 1, 2)  # reproducible
    assert all(0 <= s < 2**32 for s in seeds)
    # A seed and its neighbour give unrelated seeds, not seeds one apart.
    assert abs(derive_seed(1, "sms", 0, 0) - derive_seed(0, "sms", 0, 0)) > 1000


def test_sampler_epochs_and_neighbouring_seeds_never_share_a_permutation():
    perms = []
    for seed, epoch in itertools.product(range(4), range(4)):
        sampler = EpochShuffleSampler(50, seed)
        sampler.set_epoch(epoch)
        perms.append(tuple(sampler))
    assert len(set(perms)) == len(perms)
    assert all(sorted(p) == list(range(50)) for p in perms)


def test_sampler_shards_split_one_permutation():
    shards = [EpochShuffleSampler(11, 7, num_shards=2, shard=r) for r in range(2)]
    for s in shards:
        s.set_epoch(3)
    a, b = (list(s) for s in shards)
    assert len(a) == len(b) == 6
    assert set(a) | set(b) == set(range(11))  # one index repeats to make the shards equal, as DistributedSampler
    whole = EpochShuffleSampler(11, 7)
    whole.set_epoch(3)
    padded = list(whole) + list(whole)[:1]
    assert (a, b) == (padded[0::2], padded[1::2])  # both ranks of a replica share its permutation


def test_no_two_epochs_of_a_run_share_a_data_order(tmp_path):
    """The reproduction of the bug: with ``seed + i`` and ``seed + epoch``, replica i+1's first epoch was replica
    i's second. Now every epoch of every replica and phase has its own permutation, and a rerun repeats them."""
    orders = []
    for run in range(2):
        train, val = Recording(64), Recording(16, seed=1)
        args = _config(tmp_path, output_dir=str(tmp_path / f"run{run}"), baselines=["imp"])
        runner = SparseModelSoup(MLP(), args, train, ClassificationAccuracy(), eval_dataset=val)
        train.seen.clear()  # only what training reads, not the input checks before it
        soup = runner.run()
        orders.append(_epochs(train.seen, 64))
        if run == 0:
            first = soup
    # 2 phases x 3 replicas x 2 epochs, then IMP: 2 phases x 2 epochs
    assert len(orders[0]) == 16
    assert len(set(orders[0])) == 16, "two epochs replayed the same permutation"
    assert orders[0] == orders[1], "the same seed must give the same orders"
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), soup.state_dict().values()))


def test_replica_seeds_reach_augmentation_and_dropout(tmp_path):
    """Augmentation inside the data set draws from torch's global generator, which the Trainer seeds with the
    replica's seed: replicas must see different draws."""
    draws = []

    class Augmented(Recording):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            noise = torch.rand(())
            draws.append(float(noise))
            return {"x": item["x"] + noise, "labels": item["labels"]}

    args = _config(tmp_path, n_phases=1, num_train_epochs=1)
    runner = SparseModelSoup(MLP(), args, Augmented(64), ClassificationAccuracy(), eval_dataset=Recording(16, 1))
    draws.clear()  # only what training reads, not the input checks before it
    runner.run()
    per_replica = [tuple(draws[k : k + 64]) for k in range(0, len(draws), 64)]
    assert len(per_replica) == 3 and len(set(per_replica)) == 3


def test_diversity_diagnostics_and_the_near_copy_warning(tmp_path, caplog):
    train, val, test = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:256], train.labels[:256], train.augment)
    args = _config(tmp_path, n_phases=1, num_replicas=3, num_train_epochs=1, per_device_train_batch_size=32)
    with caplog.at_level(logging.INFO, logger="hf_sms"):
        runner = SparseModelSoup(DigitsResNet(width=4), args, train, ClassificationAccuracy(), val, test)
        runner.run()
    diag = runner.results["sms"][0]
    assert 0.0 < diag["disagreement_val"] <= 100.0
    assert diag["ensemble_minus_best_val"] == pytest.approx(diag["ensemble_val"] - max(diag["candidates_val"]))
    assert "disagreement" in caplog.text and "cannot gain" not in caplog.text

    # The same seed for every replica: identical replicas, a warning that says what to vary.
    caplog.clear()
    args = _config(
        tmp_path,
        output_dir=str(tmp_path / "same"),
        n_phases=1,
        num_replicas=2,
        num_train_epochs=1,
        per_device_train_batch_size=32,
        replica_seeds=[5, 5],
    )
    with caplog.at_level(logging.INFO, logger="hf_sms"):
        runner = SparseModelSoup(DigitsResNet(width=4), args, train, ClassificationAccuracy(), val, test)
        runner.run()
    assert runner.results["sms"][0]["disagreement_val"] == 0.0
    assert "cannot gain" in caplog.text and "replica_weight_decays" in caplog.text


def test_greedy_trajectory_continues_from_the_greedy_soup(tmp_path):
    """merge_methods=["uniform", "greedy"] runs two trajectories; phase 2 of the greedy one starts from the
    greedy soup of phase 1 (not from the uniform soup, as a selection over uniform's candidates would)."""
    train, val, test = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:128], train.labels[:128])
    args = _config(
        tmp_path,
        num_replicas=3,
        num_train_epochs=1,
        per_device_train_batch_size=32,
        merge_methods=["uniform", "greedy"],
    )
    runner = SparseModelSoup(DigitsResNet(width=4), args, train, ClassificationAccuracy(), val, test)
    merged, starts = [], {}
    run_phase, train_replica = runner.run_phase, runner.train_replica

    def spy_phase(spec):
        result = run_phase(spec)
        merged.append((spec.soup, {k: v.clone() for k, v in result.soup.state_dict().items()}, result.kept))
        return result

    def spy_train(start, step, hparams, name, **kwargs):
        starts[name] = {k: v.clone() for k, v in start.state_dict().items()}
        return train_replica(start, step, hparams, name, **kwargs)

    runner.run_phase, runner.train_replica = spy_phase, spy_train
    runner.run()
    assert [m for m, _, _ in merged] == ["uniform", "uniform", "greedy", "greedy"]
    assert "sms-greedy/phase2/replica0" in starts and "sms/phase2/replica0" in starts
    greedy_soup1, masks = merged[2][1], runner.results["rows"]
    start = starts["sms-greedy/phase2/replica0"]
    alive = {k: start[k] != 0 for k in start if k.endswith("weight") and start[k].dim() > 1}
    # The phase-2 start is the phase-1 greedy soup with phase 2's pruning applied on top.
    assert all(torch.equal(start[k][alive[k]], greedy_soup1[k][alive[k]]) for k in alive)
    assert set(masks) >= {"sms_uniform", "sms_greedy", "best_candidate", "mean_candidate"}
    assert [d["trajectory"] for d in runner.results["sms"]] == ["uniform", "uniform", "greedy", "greedy"]
    assert (tmp_path / "run" / "sms-greedy" / "phase2").is_dir()
    assert not (tmp_path / "run" / "sms-greedy" / "phase1").exists()  # phase 1 is shared, trained once


def test_varied_learning_rates_start_each_replica_at_its_own_rate(tmp_path):
    args = _config(
        tmp_path,
        n_phases=1,
        retrain_schedule="allr",
        pretrain_epochs=100,
        learning_rate=0.1,
        replica_learning_rates=[0.1, 0.05, 0.01],
        max_steps=20,
        num_train_epochs=1,
    )
    peaks = []
    for h in args.replica_overrides(0):
        assert h["retrain_schedule"] == "llr"
        trainer = SparseSoupTrainer(MLP(), dataclasses.replace(args, **h), train_dataset=Recording(64))
        trainer.create_optimizer_and_scheduler(20)
        rates = []
        for _ in range(20):
            rates.append(trainer.optimizer.param_groups[0]["lr"])
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
        peaks.append(max(rates))
    assert peaks == pytest.approx([0.1, 0.05, 0.01])


def test_imp_mx_gets_the_compute_sms_spends_in_each_phase(tmp_path):
    args = _config(tmp_path, n_phases=2, num_replicas=3, replica_epochs=[1.0, 2.0, 3.0], replicas_per_phase=[3, 2])
    assert args.phase_budget(0) == {"num_train_epochs": 6.0, "max_steps": -1}
    assert args.phase_budget(1) == {"num_train_epochs": 3.0, "max_steps": -1}
    assert _config(tmp_path, max_steps=5, num_replicas=2).phase_budget(0) == {"max_steps": 10}
    with pytest.raises(ValueError, match="replica_epochs .* max_steps > 0 .* set max_steps=-1"):
        _config(tmp_path, max_steps=5, replica_epochs=[1.0, 2.0, 3.0])

    seen = {}
    train, val = Recording(32), Recording(16, seed=1)
    args = _config(tmp_path, n_phases=1, num_replicas=2, replica_epochs=[1.0, 2.0], baselines=["imp_mx"])
    runner = SparseModelSoup(MLP(), args, train, ClassificationAccuracy(), eval_dataset=val)
    original = runner.train_replica

    def spy(start, step, hparams, name, **kwargs):
        seen[name] = hparams.num_train_epochs
        return original(start, step, hparams, name, **kwargs)

    runner.train_replica = spy
    runner.run()
    assert seen == {"sms/phase1/replica0": 1.0, "sms/phase1/replica1": 2.0, "imp_mx/phase1/track0": 3.0}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, math.ceil(0.1 * 40)),
        ({"retrain_warmup_fraction": 0.25}, 10),
        ({"warmup_steps": 3}, 3),
        ({"warmup_steps": 0.5}, 20),
        ({"retrain_warmup_fraction": 0.0}, 0),
    ],
)
def test_warmup_is_a_field_and_warmup_steps_is_honoured(tmp_path, fields, expected):
    args = _config(tmp_path, retrain_schedule="llr", max_steps=40, **fields)
    trainer = SparseSoupTrainer(MLP(), args, train_dataset=Recording(64))
    trainer.create_optimizer_and_scheduler(40)
    rates = []
    for _ in range(40):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert rates.index(max(rates)) == expected  # the peak is reached when the warm-up ends


def test_paper_settings_no_clipping_and_decay_on_every_parameter(tmp_path):
    args = _config(tmp_path, weight_decay=5e-4)
    assert args.max_grad_norm == 0.0
    trainer = SparseSoupTrainer(MLP(), args, train_dataset=Recording(64))
    trainer.create_optimizer()
    decayed = [p for g in trainer.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    assert len(decayed) == 4  # both weights and both biases, as torch.optim.SGD(model.parameters(), ...)
    trainer = SparseSoupTrainer(
        MLP(), _config(tmp_path, weight_decay=5e-4, decay_all_parameters=False), train_dataset=Recording(64)
    )
    trainer.create_optimizer()
    decayed = [p for g in trainer.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    assert len(decayed) == 2  # transformers' default leaves biases out


def test_finished_replicas_wait_on_disk_and_give_the_same_soup(tmp_path, monkeypatch):
    """On one process the m - 1 replicas finished before the last one wait for the soup in their folders, not in
    memory (benchmarks/replica_memory.py); loaded back (and BatchNorm recalibrated there), they give the soup, the
    candidates' rows and the diagnostics of a run that kept them in memory, bit for bit."""
    from hf_sms.loop import rounds

    train, val, test = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:96], train.labels[:96])
    parked = []
    park = rounds.park
    monkeypatch.setattr(rounds, "park", lambda start, folder: parked.append(folder) or park(start, folder))

    def run(out, parks=True):
        if not parks:
            monkeypatch.setattr(rounds, "_parks", lambda *a, **k: False)
        args = _config(out, n_phases=1, num_replicas=3, num_train_epochs=1, per_device_train_batch_size=32)
        torch.manual_seed(0)  # the same starting model
        runner = SparseModelSoup(DigitsResNet(width=4), args, train, ClassificationAccuracy(), val, test)
        return runner.run().state_dict(), runner.results

    soup, results = run(tmp_path / "parked")
    assert [f.rsplit("/", 2)[-2:] for f in parked] == [["phase1", "replica0"], ["phase1", "replica1"]]
    kept_soup, kept = run(tmp_path / "kept", parks=False)
    assert len(parked) == 2  # the second run parked nothing
    assert [k for k in soup if not torch.equal(soup[k], kept_soup[k])] == []
    drop = ("seconds", "eval_seconds", "measured_speedup")  # timings

    def scores(rows):
        return {name: [{k: v for k, v in r.items() if k not in drop} for r in rs] for name, rs in rows.items()}

    assert scores(results["rows"]) == scores(kept["rows"])
    assert [{k: v for k, v in d.items() if k not in drop} for d in results["sms"]] == [
        {k: v for k, v in d.items() if k not in drop} for d in kept["sms"]
    ]
