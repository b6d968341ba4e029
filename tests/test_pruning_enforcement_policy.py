"""The masking policy does as few passes as the optimizer allows and pruned weights stay exactly zero after every
step: property tests over optimizers, sparsities, gradient accumulation, dtypes and masks that grow mid-run."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_sms import SparseSoupConfig, SparseSoupTrainer, apply_masks, compute_masks
from hf_sms.pruning import ExactMasking, MaskEnforcer, keeps_zeros

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum_wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-4),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=1e-4),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True),
}
ONE_PASS = {"sgd", "sgd_momentum_wd", "sgd_nesterov", "adam", "adam_amsgrad", "adamw"}


def _net(dtype):
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _pruned_nonzero(model, masks) -> int:
    params = dict(model.named_parameters())
    return sum(int((params[n].detach()[~m] != 0).sum()) for n, m in masks.items())


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    sparsity=st.floats(0.2, 0.95),
    accumulate=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
    hand_optimizer=st.booleans(),
)
def test_pruned_weights_stay_exactly_zero_with_the_fewest_passes(
    name, sparsity, accumulate, dtype, seed, hand_optimizer
):
    torch.manual_seed(seed)
    model = _net(dtype)
    masks = compute_masks(model, sparsity)
    apply_masks(model, masks)
    optimizer = OPTIMIZERS[name](model.parameters())
    policy = ExactMasking()
    policy.bind(MaskEnforcer(model, masks))
    policy.start(optimizer)
    assert keeps_zeros(optimizer) == (name in ONE_PASS)
    full = mock.patch.object(MaskEnforcer, "after_step", autospec=True, side_effect=MaskEnforcer.after_step)
    with full as after_step:
        for step in range(6):
            if step == 3:  # masks grow mid-run (GMP): newly pruned weights and their state are zeroed once
                masks = compute_masks(model, min(0.97, sparsity + 0.02), masks=masks)
                policy.bind(MaskEnforcer(model, masks))
                policy.new_masks(optimizer if hand_optimizer else None)  # set_masks(masks): the next step catches up
            for _ in range(accumulate):
                x = torch.randn(8, 12, dtype=dtype)
                (model(x).float().pow(2).mean() / accumulate).backward()
            policy.before_step()
            optimizer.step()
            policy.after_step(optimizer)
            optimizer.zero_grad()
            assert _pruned_nonzero(model, masks) == 0, f"{name} step {step}"
    passes_after_steps = after_step.call_count - 1  # the one from new_masks
    assert passes_after_steps == ((0 if hand_optimizer else 1) if name in ONE_PASS else 6)


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch", "adafactor"])
def test_the_trainer_keeps_masks_exact_under_its_policy(tmp_path, optim):
    from conftest import make_cnn, make_image_dataset, training_args

    model = make_cnn()
    args = training_args(
        str(tmp_path), SparseSoupConfig, target_sparsity=0.8, max_steps=6, gradient_accumulation_steps=2,
        optim=optim, learning_rate=0.05,
    )  # fmt: skip
    trainer = SparseSoupTrainer(model, args, train_dataset=make_image_dataset())
    trainer.train()
    assert _pruned_nonzero(trainer.model, trainer.masks) == 0
    assert keeps_zeros(trainer.optimizer) == (optim != "adafactor")
