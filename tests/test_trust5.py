"""Trust, fifth round (issue 49): no route a card offers runs code from a crafted file, and every file the card tells
users to run is checked against the folder's manifest."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import without_hf_sms
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import Trainer
from zoo import _hf, _tokens

import hf_sms
from hf_sms import SparseSoupConfig, SparseSoupMixin
from hf_sms.checkpoint.family_files import plain_route_lines
from hf_sms.checkpoint.inspect import inspect_checkpoint
from hf_sms.checkpoint.integrity import CorruptionError
from hf_sms.checkpoint.program_check import check_program


class _RunsCode:
    """A pickle that creates ``marker`` when it is loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _craft(good: str, bad: str, way: str, marker: str) -> None:
    """Rewrite the archive ``good`` as ``bad`` with a pickle that runs code where ``torch.export.load`` reads one."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    with zipfile.ZipFile(good) as z:
        entries = {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}
    payload = pickle.dumps(_RunsCode(marker))
    if way == "use_pickle":  # a weight whose config entry says it is a pickle
        config = json.loads(entries["data/weights/model_weights_config.json"])
        paths = [e["path_name"] for e in config["config"].values()]
        entry = next(e for e in config["config"].values() if paths.count(e["path_name"]) == 1)  # not a tied one
        entry["use_pickle"] = True
        entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()
        entries["data/weights/" + entry["path_name"]] = payload
    elif way == "legacy":  # a legacy weights file, read with weights_only=True and then retried without
        entries["data/weights/model.pt"] = payload
    else:  # the sample inputs
        entries["data/sample_inputs/model.pt"] = payload
    os.remove(bad)
    with PT2ArchiveWriter(bad) as w:  # the writer adds its own version entries
        for name, data in entries.items():
            if name not in (
                "archive_format",
                "archive_version",
                ".data/version",
                "byteorder",
                ".data/serialization_id",
            ):
                w.write_bytes(name, data)


@pytest.fixture(scope="module")
def smaller_folder(tmp_path_factory):
    """A Bloom whose FFN its config cannot state, cut in place at 50%: saved with the defaults, ``model.pt2``."""
    model = _hf("BloomForCausalLM", "BloomConfig", vocab_size=64, hidden_size=16, n_layer=2, n_head=2)().eval()
    x = _tokens()
    hf_sms.apply_masks(model, hf_sms.compute_masks(model, 0.5, structure="neurons", example_inputs=x))
    folder = tmp_path_factory.mktemp("bloom") / "small"
    hf_sms.save_sparse(hf_sms.shrink(model, x, structure="neurons"), str(folder), "dense", example_inputs=x)
    assert (folder / "model.pt2").is_file()
    return folder


def test_the_saved_program_holds_no_pickle_and_the_manifest_covers_it(smaller_folder):
    check_program(str(smaller_folder / "model.pt2"))
    with zipfile.ZipFile(smaller_folder / "model.pt2") as z:
        sample = [i for i in z.infolist() if i.filename.endswith("sample_inputs/model.pt")]
    assert [i.file_size for i in sample] == [0]  # torch pickles the sample inputs unless there are none
    files = json.loads((smaller_folder / "sparsity.json").read_text())["files"]
    assert "model.pt2" in files and "sha256" in files["model.pt2"]
    assert "model.pt2 included" in inspect_checkpoint(str(smaller_folder))["manifest"]


def test_a_crafted_program_runs_no_code_through_the_cards_lines(smaller_folder, tmp_path):
    """The three ways a crafted ``model.pt2`` reached ``torch.load(..., weights_only=False)`` in torch 2.14.1."""
    ways = ("use_pickle", "legacy", "sample_inputs")
    cards, loads = [], []
    for way in ways:
        folder = tmp_path / way
        shutil.copytree(smaller_folder, folder)
        _craft(str(smaller_folder / "model.pt2"), str(folder / "model.pt2"), way, str(tmp_path / f"ran-{way}"))
        card = "\n".join(plain_route_lines("torch.export", str(folder), hub=False))
        cards.append(f"try:\n{_indent(card)}\nexcept ValueError as e:\n    print('refused:', e)\n")
        loads.append(f"try:\n    torch.export.load({str(folder / 'model.pt2')!r})\nexcept Exception:\n    pass\n")
        # hf-sms's own readers refuse the folder: the archive is not the one the manifest records
        with pytest.raises(CorruptionError, match="model.pt2"):
            inspect_checkpoint(str(folder))
    assert "check_program(path)" in (smaller_folder / "README.md").read_text()  # the card's own lines carry it
    assert without_hf_sms("\n".join(cards)).count("refused:") == 3
    assert not any((tmp_path / f"ran-{way}").exists() for way in ways)
    # without the check, torch itself runs each crafted pickle: the cases are real
    subprocess.run([sys.executable, "-c", "import torch\n" + "\n".join(loads)], capture_output=True, timeout=300)
    assert all((tmp_path / f"ran-{way}").exists() for way in ways)


def _indent(code: str) -> str:
    return "\n".join("    " + line if line else "" for line in code.splitlines())


@pytest.mark.parametrize("name", ["model.pt2", "sparsity.json"])
def test_inspect_refuses_a_flipped_byte_in_the_program(smaller_folder, tmp_path, name):
    folder = tmp_path / "small"
    shutil.copytree(smaller_folder, folder)
    path = folder / "model.pt2"
    if name == "model.pt2":  # one weight byte flipped
        data = bytearray(path.read_bytes())
        with zipfile.ZipFile(path) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("/data/weights/weight_0"))
        at = info.header_offset + 30 + len(info.filename) + len(info.extra) + 1
        data[at] ^= 0x40
        path.write_bytes(bytes(data))
    else:  # replaced by garbage
        path.write_bytes(b"not an archive")
    with pytest.raises(CorruptionError, match="model.pt2"):
        inspect_checkpoint(str(folder))
    with pytest.raises(CorruptionError, match="model.pt2"):
        hf_sms.load_sparse(str(folder))


def test_check_program_refuses_every_entry_torch_would_unpickle_or_run(tmp_path):
    program = torch.export.export(torch.nn.Linear(3, 2).eval(), (torch.randn(2, 3),))
    program.example_inputs = None
    good = tmp_path / "good.pt2"
    torch.export.save(program, str(good))
    check_program(str(good))
    with zipfile.ZipFile(good) as z:
        entries = {i.filename: z.read(i) for i in z.infolist()}
    root = next(iter(entries)).split("/")[0]
    for extra in ("data/aotinductor/model/x.so", "data/constants/custom_obj_0", "data/constants/opaque_obj_0",
                  "extra/x", "data/weights/model.pt", "data/constants/model.pt"):  # fmt: skip
        bad = tmp_path / "bad.pt2"
        with zipfile.ZipFile(bad, "w") as z:
            for name, data in {**entries, f"{root}/{extra}": b"x"}.items():
                z.writestr(name, data)
        with pytest.raises(ValueError, match="do not load it"):
            check_program(str(bad))


class _AddsLora(Trainer):
    """A trainer class that wraps the model in peft inside its ``__init__``, as trl's SFTTrainer does with
    ``peft_config``."""

    def __init__(self, model=None, args=None, peft_config=None, **kwargs):
        super().__init__(model=get_peft_model(model, peft_config), args=args, **kwargs)


class _SparseAddsLora(SparseSoupMixin, _AddsLora):
    pass


def _lm_rows(n=8):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (x := torch.randint(1, 64, (8,), generator=g)), "labels": x.clone()} for _ in range(n)]


@pytest.mark.parametrize("arrives", [0.5, 0.0])
def test_a_trainer_that_adds_adapters_keeps_a_pruned_models_mask_and_prunes_an_unpruned_one(tmp_path, arrives):
    """trl's idiom (SFTTrainer(model, peft_config=...)) on a model pruned to 50%: its zeros are the mask, not the
    default target_sparsity 0.9 (it pruned the base again, silently); an unpruned base is pruned to the target."""
    model = _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)()  # fmt: skip
    if arrives:
        hf_sms.prune(model, arrives)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    args = SparseSoupConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to="none",
                            use_cpu=True, target_sparsity=0.5 if not arrives else 0.9)  # fmt: skip
    trainer = _SparseAddsLora(model=model, args=args, peft_config=lora, train_dataset=_lm_rows())
    kept = sum(int(m.sum()) for m in trainer.masks.values()) / sum(m.numel() for m in trainer.masks.values())
    assert kept == pytest.approx(0.5, abs=1e-3)  # the arriving 50%, or the target 50%; never 0.9


def _tiny_lm(seed=0):
    return _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=64, hidden_size=32, intermediate_size=48,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)(seed)  # fmt: skip


def _subset_run(tmp_path, **overrides):
    from hf_sms import run_sms
    from hf_sms.evaluation.metrics import NegativePerplexity

    rows = _lm_rows(16)
    settings = dict(output_dir=str(tmp_path / "run"), target_sparsity=0.5, n_phases=1, num_replicas=2, max_steps=1,
                    per_device_train_batch_size=4, report_to="none", use_cpu=True, replica_params="mask_lora",
                    measure_speedup=False, disable_tqdm=True, lora_rank=2)  # fmt: skip
    args = SparseSoupConfig(**{**settings, **overrides})
    return run_sms(_tiny_lm(), args, rows[:10], NegativePerplexity(), eval_dataset=rows[10:13], test_dataset=rows[13:])


def test_a_finished_subset_replica_with_other_bytes_is_refused_on_resume_naming_its_file(tmp_path):
    """Item 5 (a NaN written into replica.safetensors gave a non-finite soup, exit 0) and item 12 (a tensor of the
    wrong shape died with a raw size mismatch): the file is named, with the fix."""
    from safetensors.torch import load_file, save_file

    _subset_run(tmp_path)
    path = tmp_path / "run" / "sms" / "phase1" / "replica0" / "replica.safetensors"
    original = path.read_bytes()
    for edit in ("nan", "shape"):
        path.write_bytes(original)
        tensors = load_file(str(path))
        name = next(iter(tensors))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        if edit == "nan":
            tensors[name] = tensors[name].clone()
            tensors[name].view(-1)[0] = float("nan")
        else:
            tensors[name] = torch.zeros(3, 3)
            meta.pop("crc32")  # a file from before the checksums: the shape alone must be caught
        save_file(tensors, str(path), metadata=meta)
        with pytest.raises(ValueError, match=r"replica0/replica.safetensors is not this replica's .*delete"):
            _subset_run(tmp_path)


def test_runs_that_would_end_non_finite_stop_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="finite lora_alpha"):
        SparseSoupConfig(output_dir=str(tmp_path), replica_params="mask_lora", lora_alpha=float("inf"))
    with pytest.raises(ValueError, match="non-finite values.*diverged"):
        _subset_run(tmp_path, lora_alpha=1e30, learning_rate=1.0)


def test_a_learned_soup_whose_fit_loss_is_nan_is_refused():
    from hf_sms.soup.learned import FitData, fit_mixing

    model = torch.nn.Linear(3, 2)
    states = [{k: v.clone() for k, v in model.state_dict().items()} for _ in range(2)]
    from torch.utils.data import default_collate

    data = FitData([{"x": torch.ones(3)}] * 4, 2, default_collate, lambda m, b: m(b["x"]).sum() * float("nan"))
    with pytest.raises(ValueError, match="fit loss is nan at step 1"):
        fit_mixing(states, model, data, {"steps": 3, "lr": 0.05, "per_module": 0}, seed=0)
