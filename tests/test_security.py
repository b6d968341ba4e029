"""Hostile inputs and secrets: the Hub token never reaches a file we write, copy or upload; a checkpoint folder
cannot make hf-sms read, copy or upload a file outside it; no prompt for remote code; names stay plain."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from unittest import mock

import pytest
import torch
from conftest import fake_hub, make_cnn, make_image_dataset, make_t5, sms_config, training_args

from hf_sms import SparseSoupConfig, SparseSoupTrainer, apply_masks, compute_masks, load_sparse, run_sms, save_sparse
from hf_sms.checkpoint import merge_checkpoints
from hf_sms.checkpoint.inspect import inspect_checkpoint
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.records.hub import push_to_hub
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
    assert sorted(os.listdir(tmp_path / "soup")) == [
        "README.md", "model.safetensors", "sparsity.json", "tokenizer_config.json"]  # fmt: skip
    assert _files_holding(tmp_path / "soup", TOKEN) == []
    assert json.loads((tmp_path / "soup" / "sparsity.json").read_text())["recipe"]["merged_from"] == ["r0", "r1"]


def test_push_uploads_an_allow_list(tmp_path):
    folder = _checkpoint_with_trainer_files(tmp_path / "soup")
    with fake_hub() as sent:
        push_to_hub(folder, "me/r", token=TOKEN)
    assert sorted(sent["files"]) == ["README.md", "model.safetensors", "sparsity.json", "tokenizer_config.json"]
    assert not any(TOKEN.encode() in data for data in sent["files"].values())


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


def test_a_link_to_blobs_outside_a_real_hub_cache_is_refused(tmp_path):
    """A folder laid out like a cache snapshot whose ``blobs`` is itself a link (to a private folder) gets no
    exception: its files are outside it."""
    private = tmp_path / "private"
    private.mkdir()
    (private / "token").write_text(TOKEN)
    a, b = (_checkpoint_with_trainer_files(tmp_path / n) for n in ("r0", "r1"))
    repo = tmp_path / "models--me--r"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(a, snapshot)
    os.symlink(private, repo / "blobs")
    os.remove(snapshot / "tokenizer_config.json")
    os.symlink(os.path.join("..", "..", "blobs", "token"), snapshot / "tokenizer_config.json")
    assert (snapshot / "tokenizer_config.json").read_text() == TOKEN  # the link does lead to the secret
    with fake_hub() as sent, pytest.raises(ValueError, match="outside its checkpoint folder"):
        push_to_hub(str(snapshot), "me/r", token=TOKEN)
    assert sent["files"] == {} and not sent["create"].called
    with pytest.raises(ValueError, match="outside its checkpoint folder"):
        merge_checkpoints([str(snapshot), b], str(tmp_path / "soup"))
    assert not (tmp_path / "soup").exists()
    # a link from a real blobs folder to a file elsewhere is refused too: the target must be inside blobs
    os.remove(repo / "blobs")
    (repo / "blobs").mkdir()
    os.symlink(private / "token", repo / "blobs" / "token")
    with pytest.raises(ValueError, match="outside its checkpoint folder"):
        merge_checkpoints([str(snapshot), b], str(tmp_path / "soup"))


def test_push_writes_nothing_through_a_link_planted_in_the_folder(tmp_path):
    victim = tmp_path / "victim.pth"
    victim.write_text("untouched\n")
    folder = _checkpoint_with_trainer_files(tmp_path / "soup")
    for name in ("README.md.tmp", ".README.md.tmp", "README.md~"):
        os.symlink(victim, os.path.join(folder, name))
    info = json.loads((tmp_path / "soup" / "sparsity.json").read_text())
    info["recipe"] = {"note\nimport os": "x\nimport os; os.system('echo pwned')\n# [link](https://evil) <script>"}
    info["mask_hash"] = "`\n```\nimport os"
    (tmp_path / "soup" / "sparsity.json").write_text(json.dumps(info))
    before = {n: (tmp_path / "soup" / n).read_bytes() for n in os.listdir(folder) if not n.startswith(("README.md.",
              ".README", "README.md~"))}  # fmt: skip
    with fake_hub() as sent:
        push_to_hub(folder, "me/r", token=TOKEN)
    assert victim.read_text() == "untouched\n"
    after = {n: (tmp_path / "soup" / n).read_bytes() for n in before}
    assert after == before and len(os.listdir(folder)) == len(before) + 3  # the folder itself is not written to
    card = sent["files"]["README.md"].decode()
    assert not any(line.startswith(("import os", "```\nimport")) for line in card.splitlines())
    assert "<script>" not in card and "[link](" not in card and card.count("```") % 2 == 0
    # an architecture that is not a class name never reaches the loading snippet's code: a plain torch model's card
    # loads into the user's own class (a class defined in a function has such a name too, issue 54)
    info["architecture"] = "X\nimport os"
    (tmp_path / "soup" / "sparsity.json").write_text(json.dumps(info))
    with fake_hub() as sent:
        push_to_hub(folder, "me/r", token=TOKEN)
    card = sent["files"]["README.md"].decode()
    assert not any(line.startswith("import os") for line in card.splitlines())
    assert "cannot be imported by name" in card and "model=MyModel(...)" in card


def test_push_never_replaces_a_card_the_user_wrote(tmp_path):
    folder = _checkpoint_with_trainer_files(tmp_path / "soup")
    (tmp_path / "soup" / "README.md").write_text("# my own card\n")
    with fake_hub() as sent, pytest.raises(ValueError, match="card='keep'.*card='replace'"):
        push_to_hub(folder, "me/r", token=TOKEN)
    assert sent["files"] == {} and not sent["create"].called  # refused before any request
    with fake_hub() as sent:
        push_to_hub(folder, "me/r", token=TOKEN, card="keep")
    assert sent["files"]["README.md"] == b"# my own card\n"
    with fake_hub() as sent:
        push_to_hub(folder, "me/r", token=TOKEN, card="replace")
    assert b"hf-sms" in sent["files"]["README.md"] and b"my own card" not in sent["files"]["README.md"]
    assert (tmp_path / "soup" / "README.md").read_text() == "# my own card\n"  # the local file stays
    with pytest.raises(ValueError, match="card must be one of"):
        push_to_hub(folder, "me/r", token=TOKEN, card="overwrite")


def test_a_json_file_of_the_wrong_type_names_the_file(tmp_path):
    folder = _checkpoint_with_trainer_files(tmp_path / "soup")
    (tmp_path / "soup" / "sparsity.json").write_text("[1, 2]")
    for read in (lambda: load_sparse(folder, make_cnn()), lambda: inspect_checkpoint(folder)):
        with pytest.raises(ValueError, match="sparsity.json holds a JSON list, not an object"):
            read()


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
