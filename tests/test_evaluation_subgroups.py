"""Subgroup recall by hand on a fixed prediction table; the group never reaches forward; CelebA attributes."""

import numpy as np
import pytest
import torch
from torch import nn

from hf_sms.evaluation.subgroups import (
    CELEBA_NAMES,
    SubgroupRecall,
    binary_attribute,
    celeba_blond_by_gender,
    read_celeba_attributes,
)

# (group, true class, predicted class) per example; group 0 female / 1 male, class 0 non-blond / 1 blond.
TABLE = [
    (0, 0, 0),
    (0, 0, 1),
    (0, 0, 0),  # female non-blond: 2/3
    (0, 1, 1),
    (0, 1, 1),  # female blond: 2/2
    (1, 0, 0),
    (1, 0, 0),
    (1, 0, 0),
    (1, 0, 1),  # male non-blond: 3/4
    (1, 1, 0),
    (1, 1, 1),  # male blond: 1/2, the worst group
]


class Stored(nn.Module):
    """Returns stored logits for the indices in ``x``; its forward takes ``x`` only, so a stray key fails."""

    def __init__(self, predicted: list[int], num_classes: int = 2):
        super().__init__()
        self.logits = nn.Parameter(5.0 * nn.functional.one_hot(torch.tensor(predicted), num_classes).float())

    def forward(self, x):
        return self.logits[x.long()]


def _data():
    # groups as tensors, as a torch dataset gives them: names must read "group=1", not "group=tensor(1)"
    return [
        {"x": torch.tensor(i), "labels": torch.tensor(y), "group": torch.tensor(g)} for i, (g, y, _) in enumerate(TABLE)
    ]


def test_per_group_and_worst_group_recall_by_hand():
    model = Stored([p for *_, p in TABLE])
    metric = SubgroupRecall(batch_size=4)  # several batches: groups must stay aligned with predictions
    details = metric.details(model, _data())
    assert details["per_group"] == pytest.approx(
        {"group=0,class=0": 200 / 3, "group=0,class=1": 100.0, "group=1,class=0": 75.0, "group=1,class=1": 50.0}
    )
    assert details["counts"] == {"group=0,class=0": 3, "group=0,class=1": 2, "group=1,class=0": 4, "group=1,class=1": 2}
    assert details["worst_group"] == "group=1,class=1"
    assert details["worst_group_recall"] == details["value"] == pytest.approx(50.0)
    assert details["mean_recall"] == pytest.approx((200 / 3 + 100 + 75 + 50) / 4)
    assert metric(model, _data()) == pytest.approx(50.0)


def test_readable_names_and_string_groups():
    model = Stored([p for *_, p in TABLE])
    named = SubgroupRecall(**CELEBA_NAMES).details(model, _data())
    assert named["per_group"]["blond,male"] == pytest.approx(50.0) and named["worst_group"] == "blond,male"
    assert set(named["per_group"]) == {"non-blond,female", "non-blond,male", "blond,female", "blond,male"}
    assert named["balanced_accuracy"] == pytest.approx(named["mean_recall"])
    balanced = SubgroupRecall(score="balanced", **CELEBA_NAMES)
    assert balanced(model, _data()) == pytest.approx(named["mean_recall"]) and balanced.name == "balanced accuracy"
    # default_data_collator drops string values; the groups are taken out before it runs
    data = [{"x": torch.tensor(i), "labels": torch.tensor(y), "sex": "FM"[g]} for i, (g, y, _) in enumerate(TABLE)]
    sex = SubgroupRecall(group_key="sex").details(model, data)
    assert sex["per_group"]["sex=M,class=1"] == pytest.approx(50.0) and sex["counts"]["sex=F,class=0"] == 3


def test_group_key_never_reaches_forward():
    seen = []

    class OnlyX(Stored):
        def forward(self, **inputs):
            seen.append(sorted(inputs))
            return super().forward(inputs["x"])

    model = OnlyX([p for *_, p in TABLE])
    metric = SubgroupRecall(batch_size=4)
    metric(model, _data())
    metric.predict(model, _data())
    assert seen and all(keys == ["x"] for keys in seen)


def test_ensemble_score_path():
    metric = SubgroupRecall()
    first = Stored([p for *_, p in TABLE])
    second = Stored([y for _, y, _ in TABLE])  # always right
    mean = (metric.predict(first, _data()) + 3 * metric.predict(second, _data())) / 4
    assert mean.shape == (len(TABLE), 2)
    assert metric.score(metric.predict(first, _data()), _data()) == pytest.approx(50.0)
    assert metric.score(mean, _data()) == pytest.approx(100.0)  # the ensemble fixes every subgroup


def test_items_without_the_group_key_fail_clearly():
    data = [{"x": torch.tensor(0), "labels": torch.tensor(0)}]
    with pytest.raises(ValueError, match="'group'"):
        SubgroupRecall()(Stored([0]), data)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(-1, 0), (1, 1), (0, 0), (True, 1), (False, 0), ("-1", 0), (" 1", 1), ("True", 1), ("false", 0)]
    + [(torch.tensor(1), 1), (torch.tensor(False), 0), (np.int64(-1), 0), (np.bool_(True), 1), (1.0, 1)],
)
def test_binary_attribute_handles_minus_one_zero_one_and_booleans(value, expected):
    assert binary_attribute(value) == expected


@pytest.mark.parametrize("value", [2, -2, "yes", 0.5])
def test_binary_attribute_rejects_other_values(value):
    with pytest.raises(ValueError, match="-1/1, 0/1 or a boolean"):
        binary_attribute(value)


def test_celeba_blond_by_gender_maps_hub_rows():
    assert celeba_blond_by_gender({"Blond_Hair": True, "Male": False, "image": None}) == {"labels": 1, "group": 0}
    assert celeba_blond_by_gender({"Blond_Hair": -1, "Male": 1}) == {"labels": 0, "group": 1}
    assert celeba_blond_by_gender({"Blond_Hair": 1, "Male": 0}) == {"labels": 1, "group": 0}


def test_read_celeba_attributes_csv(tmp_path):
    path = tmp_path / "list_attr_celeba.csv"
    path.write_text(
        "image_id,5_o_Clock_Shadow,Blond_Hair,Male,Young\n"
        "000001.jpg,-1,-1,-1,1\n"
        "000002.jpg,1,1,1,-1\n"
        "000003.jpg,-1,1,-1,1\n"
    )
    assert read_celeba_attributes(str(path)) == {  # the paper's: gender predicted, blond hair the group
        "000001.jpg": {"labels": 0, "group": 0},
        "000002.jpg": {"labels": 1, "group": 1},
        "000003.jpg": {"labels": 0, "group": 1},
    }
    assert read_celeba_attributes(str(path), celeba_blond_by_gender)["000003.jpg"] == {"labels": 1, "group": 0}
    bad = tmp_path / "bad.csv"
    bad.write_text("image_id,Blond_Hair\n000001.jpg,1\n")
    with pytest.raises(ValueError, match="Male"):
        read_celeba_attributes(str(bad))
