"""The learned soup (issue 38 item 2): per-tensor mixing weights fitted on held-out data. It moves toward the
candidate that fits, its soup is exactly the mix of its fitted weights (a straightforward reference, one entry at a
time), keeps the mask (property test), fits on a share of validation no other soup sees, and runs in the loop."""

import pytest
import torch
from conftest import sms_config
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_sms import SparseModelSoup, load_sparse
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.pruning.masks import masks_from_model
from hf_sms.soup.learned import FitData, fit_mixing
from hf_sms.soup.soup import soup

DEFAULTS = {"lr": 0.05, "steps": 20, "fraction": 0.5, "per_module": 0}


class Regression(nn.Module):
    def __init__(self, n_in: int = 6, n_out: int = 3, dtype=torch.float32):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out, dtype=dtype)

    def forward(self, x):
        return self.fc(x.to(self.fc.weight.dtype))


def _mse(model, batch):
    return ((model(x=batch["x"]).float() - batch["labels"]) ** 2).mean()


def _data(teacher: nn.Module, n: int = 64, seed: int = 0) -> FitData:
    x = torch.randn(n, teacher.fc.in_features, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y = teacher(x).float()
    rows = [{"x": x[i], "labels": y[i]} for i in range(n)]
    return FitData(rows, 16, torch.utils.data.default_collate, _mse)


def test_the_fit_moves_each_tensor_toward_the_candidate_that_fits():
    torch.manual_seed(0)
    good, bad = Regression(), Regression()
    weights = fit_mixing([good.state_dict(), bad.state_dict()], good, _data(good), {**DEFAULTS, "steps": 120}, seed=1)
    assert set(weights) == {"fc.weight", "fc.bias"}
    assert all(w[0] > 0.8 and sum(w) == pytest.approx(1.0) for w in weights.values()), weights
    tied = fit_mixing([good.state_dict(), bad.state_dict()], good, _data(good), {**DEFAULTS, "per_module": 1}, seed=1)
    assert tied["fc.weight"] == tied["fc.bias"]  # one softmax per module


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    sparsity=st.floats(0.0, 0.99),
    seed=st.integers(0, 2**16),
)
def test_the_soup_is_the_mix_of_its_fitted_weights_and_keeps_the_mask(m, dtype, sparsity, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 6, generator=g) >= sparsity
    candidates = []
    for _ in range(m):
        model = Regression(dtype=dtype)
        with torch.no_grad():
            model.fc.weight.copy_(torch.randn(3, 6, generator=g) * mask)
            model.fc.bias.copy_(torch.randn(3, generator=g))
        candidates.append(model)
    data = _data(Regression(), n=8, seed=seed)
    options = {**DEFAULTS, "steps": 1}
    result, _ = soup(candidates, "learned", fit=data, options=options, seed=seed)
    weights = fit_mixing([c.state_dict() for c in candidates], candidates[0], data, options, seed)
    for name, got in result.state_dict().items():
        xs = [c.state_dict()[name].flatten().tolist() for c in candidates]
        ref = [sum(w * x[j] for w, x in zip(weights[name], xs)) for j in range(len(xs[0]))]
        assert torch.equal(got.flatten(), torch.tensor(ref, dtype=torch.float64).to(dtype)), name
    assert not result.fc.weight[~mask].any()  # no pruned weight revived
    assert torch.equal(masks_from_model(result)["fc.weight"], masks_from_model(candidates[0])["fc.weight"])


def test_options_and_inputs_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="whole number"):
        sms_config(tmp_path, merge_methods=["learned"], soup_options={"learned": {"steps": 2.5}})
    with pytest.raises(ValueError, match=r"fraction.*0.9"):
        sms_config(tmp_path, merge_methods=["learned"], soup_options={"learned": {"fraction": 0.95}})
    with pytest.raises(ValueError, match="weighted mean"):
        sms_config(tmp_path, merge_methods=["learned"], replica_params="bias_norm")
    with pytest.raises(ValueError, match="held-out data"):
        soup([Regression(), Regression()], "learned")
    empty = FitData([], 4, torch.utils.data.default_collate, _mse)
    with pytest.raises(ValueError, match="no examples"):
        fit_mixing([Regression().state_dict()], Regression(), empty, DEFAULTS, seed=0)


def test_a_run_fits_on_its_own_share_of_validation_and_keeps_the_mask(tmp_path):
    """merge_methods=["learned", "uniform"]: a share of the validation set (half, fixed seed) is the learned soup's
    alone, every other score uses the rest; the learned soup keeps the replicas' mask exactly."""
    train, val, test = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:256], train.labels[:256], train.augment)
    args = sms_config(tmp_path, n_phases=1, num_replicas=3, merge_methods=["learned", "uniform"], max_steps=8)
    torch.manual_seed(0)
    runner = SparseModelSoup(DigitsResNet(width=4), args, train, ClassificationAccuracy(), val, test)
    held, rest = runner.fit_data.dataset, runner.eval_dataset
    assert len(held) + len(rest) == len(val) and not set(held.indices) & set(rest.indices)
    assert len(held) == round(len(val) * 0.5)
    learned = runner.run()
    assert {"sms_learned", "sms_uniform"} <= set(runner.results["rows"])
    replica = load_sparse(str(tmp_path / "run" / "sms" / "phase1" / "replica0"), DigitsResNet(width=4))
    trained, got = masks_from_model(replica), masks_from_model(learned)
    assert all(torch.equal(got[n], trained[n]) for n in trained)  # the soup has the replicas' mask exactly
