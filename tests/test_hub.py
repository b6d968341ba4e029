"""Model cards are valid YAML + Markdown that name every metric and split, parse with huggingface_hub's own
model-index reader and never contradict themselves; push_to_hub reaches the HTTP calls and never leaks the token."""

from __future__ import annotations

import json
import logging
import os
from tempfile import mkdtemp as tempfile_mkdtemp
from unittest import mock

import pytest
import yaml
from conftest import fake_hub, make_resnet, make_t5

from hf_sms import apply_masks, compute_masks, push_to_hub, save_sparse
from hf_sms.records.hub import SPEEDUP, card_metrics, model_card

RECIPE = {
    "phases": [
        {"phase": 1, "sparsity": 0.54, "soup_accuracy": 0.71, "best_candidate": 0.70},
        {"phase": 2, "sparsity": 0.9, "soup_accuracy": 0.69, "best_candidate": 0.67},
    ],
    "m": 3,
    "varied": "seed",
    "merge_method": "uniform",
}
TOKEN = "hf_SECRETtokenDoNotLeak0123456789"


def _front_matter(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    _, front, body = card.split("---\n", 2)
    return yaml.safe_load(front), body


@pytest.fixture
def soup_dir(tmp_path):
    model = make_t5()
    apply_masks(model, compute_masks(model, 0.9, "uniform"))
    return save_sparse(model, str(tmp_path / "soup"), recipe=RECIPE, metrics={"bleu": 12.5, "loss": 1.25})


def test_model_card_front_matter_and_body(soup_dir):
    card = model_card(soup_dir, "me/t5-sms", base_model="google-t5/t5-small", datasets=["wmt16"], speedup=1.3)
    meta, body = _front_matter(card)
    assert meta["library_name"] == "transformers"
    assert {"sparse", "pruning", "model-soup"} <= set(meta["tags"])
    assert meta["base_model"] == "google-t5/t5-small" and meta["datasets"] == ["wmt16"]
    assert meta["metrics"] == ["bleu", "loss"]
    with open(f"{soup_dir}/sparsity.json") as f:
        sparsity = json.load(f)["sparsity"]
    assert f"**{100 * sparsity:.2f}%**" in body and "1.3x" in body
    assert "| phase | sparsity | soup_accuracy | best_candidate |" in body
    assert body.count("\n| 1 |") == 1 and body.count("\n| 2 |") == 1
    assert "- merge_method: uniform" in body and "- m: 3" in body
    assert "import hf_sms" in body and 'T5ForConditionalGeneration.from_pretrained("me/t5-sms")' in body
    assert "| bleu | 12.5 |" in body
    assert body.count("```") % 2 == 0 and "<details>" in body and "</details>" in body


def test_model_card_for_dense_timm_needs_no_hf_sms(tmp_path):
    directory = save_sparse(make_resnet(), str(tmp_path / "r"), "dense")
    meta, body = _front_matter(model_card(directory, "me/resnet"))
    assert meta["library_name"] == "timm" and "base_model" not in meta and "metrics" not in meta
    assert 'timm.create_model("hf-hub:me/resnet", pretrained=True)' in body and "import hf_sms" not in body
    assert "not measured" in body


# A T5 soup as the paper reports it: BLEU on two splits, the dense model and IMP beside the soup.
T5_RESULTS = [
    {"model": "soup", "split": "validation", "metric": "BLEU", "value": 19.57},
    {"model": "soup", "split": "test", "metric": "BLEU", "value": 18.95},
    {"model": "dense", "split": "test", "metric": "BLEU", "value": 20.1},
    {"model": "imp", "split": "test", "metric": "BLEU", "value": 18.2},
]
T5_RECIPE = {"phases": [0.5, 0.75, 0.9], "m": [3, 3, 3], "merge_method": "uniform"}


@pytest.fixture
def t5_dir(tmp_path):
    model = make_t5()
    apply_masks(model, compute_masks(model, 0.9, "uniform"))
    return save_sparse(model, str(tmp_path / "t5"), recipe=T5_RECIPE)


def _speedup_lines(card: str) -> list[str]:
    """Lines stating the theoretical speedup (the measured one has its own line)."""
    from hf_sms.records.hub import MEASURED

    return [line for line in card.splitlines() if "speedup" in line.lower() and not line.startswith(f"- {MEASURED}")]


def test_model_card_names_metric_and_split_and_parses_on_the_hub(t5_dir):
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

    card = model_card(t5_dir, "me/t5-sms", datasets=["wmt16"], results=T5_RESULTS, speedup=3.715)
    meta, body = _front_matter(card)
    assert meta["metrics"] == ["bleu"]  # metric types, never split names
    name, results = model_index_to_eval_results(meta["model-index"])
    assert name == "me/t5-sms" and eval_results_to_model_index(name, results) == meta["model-index"]
    parsed = ModelCard(card).data  # huggingface_hub's own parser and validation
    assert parsed.model_name == "me/t5-sms"
    got = [
        (r.task_type, r.dataset_type, r.dataset_split, r.metric_type, r.metric_name, r.metric_value)
        for r in parsed.eval_results
    ]
    assert got == [  # the soup's rows only
        ("translation", "wmt16", "validation", "bleu", "BLEU", 19.57),
        ("translation", "wmt16", "test", "bleu", "BLEU", 18.95),
    ]
    assert "| split | metric | dense | soup | imp |" in body
    assert "| test | BLEU | 20.1 | 18.95 | 18.2 |" in body and "| validation | BLEU |  | 19.57 |  |" in body
    assert "| phase | sparsity |" in body and "| 3 | 90.00% |" in body
    # The speedup is stated once, as theoretical, and nothing says it is unknown.
    (line,) = _speedup_lines(card)
    assert line.startswith(f"- {SPEEDUP}: **3.715x** over the dense model.")
    assert "runs faster only with sparse kernels" in line  # unstructured: the FLOPs are not saved as they are
    assert card.count("3.715") == 1 and "not measured" not in card


def test_model_card_reads_results_and_speedup_from_sparsity_json(t5_dir, tmp_path):
    model = make_t5()
    apply_masks(model, compute_masks(model, 0.9, "uniform"))
    stored = save_sparse(
        model, str(tmp_path / "stored"), recipe=T5_RECIPE, metrics=card_metrics(T5_RESULTS, speedup=3.715)
    )
    given = model_card(t5_dir, "me/t5-sms", datasets=["wmt16"], results=T5_RESULTS, speedup=3.715)
    assert model_card(stored, "me/t5-sms", datasets=["wmt16"]) == given
    # an argument overrides the stored value it names and keeps the others
    overridden = model_card(stored, "me/t5-sms", datasets=["wmt16"], speedup=2.0)
    assert (
        "**2x**" in overridden and "3.715" not in overridden and "| test | BLEU | 20.1 | 18.95 | 18.2 |" in overridden
    )


def test_unknown_speedup_is_said_once_and_never_shown(t5_dir):
    card = model_card(t5_dir, "me/t5-sms", results=T5_RESULTS)
    assert len(_speedup_lines(card)) == 1 and card.count("not measured") == 1
    assert "x**" not in card
    meta, _ = _front_matter(card)
    assert "model-index" not in meta  # no dataset known: the Hub requires one, so nothing is indexed


def test_flat_metrics_still_work_and_their_speedup_is_not_a_metric(t5_dir):
    card = model_card(t5_dir, "me/t5-sms", metrics={"BLEU": 18.95, "speedup": 3.715})
    meta, body = _front_matter(card)
    assert meta["metrics"] == ["bleu"] and "| - | BLEU | 18.95 |" in body
    assert len(_speedup_lines(card)) == 1 and card.count("3.715") == 1 and "not measured" not in card


def test_fairness_and_ood_rows_name_their_dataset_and_task(t5_dir):
    rows = [
        {"model": "soup", "split": "test", "metric": "worst-group recall", "value": 71.2, "dataset": "celeba"},
        {"model": "soup", "split": "test", "metric": "top-1 accuracy", "value": 94.0, "dataset": "celeba"},
        {"model": "soup", "split": "corruptions", "metric": "OOD accuracy", "value": 51.0, "dataset": "cifar100_c"},
        {"model": "soup", "split": "val", "metric": "mIoU", "value": 70.0, "dataset": "cityscapes"},
    ]
    meta, _ = _front_matter(model_card(t5_dir, "me/x", results=rows))
    assert meta["metrics"] == ["recall", "accuracy", "mean_iou"]
    index = meta["model-index"][0]["results"]
    assert [(r["task"]["type"], r["dataset"]["type"], r["dataset"]["split"]) for r in index] == [
        ("image-classification", "celeba", "test"),
        ("image-classification", "cifar100_c", "corruptions"),
        ("image-segmentation", "cityscapes", "val"),
    ]
    assert [m["name"] for m in index[0]["metrics"]] == ["worst-group recall", "top-1 accuracy"]


def test_card_inputs_are_checked(t5_dir):
    with pytest.raises(TypeError, match="theoretical speedup, a number"):
        model_card(t5_dir, speedup="fast")
    with pytest.raises(ValueError, match="speedup="):
        model_card(t5_dir, results=[{"split": "test", "metric": "speedup", "value": 2.0}])
    with pytest.raises(ValueError, match="needs a number"):
        model_card(t5_dir, results=[{"split": "test", "metric": "BLEU", "value": "high"}])


def test_older_flat_records_in_sparsity_json_give_their_numbers(tmp_path):
    model = make_t5()
    apply_masks(model, compute_masks(model, 0.9, "uniform"))
    folder = save_sparse(model, str(tmp_path / "old"), metrics={"val": 19.57, "speedup": 3.715, "note": "by hand"})
    meta, body = _front_matter(model_card(folder, "me/t5"))
    assert meta["metrics"] == ["val"] and "| - | val | 19.57 |" in body and "by hand" not in body
    assert body.count("3.715") == 1 and "not measured" not in body


def test_model_card_requires_a_sparse_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="sparsity.json"):
        model_card(str(tmp_path))


