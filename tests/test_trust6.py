"""Trust, sixth round (issue 54): no route the card offers evaluates a crafted program, a run on a model of a local
class finishes, and inputs that went wrong are refused with the fix before any work."""

from __future__ import annotations

import pytest
import torch
from conftest import sms_config

from hf_sms import run_sms
from hf_sms.data import load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits(seed=0)


def _local_model():
    class Local(torch.nn.Module):  # defined inside a function: its class cannot be imported by name
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(64, 32)
            self.fc2 = torch.nn.Linear(32, 10)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    torch.manual_seed(0)
    return Local()


def test_a_run_on_a_model_of_a_local_class_finishes_and_its_card_says_how_to_load_it(tmp_path, digits):
    """Item 2: the first replica's card raised "is not a class name; re-save the checkpoint"."""
    train, val, _ = digits
    args = sms_config(tmp_path, n_phases=1, num_replicas=2, max_steps=2, measure_speedup=False)
    run_sms(_local_model(), args, train, ClassificationAccuracy(), eval_dataset=val)
    card = (tmp_path / "run" / "final_soup" / "README.md").read_text()
    assert "cannot be imported by name" in card and "model=MyModel(...)" in card
    assert "re-save" not in card
