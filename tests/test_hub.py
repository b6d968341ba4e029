"""Model cards are valid YAML + Markdown; push_to_hub reaches the HTTP calls and never leaks the token."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from unittest import mock

import pytest
import yaml
from conftest import make_resnet, make_t5

from hf_sms import apply_masks, compute_masks, push_to_hub, save_sparse
from hf_sms.hub import model_card

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


def test_model_card_requires_a_sparse_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="sparsity.json"):
        model_card(str(tmp_path))


def _mock_api():
    create = mock.patch("huggingface_hub.HfApi.create_repo", return_value=SimpleNamespace(repo_id="me/t5-sms"))
    upload = mock.patch(
        "huggingface_hub.HfApi.upload_folder",
        return_value=SimpleNamespace(commit_url="https://huggingface.co/me/t5-sms/commit/abc"),
    )
    return create, upload


def test_push_folder_uploads_with_card_and_never_logs_the_token(soup_dir, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    create, upload = _mock_api()
    with create as create_repo, upload as upload_folder:
        url = push_to_hub(soup_dir, "me/t5-sms", token=TOKEN, private=True, base_model="google-t5/t5-small")
    assert url == "https://huggingface.co/me/t5-sms/commit/abc"
    create_repo.assert_called_once()
    assert create_repo.call_args.args[0] == "me/t5-sms" and create_repo.call_args.kwargs["private"] is True
    kwargs = upload_folder.call_args.kwargs
    assert kwargs["repo_id"] == "me/t5-sms" and kwargs["folder_path"] == soup_dir
    with open(f"{soup_dir}/README.md") as f:
        meta, _ = _front_matter(f.read())
    assert meta["base_model"] == "google-t5/t5-small"
    out = capsys.readouterr()
    assert TOKEN not in caplog.text and TOKEN not in out.out and TOKEN not in out.err
    assert TOKEN not in repr(upload_folder.call_args) and TOKEN not in repr(create_repo.call_args)


def test_push_model_saves_to_a_temporary_folder(caplog, capsys):
    caplog.set_level(logging.DEBUG)
    model = make_resnet()
    apply_masks(model, compute_masks(model, 0.8))
    seen = {}

    def fake_upload(self, **kwargs):
        import os

        seen["files"] = sorted(os.listdir(kwargs["folder_path"]))
        seen["folder"] = kwargs["folder_path"]
        return SimpleNamespace(commit_url="https://huggingface.co/me/r/commit/1")

    create, _ = _mock_api()
    with create, mock.patch("huggingface_hub.HfApi.upload_folder", fake_upload):
        push_to_hub(model, "me/r", token=TOKEN, recipe=RECIPE, metrics={"accuracy": 0.5})
    assert {"README.md", "config.json", "model.safetensors", "sparsity.json"} <= set(seen["files"])
    import os

    assert not os.path.exists(seen["folder"])  # the temporary folder is cleaned up
    out = capsys.readouterr()
    assert TOKEN not in caplog.text + out.out + out.err
