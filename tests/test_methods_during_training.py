"""Pruning during training: GMP's cubic schedule and DPF's error feedback in SparseSoupTrainer (docs/method.md §7)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cnn
from transformers import TrainerCallback

from hf_sms import SparseSoupConfig, SparseSoupTrainer, prunable_tensors
from hf_sms.methods import (
    DynamicPruning,
    FeedbackMasking,
    GradualPruning,
    gmp_phases,
    gmp_sparsity,
    pruning_iterations,
    pruning_targets,
    sparsity_at,
)
from hf_sms.pruning.masks import apply_masks

N_CNN = 216 + 576 + 128 + 64  # prunable weights of TinyCNN: conv1, conv2, fc1, fc2


def inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper


def pruned(masks) -> int:
    return sum(int((~m).sum()) for m in masks.values())


# -- the schedule, by hand -----------------------------------------------------------------------------
def test_gmp_sparsity_is_zhu_and_gupta_cubic():
    assert gmp_sparsity(0, 3, 0.9) == 0.0
    assert gmp_sparsity(1, 3, 0.9) == pytest.approx(0.9 * 19 / 27)  # 1 - (2/3)^3
    assert gmp_sparsity(2, 3, 0.9) == pytest.approx(0.9 * 26 / 27)
    assert gmp_sparsity(3, 3, 0.9) == 0.9  # exact
    assert gmp_sparsity(1, 2, 0.8) == pytest.approx(0.8 * 7 / 8)
    for bad in [(4, 3, 0.9), (-1, 3, 0.9), (1, 0, 0.9), (1, 3, 1.0)]:
        with pytest.raises(ValueError):
            gmp_sparsity(*bad)


def test_pruning_iterations_split_training_into_equal_intervals():
    assert pruning_iterations(10, 4) == [2, 4, 6, 8]
    assert pruning_iterations(20, 3) == [5, 10, 15]
    assert pruning_iterations(7, 2) == [2, 5]  # 7/3 = 2.33, 14/3 = 4.67
    assert pruning_iterations(5, 4) == [1, 2, 3, 4]  # the shortest run: one step per interval
    assert pruning_iterations(100, 1) == [50]
    with pytest.raises(ValueError, match="total_steps >= 5"):
        pruning_iterations(4, 4)
    with pytest.raises(ValueError, match="integer >= 1"):
        pruning_iterations(10, 0)


def test_gmp_phases_and_targets_by_hand():
    phases = gmp_phases(8, 3, 0.9)
    assert [(a, b) for a, b, _ in phases] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s for *_, s in phases] == pytest.approx([0.0, 0.9 * 19 / 27, 0.9 * 26 / 27, 0.9])
    assert phases[-1][2] == 0.9
    assert gmp_phases(10, 1, 0.5) == [(0, 5, 0.0), (5, 10, 0.5)]
    assert pruning_targets(10, 1, 0.5) == {5: 0.5}
    assert [sparsity_at(t, 10, 1, 0.5) for t in (0, 4, 5, 9, 10)] == [0.0, 0.0, 0.5, 0.5, 0.5]
    for total, n in [(9, 2), (50, 4), (13, 12)]:  # the phases tile the run
        p = gmp_phases(total, n, 0.7)
        assert p[0][0] == 0 and p[-1][1] == total and all(p[i][1] == p[i + 1][0] for i in range(n))


# -- GMP in a trainer ----------------------------------------------------------------------------------
class GmpRecorder(TrainerCallback):
    """Runs after GradualPruning: checks every step's masks, weights and momentum against the last step's."""

    def __init__(self):
        self.trainer, self.masks, self.momentum, self.pruned_at = None, None, {}, {}

    def _params(self):
        return {t.name: t.param for t in prunable_tensors(self.trainer.model)}

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        opt, params = inner(optimizer), self._params()
        self.momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in params.items()}

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        masks, params, opt = self.trainer.masks, self._params(), inner(optimizer)
        if self.masks is None:  # first step: nothing to compare with
            self.masks = masks
        for name, mask in masks.items():
            assert (params[name].detach()[~mask] == 0).all(), f"step {state.global_step}: {name} revived"
            if name in self.masks:
                assert not (~self.masks[name] & mask).any(), "a mask shrank: GMP's masks only grow"
        if pruned(masks) != pruned(self.masks):  # a pruning step: momentum of the newly pruned entries is reset
            newly = {n: ~m & self.masks.get(n, torch.ones_like(m)) for n, m in masks.items()}
            assert any(bool((self.momentum[n][newly[n]] != 0).any()) for n in masks), "test would be vacuous"
            for name, p in params.items():
                assert (opt.state[p]["momentum_buffer"][~masks[name]] == 0).all(), f"{name}: momentum not reset"
            zeros = sum(int((p.detach() == 0).sum()) for p in params.values())
            self.pruned_at[state.global_step] = (pruned(masks), zeros)
        self.masks = masks


def test_gmp_follows_the_cubic_schedule_with_exact_counts(make_args, image_dataset):
    total, n, target = 20, 3, 0.8
    args = make_args(
        max_steps=total, optim="sgd", optim_args="momentum=0.9", learning_rate=0.05, weight_decay=0.01
    )  # plain TrainingArguments: linear LR schedule, no warm-up
    recorder = GmpRecorder()
    trainer = SparseSoupTrainer(
        make_cnn(),
        args,
        masks={},  # start dense
        lr_schedule="original",
        train_dataset=image_dataset,
        callbacks=[GradualPruning(n, target), recorder],
    )
    recorder.trainer = trainer
    trainer.train()

    expected = {t: round(gmp_sparsity(k, n, target) * N_CNN) for k, t in enumerate([5, 10, 15], start=1)}
    assert recorder.pruned_at == {t: (c, c) for t, c in expected.items()}  # masks and weights' zeros
    assert pruned(trainer.masks) == round(target * N_CNN)
    logged = {h["step"]: h["weight_sparsity"] for h in trainer.state.log_history if "weight_sparsity" in h}
    assert logged[4] == 0.0 and logged[5] == pytest.approx(expected[5] / N_CNN, abs=1e-6)
    assert logged[total] == pytest.approx(target, abs=1e-3)
    # The original schedule (linear from learning_rate to 0 over the run), not a retraining restart.
    lrs = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
    assert [lrs[s] for s in (1, 6, 16)] == pytest.approx([0.05, 0.05 * 15 / 20, 0.05 * 5 / 20])


def test_gmp_in_a_phase_prunes_at_its_start_not_its_end(make_args, image_dataset):
    """A trainer covering iterations (5, 10] of a 20-step run: prunes at 5 when it begins, leaves 10 to the next."""
    recorder = GmpRecorder()
    trainer = SparseSoupTrainer(
        make_cnn(),
        make_args(max_steps=5, optim="sgd", optim_args="momentum=0.9"),
        masks={},
        lr_schedule="original",
        step_offset=5,
        total_steps=20,
        train_dataset=image_dataset,
        callbacks=[GradualPruning(3, 0.8), recorder],
    )
    recorder.trainer = trainer
    trainer.train()
    assert pruned(trainer.masks) == round(gmp_sparsity(1, 3, 0.8) * N_CNN)
    assert recorder.pruned_at == {}  # nothing pruned after any step of the phase


def test_gmp_refuses_a_pruned_start(make_args, image_dataset):
    args = make_args(SparseSoupConfig, max_steps=4, target_sparsity=0.5)
    trainer = SparseSoupTrainer(make_cnn(), args, train_dataset=image_dataset, callbacks=[GradualPruning(1, 0.5)])
    with pytest.raises(ValueError, match="masks=\\{\\}"):
        trainer.train()


def test_trainer_starts_dense_at_target_sparsity_zero(make_args, image_dataset):
    args = make_args(SparseSoupConfig, max_steps=2, target_sparsity=0.0)
    trainer = SparseSoupTrainer(make_cnn(), args, train_dataset=image_dataset)
    trainer.train()
    assert pruned(trainer.masks) == 0 and all(m.all() for m in trainer.masks.values())


def test_original_schedule_starts_at_the_phase_offset(make_args, image_dataset):
    args = make_args(max_steps=5, learning_rate=0.1, warmup_steps=2)
    kwargs = dict(masks={}, lr_schedule="original", train_dataset=image_dataset)
    trainer = SparseSoupTrainer(make_cnn(), args, step_offset=5, total_steps=20, **kwargs)
    trainer.create_optimizer_and_scheduler(num_training_steps=5)
    lrs = []
    for _ in range(3):
        lrs.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert lrs == pytest.approx([0.1 * (20 - s) / 18 for s in (5, 6, 7)])  # linear decay after 2 warm-up steps
    whole = SparseSoupTrainer(make_cnn(), args, **kwargs)  # no offset: exactly transformers' scheduler
    whole.create_optimizer_and_scheduler(num_training_steps=5)
    assert whole.lr_scheduler.get_last_lr()[0] == 0.0  # warm-up starts at 0
    with pytest.raises(ValueError, match="lr_schedule"):
        SparseSoupTrainer(make_cnn(), args, masks={}, lr_schedule="cosine")
    with pytest.raises(ValueError, match="step_offset"):
        SparseSoupTrainer(make_cnn(), args, masks={}, step_offset=5, total_steps=5)


# -- DPF -----------------------------------------------------------------------------------------------
class DpfProbe(TrainerCallback):
    """Runs after DynamicPruning. Compares each training forward pass with a masked reference model, records
    when masks change and whether pruned entries of the dense weights move, and revives one weight by hand."""

    def __init__(self, revive_at: int):
        self.trainer, self.ref, self.snapshot = None, make_cnn(), None
        self.updates, self.forward_checks, self.revived, self.revived_kept = [], 0, None, []
        self.grads = []
        self.dense, self.masks, self.mask_changes, self.revive_at = None, None, [], revive_at

    def attach(self, trainer):
        self.trainer = trainer
        trainer.model.register_forward_hook(self.check_forward, with_kwargs=True)

    def check_forward(self, model, args, kwargs, output):
        masks = self.trainer.masks
        if not masks:
            return
        params = {t.name: t.param for t in prunable_tensors(model)}
        for name, mask in masks.items():
            assert (params[name].detach()[~mask] == 0).all(), f"{name}: the forward pass saw a pruned weight"
        if model.training:  # the same batch through a masked copy of the step's dense weights
            self.ref.load_state_dict(self.snapshot)
            apply_masks(self.ref, masks).train()
            with torch.no_grad():
                assert torch.equal(self.ref(*args, **kwargs), output.detach())
            self.forward_checks += 1

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.snapshot = {k: v.clone() for k, v in model.state_dict().items()}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        masks = self.trainer.masks
        if masks:  # the optimizer gets the dense weights back and the unmasked gradient
            for t in prunable_tensors(model):
                assert torch.equal(t.param.detach(), self.snapshot[t.name]), f"{t.name}: dense values not restored"
            params = {t.name: t.param for t in prunable_tensors(model)}
            self.grads.append(sum(int((params[n].grad[~m] != 0).sum()) for n, m in masks.items()) / pruned(masks))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        masks = self.trainer.masks
        params = {t.name: t.param.detach() for t in prunable_tensors(model)}
        if self.revived is not None:
            self.revived_kept.append(bool(masks["fc1.weight"][self.revived]))
        if masks is not self.masks and masks:
            self.mask_changes.append(state.global_step)
        elif masks:  # same mask as last step: did the pruned entries of the dense weights move?
            moved = sum(int((params[n][~m] != self.dense[n][~m]).sum()) for n, m in masks.items())
            self.updates.append(moved / pruned(masks))
        if state.global_step == self.revive_at:  # push a pruned weight far above every other
            idx = (~masks["fc1.weight"]).nonzero()[0]
            params["fc1.weight"][tuple(idx)] = 10 * max(float(p.abs().max()) for p in params.values())
            self.revived = tuple(idx.tolist())
        self.dense, self.masks = {n: p.clone() for n, p in params.items()}, masks


@pytest.mark.parametrize("accum", [1, 2])
def test_dpf_trains_dense_weights_through_the_masked_model(accum, make_args, image_dataset):
    total, n, target, interval = 30, 2, 0.7, 4  # pruning iterations 10, 20
    args = make_args(
        max_steps=total,
        per_device_train_batch_size=8 // accum,
        gradient_accumulation_steps=accum,
        optim="sgd",
        optim_args="momentum=0.9",
        learning_rate=0.05,
        eval_strategy="steps",
        eval_steps=14,
    )
    probe = DpfProbe(revive_at=12)
    kwargs = dict(train_dataset=image_dataset, eval_dataset=image_dataset[:8])
    dpf = DynamicPruning(n, target, interval=interval)
    trainer = SparseSoupTrainer(make_cnn(), args, masks={}, lr_schedule="original", callbacks=[dpf, probe], **kwargs)
    probe.attach(trainer)
    trainer.train()

    # Recomputed at each pruning iteration and every `interval` iterations once the schedule prunes; not
    # at the last iteration, where training ends with the mask the last steps trained under.
    assert probe.mask_changes == [10, 12, 16, 20, 24, 28]
    assert probe.forward_checks == accum * (total - 10)  # every training forward pass after the first pruning
    # Pruned entries keep learning: in every step (almost) all of them moved in the dense copy.
    assert len(probe.grads) == total - 10 and min(probe.grads) > 0.5  # pruned entries get gradients
    assert len(probe.updates) == 15 and min(probe.updates) > 0.5  # steps 11-30 less the 5 with a new mask
    # Revived by hand at 12, kept by the recompute at 16 and after (pruned, hence zero, in between).
    assert probe.revived_kept == [False] * 3 + [True] * (total - 15), probe.revived_kept

    # The returned model is the masked one, at the target, with no optimizer state on pruned entries.
    assert isinstance(trainer.masking, FeedbackMasking)  # DPF trained under its masking policy
    assert pruned(trainer.masks) == round(target * N_CNN)
    opt = inner(trainer.optimizer)
    for t in prunable_tensors(trainer.model):
        mask = trainer.masks[t.name]
        assert (t.param.detach()[~mask] == 0).all() and (t.param.detach()[mask] != 0).all()
        assert (opt.state[t.param]["momentum_buffer"][~mask] == 0).all()
    logged = [
        h["weight_sparsity"] for h in trainer.state.log_history if "weight_sparsity" in h and h.get("step", 0) >= 20
    ]
    assert logged and all(s == pytest.approx(target, abs=1e-3) for s in logged)  # the mask's, not the dense weights'
