"""Runs on a GPU: skipped without one (CI has none); ``benchmarks/gpu_check.sh`` step (j) runs them on a lent device.

A model is usually loaded on the CPU and handed to the run as it is; the run trains on the GPU. Every model it then
builds (the pruned starts, the replicas, the soups, the baselines) must live on the GPU too, so pruning, BatchNorm
recalibration and every score run there, not on the CPU where the user's model was loaded."""

import json

import pytest
import torch
from conftest import sms_config

from hf_sms import run_sms, sparsity_report
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.pruning.masks import masks_from_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Where(ClassificationAccuracy):
    """Accuracy that records the device of every model it scores."""

    def __init__(self):
        super().__init__()
        self.devices = []

    def batch_statistics(self, model, batch, device):
        self.devices.append(next(model.parameters()).device.type)
        return super().batch_statistics(model, batch, device)


@pytest.fixture(scope="module")
def digits():
    train, val, test = load_digits_splits(seed=0)
    return TensorDictDataset(train.x[:256], train.labels[:256], train.augment), val, test


def _run(tmp_path, digits, **overrides):
    train, val, test = digits
    torch.manual_seed(0)
    model, where = DigitsResNet(width=4), Where()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = sms_config(tmp_path, use_cpu=False, **overrides)
    soup, results = run_sms(model, args, train, where, eval_dataset=val, test_dataset=test)
    assert all(p.device.type == "cpu" for p in model.parameters()), "the user's model was moved"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the user's model was modified"
    assert where.devices and set(where.devices) == {"cuda"}, f"scored on {sorted(set(where.devices))}"
    assert all(p.device.type == "cuda" for p in soup.parameters())
    return soup, results


@pytest.mark.parametrize("replica_params", ["all", "bias_norm"])
def test_a_cpu_model_is_pruned_souped_and_scored_on_the_gpu(tmp_path, digits, replica_params):
    baselines = ["imp", "imp_mx", "imp_reprune", "swamp"] if replica_params == "all" else ["imp", "imp_mx"]
    soup, results = _run(
        tmp_path, digits, replica_params=replica_params, merge_methods=["uniform", "greedy"], baselines=baselines
    )
    assert sparsity_report(soup)["sparsity"] == pytest.approx(0.8, abs=1e-3)
    for name, mask in masks_from_model(soup).items():  # the soup's zeros are its mask's, on the GPU
        assert mask.device.type == "cuda", name
    assert {"sms_uniform", "sms_greedy", *baselines} <= set(results["rows"])


def test_gmp_with_sms_runs_on_the_gpu(tmp_path, digits):
    soup, results = _run(
        tmp_path, digits, pruning_method="gmp", max_steps=-1, num_train_epochs=8, sms_start_epoch=5, baselines=[]
    )
    assert sparsity_report(soup)["sparsity"] == pytest.approx(0.8, abs=1e-3)


def test_a_unit_run_saves_its_smaller_soup_from_the_gpu(tmp_path, digits):
    soup, results = _run(tmp_path, digits, structure="filters", target_sparsity=0.5, n_phases=1, baselines=[])
    shrunk = json.loads((tmp_path / "run" / "final_soup" / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert shrunk["saved"] == "smaller" and shrunk["parameter_ratio"] < 0.95, shrunk
