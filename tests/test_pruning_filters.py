"""Structured (filter) pruning, Li et al. 2017 (docs/method.md §2): exact counts, reports, speedup, merges, export."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import make_cnn, make_resnet
from torch import nn

from hf_sms import apply_masks, compute_masks, load_sparse, phase_sparsities, save_sparse, sparsity_report
from hf_sms.demo import DigitsResNet
from hf_sms.evaluation import theoretical_speedup
from hf_sms.pruning.enforcement import MaskEnforcer
from hf_sms.pruning.masks import masks_from_model
from hf_sms.pruning.prunable import prunable_tensors
from hf_sms.pruning.structured import filter_sparsity, module_zero_filters, shrink_filters, zero_filters
from hf_sms.soup.soup import uniform_soup


def plain_net(conv_bias: bool = False, seed: int = 0) -> nn.Sequential:
    """Conv-BN-ReLU-Conv-BN-ReLU-pool-Linear with BatchNorms as after training (random affine and statistics)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=conv_bias),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=conv_bias),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    return trained_batchnorm(net)


@torch.no_grad()
def trained_batchnorm(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.uniform_(0.5, 1.5)
            m.bias.normal_()
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def conv_weights(model):
    return [t for t in prunable_tensors(model) if t.kind == "conv"]


def removed_filters(mask: torch.Tensor) -> torch.Tensor:
    """Bool per output filter (dim 0) of a conv mask: True where the whole filter is pruned."""
    return ~mask.flatten(1).any(1)


# -- the allocation: exact counts per layer, whole filters, masks only grow ---------------------------------
@pytest.mark.parametrize("make", [make_cnn, make_resnet])
@pytest.mark.parametrize("sparsity", [0.25, 0.5, 0.9])
def test_filter_l2_removes_whole_filters_in_the_exact_fraction_of_every_conv(make, sparsity):
    model = make()
    masks = compute_masks(model, sparsity, "filter_l2")
    for t in prunable_tensors(model):
        mask = masks[t.name]
        if t.kind != "conv":
            assert mask.all(), f"{t.name}: filter pruning leaves linear layers dense"
            continue
        rows = mask.flatten(1)
        assert (rows.all(1) | ~rows.any(1)).all(), f"{t.name}: a filter is pruned only in part"
        gone = removed_filters(mask)
        assert int(gone.sum()) == round(sparsity * mask.shape[0]), t.name
        norms = t.param.detach().flatten(1).norm(dim=1)
        if gone.any() and (~gone).any():
            assert norms[gone].max() <= norms[~gone].min(), f"{t.name}: a larger filter went first"


def test_filter_l1_is_li_et_al_criterion_and_differs_from_l2():
    conv = nn.Conv2d(1, 2, (1, 2), bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([[[[1.0, 1.0]]], [[[1.6, 0.0]]]]))  # L1 2 vs 1.6, L2 1.41 vs 1.6
    assert removed_filters(compute_masks(conv, 0.5, "filter_l2")["weight"]).tolist() == [True, False]
    assert removed_filters(compute_masks(conv, 0.5, "filter_l1")["weight"]).tolist() == [False, True]


def test_masks_only_grow_across_two_calls_even_when_pruned_filters_regrow():
    model = make_resnet()
    first = compute_masks(model, 0.3, "filter_l2")
    torch.manual_seed(1)
    with torch.no_grad():
        for t in prunable_tensors(model):
            t.param.copy_(torch.randn_like(t.param) * 10)  # pruned filters now the largest: they must stay pruned
    second = compute_masks(model, 0.5, "filter_l2", masks=first)
    for t in conv_weights(model):
        assert not (second[t.name] & ~first[t.name]).any(), t.name
        assert int(removed_filters(second[t.name]).sum()) == round(0.5 * t.param.shape[0]), t.name
    lower = compute_masks(model, 0.1, "filter_l2", masks=second)
    assert all(torch.equal(lower[n], second[n]) for n in second)


def test_phase_targets_compound_on_filters():
    model = make_resnet()
    masks = None
    for target in phase_sparsities(0.9, 3):
        masks = compute_masks(model, target, "filter_l2", masks)
        apply_masks(model, masks)
        for t in conv_weights(model):
            assert int(zero_filters(t.param).sum()) == round(target * t.param.shape[0]), (target, t.name)


def test_partly_pruned_filters_keep_their_pruned_weights():
    model = make_cnn()
    unstructured = compute_masks(model, 0.5, "uniform")
    masks = compute_masks(model, 0.25, "filter_l2", masks=unstructured)
    for name, mask in masks.items():
        assert not (mask & ~unstructured[name]).any(), name


@pytest.mark.parametrize("sparsity", [1.0, 1.5, -0.1, "0.5", None])
def test_bad_sparsity_is_explained(sparsity):
    with pytest.raises(ValueError, match=r"sparsity must be a fraction in \[0, 1\)"):
        compute_masks(make_cnn(), sparsity, "filter_l2")


def test_a_model_without_convolutions_is_refused_before_it_trains_at_sparsity_zero():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    for how in ({"allocation": "filter_l2"}, {"structure": "filters"}):
        with pytest.raises(ValueError, match="'filters' finds no units in Sequential .no conv layers"):
            compute_masks(model, 0.5, **how)


@pytest.mark.parametrize("layer", [nn.ConvTranspose2d(4, 6, 3, groups=2), nn.Conv2d(4, 6, 3, groups=2)])
def test_grouped_and_transposed_filters_are_output_channels(layer):
    torch.manual_seed(0)
    apply_masks(layer, compute_masks(layer, 0.5, "filter_l2"))
    assert filter_sparsity(layer)["per_tensor"]["weight"] == {"sparsity": 0.5, "zero_filters": 3, "filters": 6}
    out = layer(torch.randn(2, 4, 5, 5))
    gone = module_zero_filters(layer)
    # A removed filter's output channel is its bias and nothing else.
    assert torch.allclose(out[:, gone], layer.bias[gone].view(1, -1, 1, 1).expand_as(out[:, gone]))
    assert (out[:, ~gone].flatten(1).std(1) > 0).all()


# -- reporting ------------------------------------------------------------------------------------------
def test_sparsity_report_has_a_filters_section():
    model = make_cnn()
    apply_masks(model, compute_masks(model, 0.5, "filter_l2"))
    report = sparsity_report(model)
    filters = report["filters"]
    assert filters["per_tensor"]["conv1.weight"] == {"sparsity": 0.5, "zero_filters": 4, "filters": 8}
    assert filters["per_tensor"].keys() == {"conv1.weight", "conv2.weight"}
    assert (filters["zero_filters"], filters["filters"], filters["sparsity"]) == (8, 16, 0.5)
    conv_weights_total = 8 * 3 * 9 + 8 * 8 * 9
    assert report["zeros"] == conv_weights_total // 2  # the weight view: linear layers stay dense
    assert sparsity_report(make_cnn())["filters"]["sparsity"] == 0.0


# -- theoretical speedup: Li et al.'s structural count -----------------------------------------------------
def _flops(n_pixels: int, c_in: int, c_out: int, k: int = 9) -> int:
    return 2 * n_pixels * c_in * c_out * k


@pytest.mark.parametrize("conv_bias", [False, True])
def test_speedup_hand_count_removes_filters_and_the_input_channels_they_fed(conv_bias):
    model = plain_net(conv_bias)
    x = torch.randn(2, 3, 6, 6)
    pixels = 2 * 6 * 6
    f1, f2, f3 = _flops(pixels, 3, 8), _flops(pixels, 8, 8), 2 * 2 * 8 * 4
    masks = compute_masks(model, 0.5, "filter_l2")
    # Only conv1's filters: conv1 halves, conv2 reads half its input channels.
    apply_masks(model, {"0.weight": masks["0.weight"]})
    assert theoretical_speedup(model, x) == pytest.approx((f1 + f2 + f3) / (f1 / 2 + f2 / 2 + f3))
    # Plus conv2's own filters: conv2 keeps 4 of 8 filters on 4 of 8 input channels.
    apply_masks(model, masks)
    assert theoretical_speedup(model, x) == pytest.approx((f1 + f2 + f3) / (f1 / 2 + f2 / 4 + f3))


def test_speedup_never_removes_a_channel_that_is_zero_by_chance():
    model = plain_net()
    with torch.no_grad():
        model[1].bias[0] = -100.0  # channel 0 is dead after the ReLU on every input, but conv1's filter 0 lives
        model[3].weight[5] = 0.0  # one removed filter, so the structural count runs
    pixels = 2 * 6 * 6
    f1, f2, f3 = _flops(pixels, 3, 8), _flops(pixels, 8, 8), 2 * 2 * 8 * 4
    expected = (f1 + f2 + f3) / (f1 + f2 * 7 / 8 + f3)
    assert theoretical_speedup(model, torch.randn(2, 3, 6, 6)) == pytest.approx(expected)


def test_speedup_of_unstructured_masks_is_unchanged():
    model = plain_net()
    apply_masks(model, compute_masks(model, 0.5, "uniform"))
    assert filter_sparsity(model)["zero_filters"] == 0
    assert theoretical_speedup(model, torch.randn(2, 3, 6, 6)) == pytest.approx(2.0)


def _conv_flops(model, x) -> tuple[float, float]:
    """Dense FLOPs of ``model``'s convolutions and the same with each weight's zeros skipped, by hand."""
    counts = []

    def record(conv, args, out):
        flops = 2 * out.numel() * conv.weight[0].numel()
        counts.append((flops, flops * float((conv.weight != 0).float().mean())))

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, nn.Conv2d)]
    model(x)
    for hook in hooks:
        hook.remove()
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def test_speedup_of_a_plain_convnet_is_that_of_the_physically_shrunk_one():
    model = plain_net(conv_bias=True)
    apply_masks(model, compute_masks(model, 0.75, "filter_l2"))
    x = torch.randn(2, 3, 6, 6)
    shrunk = shrink_filters(model, x, exact=False)
    assert shrunk[3].in_channels == shrunk[3].out_channels == 2
    dense, _ = _conv_flops(model, x)
    _, small = _conv_flops(shrunk, x)
    head = 2 * 2 * model[8].weight.numel()  # the linear head counts with its own zeros (dense here)
    assert theoretical_speedup(model, x) == pytest.approx((dense + head) / (small + head))


