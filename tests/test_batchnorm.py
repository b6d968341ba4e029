"""BatchNorm recalibration (docs/method.md §5): exact averages of the per-batch statistics, momentum restored."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_cnn, make_image_dataset, make_resnet
from torch import nn

from hf_sms import SparseSoupConfig, SparseSoupTrainer, recalibrate_batchnorm
from hf_sms.batchnorm import has_batchnorm

BN = nn.modules.batchnorm._BatchNorm


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, momentum=0.3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
        nn.BatchNorm1d(5, affine=False),  # default momentum 0.1
    )


def per_batch_stats(model: nn.Module, batches, forward) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Mean over batches of each BatchNorm input's batch mean and unbiased batch variance, computed by hand."""
    model = copy.deepcopy(model).train()
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, BN):

            def hook(mod, args, name=name):
                x = args[0].double()
                dims = [0] + list(range(2, x.dim()))
                seen.setdefault(name, []).append((x.mean(dims), x.var(dims, unbiased=True)))

            hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        for b in batches:
            forward(model, b)
    for h in hooks:
        h.remove()
    return {
        n: (torch.stack([s[0] for s in v]).mean(0), torch.stack([s[1] for s in v]).mean(0)) for n, v in seen.items()
    }


def assert_exact(model, expected, n_batches):
    for name, m in model.named_modules():
        if isinstance(m, BN):
            mean, var = expected[name]
            torch.testing.assert_close(m.running_mean.double(), mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(m.running_var.double(), var, rtol=1e-5, atol=1e-6)
            assert int(m.num_batches_tracked) == n_batches


def batches_of(n: int, size: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, 3, 8, 8, generator=g) * (1 + i) + i for i in range(n)]  # batches differ a lot


def test_running_stats_are_exact_means_of_batch_stats():
    model = make_net().eval()
    batches = batches_of(5)
    expected = per_batch_stats(model, batches, lambda m, b: m(b))
    with torch.no_grad():  # garbage that must not leak into the result
        model[1].running_mean.fill_(100.0)
        model[1].running_var.fill_(100.0)
    params = {n: p.clone() for n, p in model.named_parameters()}

    out = recalibrate_batchnorm(model, batches)

    assert out is model
    assert_exact(model, expected, 5)
    assert model[1].momentum == 0.3 and model[5].momentum == 0.1  # restored
    assert not model.training  # mode restored
    assert all(torch.equal(params[n], p) for n, p in model.named_parameters())


def test_the_default_exponential_average_would_differ():
    """The check above can fail: plain train-mode passes (momentum 0.1) do not give the exact mean."""
    model = make_net()
    batches = batches_of(5)
    expected = per_batch_stats(model, batches, lambda m, b: m(b))
    for m in model.modules():
        if isinstance(m, BN):
            m.reset_running_stats()
    with torch.no_grad():
        for b in batches:
            model(b)
    with pytest.raises(AssertionError):
        assert_exact(model, expected, 5)


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_tuple_and_dict_batches(form):
    model = make_cnn().train()
    data = make_image_dataset(n=24)
    xs = [torch.stack([d["x"] for d in data[i : i + 6]]) for i in range(0, 24, 6)]
    ys = [torch.stack([d["labels"] for d in data[i : i + 6]]) for i in range(0, 24, 6)]
    batches = list(zip(xs, ys)) if form == "tuple" else [{"x": x, "labels": y} for x, y in zip(xs, ys)]
    expected = per_batch_stats(model, xs, lambda m, b: m(b))
    recalibrate_batchnorm(model, batches)
    assert_exact(model, expected, 4)
    assert model.training and model.bn1.momentum == 0.1


def test_max_batches_limits_the_data():
    model = make_net()
    batches = batches_of(6)
    expected = per_batch_stats(model, batches[:2], lambda m, b: m(b))
    recalibrate_batchnorm(model, iter(batches), max_batches=2)
    assert_exact(model, expected, 2)


def test_momentum_restored_even_if_a_batch_fails():
    model = make_net()
    with pytest.raises(RuntimeError):
        recalibrate_batchnorm(model, [torch.randn(4, 3, 8, 8), torch.randn(4, 7)])  # wrong shape
    assert model[1].momentum == 0.3 and model[5].momentum == 0.1


def test_models_without_batchnorm_are_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert not has_batchnorm(model)
    untracked = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False))
    assert not has_batchnorm(untracked)

    def never():
        raise AssertionError("data was read for a model without BatchNorm")
        yield

    state = copy.deepcopy(model.state_dict())
    assert recalibrate_batchnorm(model, never()) is model
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    recalibrate_batchnorm(untracked, never())


def test_timm_resnet_through_the_trainer(make_args):
    data = make_image_dataset(n=24)
    args = make_args(SparseSoupConfig, per_device_train_batch_size=8, target_sparsity=0.5)
    trainer = SparseSoupTrainer(make_resnet(), args, train_dataset=data)
    in_order = [torch.stack([d["x"] for d in data[i : i + 8]]) for i in range(0, 24, 8)]
    expected = per_batch_stats(trainer.model, in_order, lambda m, b: m(b))  # on the pruned model
    trainer.model.eval()
    trainer.recalibrate_batchnorm()
    assert_exact(trainer.model, expected, 3)  # the train set in its fixed order, batch size 8
    assert not trainer.model.training
    trainer.recalibrate_batchnorm(max_batches=1)
    assert int(trainer.model.bn1.num_batches_tracked) == 1
