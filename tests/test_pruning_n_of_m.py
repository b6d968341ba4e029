"""n:m sparsity: exactly n of every m consecutive input weights of each linear layer after pruning, retraining,
soups, save and load; coarser patterns on the way; clear errors for what does not parse."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_sms import SparseSoupConfig, apply_masks, compute_masks, load_sparse, save_sparse, uniform_soup
from hf_sms.pruning.allocations import parse_n_of_m


def _groups(weight: torch.Tensor, m: int, transposed: bool = False) -> torch.Tensor:
    """Nonzeros per group of m consecutive inputs."""
    w = weight.t() if transposed else weight
    return (w != 0).reshape(-1, m).sum(1)


class _Net(nn.Module):
    def __init__(self, width: int, inputs: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc1, self.fc2 = nn.Linear(inputs, width), nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@settings(max_examples=25, deadline=None)
@given(
    nm=st.sampled_from([(1, 2), (2, 4), (1, 4), (4, 8)]),
    groups=st.integers(1, 6),
    width=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_every_linear_group_keeps_exactly_n_after_prune_soup_save_and_load(tmp_path_factory, nm, groups, width, seed):
    n, m = nm
    torch.manual_seed(seed)
    net = _Net(width * 4, groups * m)
    masks = compute_masks(net, 1 - n / m, f"{n}:{m}")
    apply_masks(net, masks)
    for layer in (net.fc1,):
        assert (_groups(layer.weight, m) == n).all()
    assert bool(masks["conv.weight"].all())  # convolutions stay dense
    # replicas trained under the mask (any values on the kept entries) average to the same pattern
    replicas = []
    for i in range(3):
        r = copy.deepcopy(net)
        with torch.no_grad():
            r.fc1.weight.add_(torch.randn_like(r.fc1.weight) * (i + 1))
        replicas.append(apply_masks(r, masks))
    soup = uniform_soup(replicas)
    assert (_groups(soup.fc1.weight, m) == n).all()
    folder = str(tmp_path_factory.mktemp("nm") / "ckpt")
    save_sparse(soup, folder)
    loaded = load_sparse(folder, _Net(width * 4, groups * m))
    assert torch.equal(loaded.fc1.weight, soup.fc1.weight)


def test_phases_go_through_coarser_patterns_and_masks_only_grow():
    torch.manual_seed(0)
    net = _Net(16, 8)
    first = compute_masks(net, 1 - 0.5**0.5, "2:4")  # phase 1 of 2 on the way to 2:4: 3 of every 4
    assert (first["fc1.weight"].reshape(-1, 4).sum(1) == 3).all()
    apply_masks(net, first)
    second = compute_masks(net, 0.5, "2:4", masks=first)
    assert (second["fc1.weight"].reshape(-1, 4).sum(1) == 2).all()
    assert not (second["fc1.weight"] & ~first["fc1.weight"]).any()


def test_conv1d_groups_run_along_its_inputs():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    layer = nn.Sequential(Conv1D(8, 12))  # nf=8 outputs, nx=12 inputs: weight (12, 8)
    masks = compute_masks(layer, 0.5, "2:4")
    assert (_groups(layer[0].weight * masks["0.weight"], 4, transposed=True) == 2).all()


def test_bad_n_of_m_is_a_clear_error():
    for bad in ("4:4", "0:4", "5:4"):
        with pytest.raises(ValueError, match="0 < n < m"):
            parse_n_of_m(bad)
    with pytest.raises(ValueError, match="or 'n:m'"):
        compute_masks(_Net(4, 4), 0.5, "2-4")
    with pytest.raises(ValueError, match="set target_sparsity=0.5"):
        SparseSoupConfig(output_dir="o", allocation="2:4", target_sparsity=0.9, report_to="none")
    assert SparseSoupConfig(output_dir="o", allocation="2:4", target_sparsity=0.5, report_to="none").allocation == "2:4"
    with pytest.warns(UserWarning, match="not a multiple of 4"):
        compute_masks(_Net(4, 6), 0.5, "2:4")


def test_the_sms_loop_keeps_two_four_through_retraining_and_soups(tmp_path):
    from conftest import sms_config

    from hf_sms import run_sms
    from hf_sms.cli.demo import DigitsResNet
    from hf_sms.data import load_digits_splits
    from hf_sms.evaluation import ClassificationAccuracy

    train, val, test = load_digits_splits(seed=0)
    args = sms_config(tmp_path, allocation="2:4", target_sparsity=0.5, max_steps=3)
    soup, results = run_sms(DigitsResNet(width=8), args, train, ClassificationAccuracy(), eval_dataset=val)
    linear = [m for m in soup.modules() if isinstance(m, nn.Linear)]
    assert linear and all((_groups(m.weight, 4) == 2).all() for m in linear)
    for replica in (tmp_path / "run" / "sms" / "phase2").glob("replica*"):
        loaded = load_sparse(str(replica), DigitsResNet(width=8))
        assert all((_groups(m.weight, 4) == 2).all() for m in loaded.modules() if isinstance(m, nn.Linear))
    assert results["rows"]["sms_uniform"][-1]["speedup"] > 1.0