class ResidualNet(nn.Module):
    """stem -> block (conv1 -> conv2, plus the identity) -> 1x1 head conv."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 2, 1, bias=False)

    def forward(self, x):
        x = torch.relu(self.bn0(self.stem(x)))
        return self.head(torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x))


def test_speedup_hand_count_with_a_residual_add():
    torch.manual_seed(0)
    model = trained_batchnorm(ResidualNet())
    with torch.no_grad():
        model.stem.weight[[0, 2]] = 0.0
        model.conv2.weight[[1, 2]] = 0.0
    pixels = 2 * 5 * 5
    stem, conv, head = _flops(pixels, 3, 4), _flops(pixels, 4, 4), _flops(pixels, 4, 2, k=1)
    # conv1 reads the stem's output, where channels 0 and 2 are gone; after the add only channel 2 is gone in
    # both branches, so the head keeps 3 of its 4 input channels (the add keeps channel 0 and 1 alive).
    sparse = stem / 2 + conv / 2 + conv / 2 + head * 3 / 4
    x = torch.randn(2, 3, 5, 5)
    assert theoretical_speedup(model, x) == pytest.approx((stem + 2 * conv + head) / sparse)
    with pytest.warns(UserWarning, match="kept 2 all-zero filters"):  # a dense export can drop channel 2 only
        shrunk = shrink_filters(model, x, exact=False)
    assert [shrunk.stem.out_channels, shrunk.conv1.in_channels, shrunk.conv2.out_channels] == [3, 3, 3]
    assert shrunk.head.in_channels == shrunk.bn0.num_features == shrunk.bn2.num_features == 3


@pytest.mark.parametrize(
    ("make", "shape"),
    [(lambda: DigitsResNet(width=8), (2, 1, 8, 8)), (lambda: make_resnet(), (2, 3, 32, 32))],
)
def test_speedup_of_residual_models_includes_what_the_shrunk_model_saves(make, shape):
    model = trained_batchnorm(make())
    apply_masks(model, compute_masks(model, 0.5, "filter_l2"))
    x = torch.randn(*shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # residual channels removed in one branch only stay
        shrunk = shrink_filters(model, x, exact=False)
    dense, _ = _conv_flops(model, x)
    small_dense, small = _conv_flops(shrunk, x)
    assert small_dense < dense
    # Beyond the shrunk model, the count also skips a conv's reads of a channel that is zero before a residual
    # add (kept in the export because the add's other branch needs it).
    head = 2 * shape[0] * model.fc.weight.numel()
    assert theoretical_speedup(model, x) >= (dense + head) / (small + head) > 1.5


# -- whole filters survive merges and checkpoints ----------------------------------------------------------
def test_uniform_soup_of_filter_masked_replicas_keeps_every_removed_filter_zero():
    base = make_resnet()
    masks = compute_masks(base, 0.5, "filter_l2")
    apply_masks(base, masks)
    replicas = []
    for seed in range(3):
        replica = copy.deepcopy(base).train()
        enforcer = MaskEnforcer(replica, masks)
        optimizer = torch.optim.SGD(replica.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
        torch.manual_seed(seed)
        for _ in range(3):
            loss = nn.functional.cross_entropy(replica(torch.randn(4, 3, 16, 16)), torch.randint(0, 4, (4,)))
            optimizer.zero_grad()
            loss.backward()
            enforcer.mask_gradients()
            optimizer.step()
            enforcer.mask_parameters()
        replicas.append(replica)
    assert not torch.equal(replicas[0].conv1.weight, replicas[1].conv1.weight)
    soup = uniform_soup(replicas)
    for t in conv_weights(soup):
        gone = removed_filters(masks[t.name])
        assert torch.equal(zero_filters(t.param), gone), t.name
    assert filter_sparsity(soup)["sparsity"] == filter_sparsity(base)["sparsity"] == 0.5


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
def test_save_and_load_keep_whole_filters(tmp_path, fmt):
    model = make_resnet()
    apply_masks(model, compute_masks(model, 0.5, "filter_l2"))
    save_sparse(model, str(tmp_path), fmt)
    loaded = load_sparse(str(tmp_path))
    assert filter_sparsity(loaded) == filter_sparsity(model)
    for name, mask in masks_from_model(model).items():
        assert torch.equal(masks_from_model(loaded)[name], mask), name


# -- shrink_filters: a really smaller model with the same outputs ----------------------------------------------
def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("conv_bias", [False, True])
def test_shrink_plain_convnet_gives_the_same_outputs_with_fewer_parameters(conv_bias):
    model = plain_net(conv_bias)
    apply_masks(model, compute_masks(model, 0.5, "filter_l2"))
    x = torch.randn(4, 3, 6, 6)
    with warnings.catch_warnings(record=True):  # exact: filters whose BatchNorm emits a nonzero constant stay
        warnings.simplefilter("always")
        shrunk = shrink_filters(model, x)
    assert n_params(shrunk) < n_params(model)
    assert torch.allclose(shrunk(x), model(x), atol=1e-5)
    assert isinstance(shrunk, nn.Sequential)
    assert shrunk[0].out_channels == shrunk[1].num_features == shrunk[3].in_channels < 8


def test_shrink_removes_every_removed_filter_when_they_carry_zeros():
    model = plain_net()
    apply_masks(model, compute_masks(model, 0.5, "filter_l2"))
    with torch.no_grad():  # BatchNorm of removed filters zeroed: their channels are zero downstream
        for conv, bn in ((model[0], model[1]), (model[3], model[4])):
            gone = module_zero_filters(conv)
            bn.weight[gone], bn.bias[gone] = 0.0, 0.0
    x = torch.randn(4, 3, 6, 6)
    shrunk = shrink_filters(model, x)
    assert [shrunk[0].out_channels, shrunk[3].in_channels, shrunk[3].out_channels, shrunk[8].in_features] == [4] * 4
    assert n_params(shrunk) == (3 * 9 * 4) + 2 * 4 + (4 * 9 * 4) + 2 * 4 + (4 * 4 + 4)
    assert torch.allclose(shrunk(x), model(x), atol=1e-5)


def test_shrink_inexact_follows_li_et_al_and_drops_batchnorm_constants():
    model = plain_net()
    apply_masks(model, compute_masks(model, 0.5, "filter_l2"))
    x = torch.randn(4, 3, 6, 6)
    shrunk = shrink_filters(model, x, exact=False)
    assert shrunk[3].out_channels == 4
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for conv, bn in ((reference[0], reference[1]), (reference[3], reference[4])):
            gone = module_zero_filters(conv)
            bn.weight[gone], bn.bias[gone] = 0.0, 0.0
    assert torch.allclose(shrunk(x), reference(x), atol=1e-5)


@pytest.mark.parametrize(
    ("make", "shape"),
    [(lambda: DigitsResNet(width=8), (4, 1, 8, 8)), (lambda: make_resnet(), (4, 3, 32, 32))],
)
def test_shrink_residual_models_keeps_outputs(make, shape):
    model = trained_batchnorm(make())
    apply_masks(model, compute_masks(model, 0.5, "filter_l2"))
    x = torch.randn(*shape)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        shrunk = shrink_filters(model, x)
    assert n_params(shrunk) < n_params(model)
    assert type(shrunk) is type(model)
    assert torch.allclose(shrunk(x), model(x), atol=1e-5)


def test_shrink_keeps_channels_an_unknown_op_reads():
    class Cat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(8, 2, 1)

        def forward(self, x):
            return self.head(torch.cat([self.a(x), self.b(x)], 1))

    model = Cat()
    with torch.no_grad():
        model.a.weight[0], model.a.bias[0] = 0.0, 0.0
    x = torch.randn(2, 3, 4, 4)
    with pytest.warns(UserWarning, match="kept 1 all-zero filters"):
        shrunk = shrink_filters(model, x)
    assert n_params(shrunk) == n_params(model)
    assert torch.allclose(shrunk(x), model(x))


def test_shrink_follows_a_view_of_a_pooled_map_into_the_head():
    class ViewHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.pool, self.fc = nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Linear(4, 2)

        def forward(self, x):
            x = self.pool(torch.relu(self.conv(x)))
            return self.fc(x.view(x.size(0), -1))

    model = ViewHead()
    with torch.no_grad():
        model.conv.weight[1], model.conv.bias[1] = 0.0, 0.0
    x = torch.randn(2, 3, 5, 5)
    shrunk = shrink_filters(model, x)
    assert (shrunk.conv.out_channels, shrunk.fc.in_features) == (3, 3)
    assert torch.allclose(shrunk(x), model(x))


def test_shrink_explains_models_fx_cannot_trace():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return self.conv(x) if x.sum() > 0 else x

    with pytest.raises(NotImplementedError, match="torch.fx can trace"):
        shrink_filters(Branchy(), torch.randn(1, 3, 2, 2))
