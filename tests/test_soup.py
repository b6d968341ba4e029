"""Soups: masks survive merging, greedy never loses to the best candidate, differing masks raise."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_sms import apply_masks, compute_masks, greedy_soup, uniform_soup
from hf_sms.pruning.masks import masks_from_model
from hf_sms.soup import average_state_dicts, soup


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _replicas(m: int, sparsity: float, seed: int = 0) -> list[nn.Module]:
    base = _net(seed)
    masks = compute_masks(base, sparsity)
    apply_masks(base, masks)
    out = []
    for i in range(m):
        r = copy.deepcopy(base)
        with torch.no_grad():
            for p in r.parameters():
                p.add_(torch.randn_like(p) * 0.1 * (i + 1))
        out.append(apply_masks(r, masks))  # retrained under the same mask
    return out


@settings(max_examples=15, deadline=None)
@given(m=st.integers(2, 5), sparsity=st.floats(0.0, 0.99), seed=st.integers(0, 1000))
def test_uniform_soup_keeps_the_exact_mask_and_is_the_mean(m, sparsity, seed):
    models = _replicas(m, sparsity, seed)
    soup = uniform_soup(models)
    assert all(torch.equal(a, b) for a, b in zip(masks_from_model(soup).values(), masks_from_model(models[0]).values()))
    for name, tensor in soup.state_dict().items():
        if tensor.is_floating_point():
            mean = torch.stack([mm.state_dict()[name] for mm in models]).double().mean(0).float()
            torch.testing.assert_close(tensor, mean, rtol=0, atol=1e-6)


def test_integer_buffers_are_not_averaged():
    models = _replicas(3, 0.5)
    for i, m in enumerate(models):
        m[1].num_batches_tracked.fill_(10 * (i + 1))
    sd = average_state_dicts([m.state_dict() for m in models])
    assert sd["1.num_batches_tracked"].item() == 10
    assert sd["1.num_batches_tracked"].dtype == torch.long


def test_differing_masks_raise_unless_repruning():
    a, b = _replicas(2, 0.5)
    with torch.no_grad():
        b[3].weight.copy_(torch.randn_like(b[3].weight))  # b's linear layer is dense again
    with pytest.raises(ValueError, match="different masks.*reprune"):
        uniform_soup([a, b])
    with pytest.raises(ValueError, match="different masks"):
        greedy_soup([a, b], evaluate=lambda m: 0.0)
    soup = uniform_soup([a, b], reprune_sparsity=0.7)
    masks = masks_from_model(soup)
    pruned = sum(int((~m).sum()) for m in masks.values())
    assert pruned == round(0.7 * sum(m.numel() for m in masks.values()))


def test_architectures_that_differ_raise():
    with pytest.raises(ValueError, match="architectures differ"):
        average_state_dicts([_net(0).state_dict(), nn.Linear(2, 2).state_dict()])


def _distance_metric(target: nn.Module):
    def evaluate(model):
        return -sum(float((p - q).detach().pow(2).sum()) for p, q in zip(model.parameters(), target.parameters()))

    return evaluate


def test_greedy_soup_skips_candidates_that_hurt():
    target, far = _replicas(2, 0.5)
    with torch.no_grad():
        for p in far.parameters():
            p.mul_(5)
    near = copy.deepcopy(target)
    soup = greedy_soup([far, target, near], evaluate=_distance_metric(target))
    assert soup.greedy_info["order"][-1] == 0  # sorted best first, so the far candidate comes last
    assert 0 not in soup.greedy_info["kept"]
    # near == target, so the trial soup ties: strict '>' rejects it, keep_ties accepts it
    assert soup.greedy_info["kept"] == [1]
    tied = greedy_soup([far, target, near], evaluate=_distance_metric(target), keep_ties=True)
    assert sorted(tied.greedy_info["kept"]) == [1, 2]


def test_greedy_soup_keeps_candidates_whose_average_helps():
    target = _replicas(1, 0.5)[0]
    plus, minus = copy.deepcopy(target), copy.deepcopy(target)
    masks = masks_from_model(target)
    with torch.no_grad():
        for p, q in zip(plus.parameters(), minus.parameters()):
            d = torch.randn_like(p)
            p.add_(d)
            q.sub_(d)
    apply_masks(plus, masks), apply_masks(minus, masks)
    calls = []

    def recal(model):
        calls.append(model)

    soup = greedy_soup([plus, minus], evaluate=_distance_metric(target), recalibrate=recal)
    assert sorted(soup.greedy_info["kept"]) == [0, 1]
    assert soup.greedy_info["metric"] > max(soup.greedy_info["scores"])
    assert len(calls) == 4  # two candidates, one trial soup and the soup itself, each recalibrated


@settings(max_examples=10, deadline=None)
@given(m=st.integers(2, 5), seed=st.integers(0, 1000))
def test_greedy_soup_is_never_worse_than_the_best_candidate(m, seed):
    models = _replicas(m, 0.6, seed)
    torch.manual_seed(seed + 1)
    target = _replicas(1, 0.6, seed + 7)[0]
    evaluate = _distance_metric(target)
    soup = greedy_soup(models, evaluate=evaluate)
    assert evaluate(soup) >= max(evaluate(c) for c in models) - 1e-9
    assert masks_from_model(soup).keys() == masks_from_model(models[0]).keys()


def test_soup_registry_rejects_unknown_methods():
    with pytest.raises(ValueError, match="unknown soup method 'tie'.*greedy.*ties.*uniform"):
        soup(_replicas(2, 0.5), "tie")
