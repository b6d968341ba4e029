"""A filter's score is its own kernel's L2 norm (Li et al. 2017, the paper; issue 37 item 1): on a plain conv stack
the kept filters are exactly those with the largest own norms, on a ResNet those whose producing kernels (a
residual stream's producers together) have the largest norms; ``l2_group`` scores every weight of the unit."""

import pytest
import torch
from conftest import make_resnet
from torch import nn

from hf_sms import compute_masks
from hf_sms.pruning.graph import trace_units


def _stack():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 12, 3), nn.ReLU(), nn.Conv2d(12, 6, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4),
    )  # fmt: skip
    with torch.no_grad():  # readers that disagree with the producers: large columns for filters of small norm
        for reader, producer in ((model[2], model[0]), (model[4], model[2])):
            own = producer.weight.flatten(1).norm(dim=1)
            reader.weight.mul_((10.0 / own).view(1, -1, *[1] * (reader.weight.dim() - 2)))
    return model


def _kept(mask: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask.flatten(1).any(1)).flatten().tolist())


def _top(norms: torch.Tensor, k: int) -> set[int]:
    return set(norms.topk(k).indices.tolist())


@pytest.mark.parametrize("sparsity", [0.25, 0.5])
def test_kept_filters_of_a_conv_stack_have_the_largest_own_norms(sparsity):
    model, x = _stack(), torch.randn(2, 3, 12, 12)
    masks = compute_masks(model, sparsity, structure="filters", example_inputs=x, fit_config=False)
    group = compute_masks(model, sparsity, structure="filters", criterion="l2_group", example_inputs=x,
                          fit_config=False)  # fmt: skip
    differ = 0
    for name in ("0.weight", "2.weight", "4.weight"):
        w = model.get_parameter(name).detach()
        n_keep = w.shape[0] - round(sparsity * w.shape[0])
        assert _kept(masks[name]) == _top(w.flatten(1).norm(dim=1), n_keep), name
        differ += _kept(group[name]) != _kept(masks[name])
    assert differ  # the readers were made to disagree: the group norm keeps other filters


def test_resnet_filters_agree_with_the_producers_norm_reference():
    model = make_resnet()
    x = torch.randn(2, 3, 32, 32)
    masks = compute_masks(model, 0.5, structure="filters", example_inputs=x, fit_config=False)
    groups = trace_units(model, x).groups(("filters",))
    checked = 0
    for g in groups:
        producers = [m for m in g.masked if m.role == "producer"]
        assert producers, g.name
        own = sum(m.unit_sums(model.get_parameter(m.name).detach().square()) for m in producers)
        n_keep = g.n_units - round(0.5 * g.n_units)
        kept = producers[0].unit_alive(masks[producers[0].name]).nonzero().flatten().tolist()
        assert set(kept) == _top(own, n_keep), g.name
        checked += 1
    assert checked == len(groups) >= 5  # every group, the residual streams among them