def test_push_folder_uploads_with_card_and_never_logs_the_token(soup_dir, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    before = sorted(os.listdir(soup_dir))
    with fake_hub("me/t5-sms") as sent:
        url = push_to_hub(soup_dir, "me/t5-sms", token=TOKEN, private=True, base_model="google-t5/t5-small")
    assert url == "https://huggingface.co/me/t5-sms/commit/abc"
    create_repo = sent["create"]
    create_repo.assert_called_once()
    assert create_repo.call_args.args[0] == "me/t5-sms" and create_repo.call_args.kwargs["private"] is True
    assert sent["commit_kwargs"]["repo_id"] == "me/t5-sms"
    meta, _ = _front_matter(sent["files"]["README.md"].decode())
    assert meta["base_model"] == "google-t5/t5-small"
    assert sorted(os.listdir(soup_dir)) == before  # nothing written into the folder
    out = capsys.readouterr()
    assert TOKEN not in caplog.text and TOKEN not in out.out and TOKEN not in out.err
    assert TOKEN not in repr(sent["commit_kwargs"]) and TOKEN not in repr(create_repo.call_args)


def test_push_model_saves_to_a_temporary_folder(caplog, capsys):
    caplog.set_level(logging.DEBUG)
    model = make_resnet()
    apply_masks(model, compute_masks(model, 0.8))
    made = []

    def mkdtemp(*args, **kwargs):
        made.append(tempfile_mkdtemp(*args, **kwargs))
        return made[-1]

    with mock.patch("tempfile.mkdtemp", mkdtemp), fake_hub() as sent:
        push_to_hub(model, "me/r", token=TOKEN, recipe=RECIPE, metrics={"accuracy": 0.5})
    assert {"README.md", "config.json", "model.safetensors", "sparsity.json"} <= set(sent["files"])
    metrics = json.loads(sent["files"]["sparsity.json"])["metrics"]
    assert metrics["results"] == [{"model": "soup", "split": None, "metric": "accuracy", "value": 0.5}]
    assert "| - | accuracy | 0.5 |" in sent["files"]["README.md"].decode()
    assert made and not any(os.path.exists(d) for d in made)  # the temporary folders are cleaned up
    out = capsys.readouterr()
    assert TOKEN not in caplog.text + out.out + out.err


def test_measured_speedup_goes_next_to_the_flop_count(t5_dir, tmp_path):
    from hf_sms.records.hub import MEASURED

    record = {"speedup": 2.5, "dense_ms": 10.0, "runtime_ms": 4.0, "device": "cpu", "threads": 1,
              "input": "input_ids 1x32", "sparse_layers": "17/17", "layout": "auto"}  # fmt: skip
    model = make_t5()
    apply_masks(model, compute_masks(model, 0.9, "uniform"))
    stored = save_sparse(model, str(tmp_path / "s"), metrics=card_metrics(T5_RESULTS, speedup=3.715, measured=record))
    card = model_card(stored, "me/t5-sms")
    (line,) = [x for x in card.splitlines() if x.startswith(f"- {MEASURED}")]
    assert "2.50x (10.00 ms dense vs 4.00 ms; cpu, 1 thread(s), input input_ids 1x32" in line
    assert f"- {SPEEDUP}: **3.715x**" in card
    assert "hf-sms speed DIR" in model_card(t5_dir, "me/t5-sms")  # unknown: says how to measure it
