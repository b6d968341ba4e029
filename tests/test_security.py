"""Hostile inputs and secrets: the Hub token never reaches a file we write, copy or upload; a checkpoint folder
cannot make hf-sms read, copy or upload a file outside it; no prompt for remote code; names stay plain."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from conftest import make_cnn, make_image_dataset, make_t5, sms_config, training_args
from huggingface_hub.utils import filter_repo_objects

from hf_sms import SparseSoupConfig, SparseSoupTrainer, apply_masks, compute_masks, load_sparse, run_sms, save_sparse
from hf_sms.checkpoint import merge_checkpoints
from hf_sms.checkpoint.inspect import inspect_checkpoint
from hf_sms.data import load_digits_splits
from hf_sms.demo import DigitsResNet
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.hub import push_to_hub
from hf_sms.registry import Registry

TOKEN = "hf_SECRETsecretSECRET0123456789"


def _files_holding(root, secret: str) -> list[str]:
    """Every file under ``root`` whose bytes contain ``secret`` (also as UTF-16, as some pickles store text)."""
    needles = (secret.encode(), secret.encode("utf-16-le"))
    hits = []
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            if any(n in data for n in needles):
                hits.append(os.path.relpath(os.path.join(folder, name), root))
    return hits


# -- 1. the token ---------------------------------------------------------------------------------------------
def test_pickled_config_holds_no_token_but_copies_keep_it():
    args = SparseSoupConfig(output_dir="o", hub_token=TOKEN, report_to="none")
    assert pickle.loads(pickle.dumps(args)).hub_token is None
    assert copy.deepcopy(args).hub_token == TOKEN and copy.copy(args).hub_token == TOKEN
    assert TOKEN not in repr(args) and TOKEN not in json.dumps(args.to_dict())


def test_no_file_a_trainer_writes_holds_the_token(tmp_path):
    model = make_cnn()
    args = training_args(
        str(tmp_path / "o"), SparseSoupConfig, hub_token=TOKEN, save_strategy="steps", save_steps=4, max_steps=8
    )
    trainer = SparseSoupTrainer(model, args, train_dataset=make_image_dataset())
    trainer.train()
    trainer.save_model()
    written = sorted(os.listdir(tmp_path / "o"))
    assert "training_args.bin" in written and any(n.startswith("checkpoint-") for n in written)
    assert _files_holding(tmp_path, TOKEN) == []
    loaded = torch.load(tmp_path / "o" / "training_args.bin", weights_only=False)  # our own file, in a test
    assert loaded.hub_token is None and loaded.learning_rate == args.learning_rate


def test_no_file_of_an_sms_run_holds_the_token(tmp_path):
    train, val, test = load_digits_splits(seed=0)
    args = sms_config(
        tmp_path, hub_token=TOKEN, max_steps=2, baselines=["imp"], n_phases=1, save_strategy="steps", save_steps=1
    )
    run_sms(DigitsResNet(width=4), args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=test)
    assert os.path.isdir(tmp_path / "run" / "final_soup")
    assert any(n == "training_args.bin" for _, _, names in os.walk(tmp_path) for n in names)  # pickles were written
    assert _files_holding(tmp_path, TOKEN) == []


def _checkpoint_with_trainer_files(folder, seed=0):
    model = make_cnn(seed=seed)
    apply_masks(model, compute_masks(model, 0.5))
    save_sparse(model, str(folder))
    torch.save({"hub_token": TOKEN}, folder / "training_args.bin")  # as an older hf-sms or plain Trainer wrote
    torch.save({"state": TOKEN}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    return str(folder)


def test_merge_copies_only_published_files(tmp_path):
    a, b = (_checkpoint_with_trainer_files(tmp_path / n) for n in ("r0", "r1"))
    merge_checkpoints([a, b], str(tmp_path / "soup"))
    assert sorted(os.listdir(tmp_path / "soup")) == ["model.safetensors", "sparsity.json", "tokenizer_config.json"]
    assert _files_holding(tmp_path / "soup", TOKEN) == []
    assert json.loads((tmp_path / "soup" / "sparsity.json").read_text())["recipe"]["merged_from"] == ["r0", "r1"]


def test_push_uploads_an_allow_list(tmp_path):
    folder = _checkpoint_with_trainer_files(tmp_path / "soup")
    seen = {}

    def upload(self, **kwargs):
        names = sorted(os.listdir(kwargs["folder_path"]))
        patterns = {k: kwargs[k] for k in ("allow_patterns", "ignore_patterns")}
        seen["uploaded"] = sorted(filter_repo_objects(names, **patterns))  # what huggingface_hub would send
        return SimpleNamespace(commit_url="u")

    create = mock.patch("huggingface_hub.HfApi.create_repo", return_value=SimpleNamespace(repo_id="me/r"))
    with create, mock.patch("huggingface_hub.HfApi.upload_folder", upload):
        push_to_hub(folder, "me/r", token=TOKEN)
    assert seen["uploaded"] == ["README.md", "model.safetensors", "sparsity.json", "tokenizer_config.json"]


# -- 2. files outside the folder --------------------------------------------------------------------------------
def test_a_symlink_out_of_an_input_folder_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(TOKEN)
    a, b = (_checkpoint_with_trainer_files(tmp_path / n) for n in ("r0", "r1"))
    os.remove(os.path.join(a, "tokenizer_config.json"))
    os.symlink(secret, os.path.join(a, "tokenizer_config.json"))
    with pytest.raises(ValueError, match="outside its checkpoint folder"):
        merge_checkpoints([a, b], str(tmp_path / "soup"))
    assert not (tmp_path / "soup").exists()
    with pytest.raises(ValueError, match="outside its checkpoint folder"):
        push_to_hub(a, "me/r", token=TOKEN)  # refused before any request
    os.remove(os.path.join(a, "model.safetensors"))  # the weights themselves behind a link
    shutil.copy(os.path.join(b, "model.safetensors"), tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", os.path.join(a, "model.safetensors"))
    for read in (load_sparse, inspect_checkpoint):
        with pytest.raises(ValueError, match="outside its checkpoint folder"):
            read(a, make_cnn()) if read is load_sparse else read(a)


def _index_pointing_outside(tmp_path):
    model = make_t5()
    apply_masks(model, compute_masks(model, 0.5))
    folder = tmp_path / "ckpt"
    save_sparse(model, str(folder))
    os.replace(folder / "model.safetensors", tmp_path / "outside.safetensors")
    index = {"metadata": {}, "weight_map": {k: "../outside.safetensors" for k in model.state_dict()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(folder)


def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path):
    from transformers import T5ForConditionalGeneration

    folder = _index_pointing_outside(tmp_path)
    other = str(tmp_path / "other")
    shutil.copytree(folder, other)
    for read in (load_sparse, inspect_checkpoint, lambda d: merge_checkpoints([d, other], str(tmp_path / "soup"))):
        with pytest.raises(ValueError, match="outside the folder"):
            read(folder)
    with pytest.raises(ValueError, match="outside"):
        T5ForConditionalGeneration.from_pretrained(folder)


def test_a_hub_cache_snapshot_with_links_into_its_blobs_loads(tmp_path):
    model = make_cnn()
    apply_masks(model, compute_masks(model, 0.5))
    save_sparse(model, str(tmp_path / "saved"))
    repo = tmp_path / "models--me--r"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in os.listdir(tmp_path / "saved"):
        shutil.copy(tmp_path / "saved" / name, repo / "blobs" / f"blob-{name}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob-{name}"), snapshot / name)
    loaded = load_sparse(str(snapshot), make_cnn(seed=1))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


# -- 3. no prompt, no remote code ------------------------------------------------------------------------------
def test_load_sparse_never_asks_about_remote_code(tmp_path):
    model = make_t5()
    apply_masks(model, compute_masks(model, 0.5))
    folder = tmp_path / "ckpt"
    save_sparse(model, str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    with mock.patch("builtins.input", side_effect=AssertionError("prompted")):
        loaded = load_sparse(str(folder))
    assert type(loaded).__name__ == "T5ForConditionalGeneration"
    # a model type transformers does not know is where it would ask (and run evil.py if told yes)
    config["model_type"] = "evil"
    (folder / "config.json").write_text(json.dumps(config))
    with mock.patch("builtins.input") as asked, pytest.raises(ValueError):
        load_sparse(str(folder))
    assert asked.call_count == 0


# -- 4. registered names become folder names ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../x", "a/b", "", "x y", "1st", ".hidden"])
def test_registered_names_must_be_plain_identifiers(name):
    registry = Registry("baseline")
    with pytest.raises(ValueError, match="plain identifier"):
        registry.register(name)(lambda runner: None)
    registry.register("imp_2")(lambda runner: None)  # a plain one is fine
