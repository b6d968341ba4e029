"""Trust, fifth round (issue 49): no route a card offers runs code from a crafted file, and every file the card tells
users to run is checked against the folder's manifest."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import types
import zipfile

import pytest
import torch
from conftest import make_cnn, without_hf_sms
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
    model = overrides.pop("model", None) or _tiny_lm()
    args = SparseSoupConfig(**{**settings, **overrides})
    return run_sms(model, args, rows[:10], NegativePerplexity(), eval_dataset=rows[10:13], test_dataset=rows[13:])


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
    # A training loss of inf makes every gradient inf or NaN by IEEE rules, on any CPU (a large lora_alpha overflowed
    # only where the kernels did): the replica's adapters end non-finite and the run stops before any soup.
    with pytest.raises(ValueError, match="non-finite values.*diverged.*lower learning_rate"):
        _subset_run(tmp_path, model=_diverging(_tiny_lm()))
    assert not list((tmp_path / "run").rglob("soup.safetensors"))


def _diverging(model):
    """``model`` whose training loss is inf (its evaluation untouched), as an overflowing run's loss becomes."""

    def inf_loss(module, args, output):
        if module.training:
            output["loss"] = output["loss"] * float("inf")
        return output

    model.register_forward_hook(inf_loss)
    return model


def test_a_learned_soup_whose_fit_loss_is_nan_is_refused():
    from hf_sms.soup.learned import FitData, fit_mixing

    model = torch.nn.Linear(3, 2)
    states = [{k: v.clone() for k, v in model.state_dict().items()} for _ in range(2)]
    from torch.utils.data import default_collate

    data = FitData([{"x": torch.ones(3)}] * 4, 2, default_collate, lambda m, b: m(b["x"]).sum() * float("nan"))
    with pytest.raises(ValueError, match="fit loss is nan at step 1"):
        fit_mixing(states, model, data, {"steps": 3, "lr": 0.05, "per_module": 0}, seed=0)


@pytest.mark.parametrize("kind", ["dora", "lora_bias", "embedding"])
def test_merge_adapters_is_peft_merge_under_the_mask_for_every_lora_variant(kind):
    """Item 4: DoRA's magnitude, lora_B's bias and an Embedding's lora_embedding_A/B were dropped (outputs off by
    up to 1.86): the merge is now peft's own, with the pruned entries left out."""
    import copy

    model = _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, attention_bias=True)()  # fmt: skip
    hf_sms.prune(model, 0.5, prune_modules=".*")
    zeros = {n: p == 0 for n, p in model.named_parameters() if p.dim() > 1}
    config = {
        "dora": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True),
        "lora_bias": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True),
        "embedding": LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens"]),
    }[kind]
    adapted = get_peft_model(model, config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    reference = copy.deepcopy(adapted).merge_and_unload().state_dict()
    merged, report = hf_sms.merge_adapters(adapted, return_report=True)
    for name, value in merged.state_dict().items():
        want = reference[name].masked_fill(zeros[name], 0) if name in zeros else reference[name]
        torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-6, msg=name)
    assert report["layers"] and report["dropped_fraction"] > 0


def test_adapters_that_cannot_be_merged_under_a_mask_are_refused_before_training(tmp_path):
    from peft import IA3Config, PromptTuningConfig

    for config in (IA3Config(target_modules=["q_proj"], feedforward_modules=[]),
                   PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)):  # fmt: skip
        model = _tiny_lm()
        hf_sms.prune(model, 0.5)
        adapted = get_peft_model(model, config)
        with pytest.raises(ValueError, match="ia3|prompt learning"):
            hf_sms.merge_adapters(adapted)
        args = SparseSoupConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
        with pytest.raises(ValueError, match="ia3|prompt learning"):
            hf_sms.SparseSoupTrainer(adapted, args, train_dataset=_lm_rows())


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory):
    from hf_sms.adapters.folders import save_adapter
    from hf_sms.adapters.replica import make_replica

    model = _tiny_lm()
    hf_sms.prune(model, 0.5)
    args = types.SimpleNamespace(replica_params="mask_lora", lora_rank=2, lora_alpha=4.0, lora_dropout=0.0,
                                 lora_target_modules=None)  # fmt: skip
    replica = make_replica(model, args)
    with torch.no_grad():  # trained: B is no longer zero
        for name, p in replica.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    save_adapter(replica, str(folder))
    return model, folder


def _edit_config(folder, change):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


ADAPTER_CASES = {  # item 13's hand-edited and crafted folders: each refused, naming what is wrong
    "r missing": (lambda f: _edit_config(f, lambda c: c.pop("r")), "lacks 'r'"),
    "lora_alpha missing": (lambda f: _edit_config(f, lambda c: c.pop("lora_alpha")), "lacks 'lora_alpha'"),
    "r a string": (lambda f: _edit_config(f, lambda c: c.update(r="2")), "r must be a positive integer"),
    "r disagrees": (lambda f: _edit_config(f, lambda c: c.update(r=3)), r"has shape .* r=3"),
    "alpha nan": (lambda f: _edit_config(f, lambda c: c.update(lora_alpha=float("nan"))), "finite number"),
    "alpha inf": (lambda f: (f / "adapter_config.json").write_text(
        (f / "adapter_config.json").read_text().replace('"lora_alpha": 4.0', '"lora_alpha": Infinity')), "finite"),
    "alpha 1e308": (lambda f: _edit_config(f, lambda c: c.update(lora_alpha=1e308)), "would overflow"),
    "targets not names": (lambda f: _edit_config(f, lambda c: c.update(target_modules=[1, 2])), "target_modules"),
    "not json": (lambda f: (f / "adapter_config.json").write_text("{r: 2"), "is not JSON"),
    "a list": (lambda f: (f / "adapter_config.json").write_text("[1, 2]"), "holds a list"),
    "kind bias_norm": (lambda f: _restamp(f, "bias_norm"), "kind 'bias_norm'"),
    "tensor shape": (lambda f: _reshape_tensor(f), "has shape"),
}  # fmt: skip


def _restamp(folder, kind):
    from safetensors.torch import load_file, save_file

    path = str(folder / "adapter_model.safetensors")
    save_file(load_file(path), path, metadata={"format": "pt", "hf_sms_replica_params": kind})


def _reshape_tensor(folder):
    from safetensors.torch import load_file, save_file

    path = str(folder / "adapter_model.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, path, metadata=meta)


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_load_adapter_refuses_a_hand_edited_folder_naming_what_is_wrong(adapter_folder, tmp_path, case):
    model, folder = adapter_folder
    edited = tmp_path / "adapter"
    shutil.copytree(folder, edited)
    edit, message = ADAPTER_CASES[case]
    edit(edited)
    with pytest.raises(ValueError, match=message):
        hf_sms.load_adapter(model, str(edited))


def test_load_adapter_keeps_a_regex_target_and_save_adapter_needs_an_adapter(adapter_folder, tmp_path):
    from hf_sms.adapters.folders import save_adapter

    model, folder = adapter_folder
    edited = tmp_path / "adapter"
    shutil.copytree(folder, edited)
    _edit_config(edited, lambda c: c.update(target_modules=r".*(_proj|lm_head)"))
    replica = hf_sms.load_adapter(model, str(edited))  # peft's regex form: one pattern, not its characters
    assert sum(1 for n, _ in replica.named_parameters() if "lora_A" in n) == 8
    with pytest.raises(ValueError, match="holds no peft adapter"):
        save_adapter(_tiny_lm(), str(tmp_path / "none"))


def test_options_of_a_soup_that_takes_none_are_refused(tmp_path):
    with pytest.raises(ValueError, match="uniform takes no options"):
        SparseSoupConfig(output_dir=str(tmp_path), soup_options={"uniform": {"x": 1}})


def test_compute_masks_refuses_a_unit_multiple_that_keeps_every_unit():
    model = _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=64, hidden_size=32, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)()  # fmt: skip
    with pytest.raises(ValueError, match="unit_multiple=16 keeps every unit"):  # 16 neurons: a multiple of 16 is all
        hf_sms.compute_masks(model, 0.5, structure="neurons", unit_multiple=16)


def test_merges_refuse_a_base_with_another_mask_or_shape(tmp_path):
    """Item 6: ties / dare / model_stock counted the pruned entries' updates of a dense base and wrote another soup."""
    from hf_sms.cli import main
    from hf_sms.soup.soup import soup
    from hf_sms.training.sharding import sharded_soup

    dense = make_cnn()
    start = make_cnn()
    hf_sms.prune(start, 0.5)
    candidates = []
    for seed in (1, 2):
        c = make_cnn()
        c.load_state_dict(start.state_dict())
        with torch.no_grad():
            for p in c.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.01 * (p != 0))
        candidates.append(c)
    soup(candidates, "ties", base=start)  # the pruned start: fine
    with pytest.raises(ValueError, match="base has another mask"):
        soup(candidates, "ties", base=dense)
    with pytest.raises(ValueError, match="another architecture"):
        soup(candidates, "ties", base=make_cnn(num_classes=7))
    folders = []
    for name, model in (("a", candidates[0]), ("b", candidates[1]), ("dense", dense)):
        hf_sms.save_sparse(model, str(tmp_path / name))
        folders.append(str(tmp_path / name))
    argv = ["merge", folders[0], folders[1], "--method", "ties", "--base", folders[2], "--output", str(tmp_path / "s")]
    assert main(argv) == 2 and not (tmp_path / "s").exists()
    states = [dict(c.state_dict()) for c in candidates]
    into = make_cnn()
    with pytest.raises(ValueError, match="sum to 1.8"):
        sharded_soup(into, states, [0.9, 0.9])
    with pytest.raises(ValueError, match="different masks"):
        sharded_soup(into, [states[0], dense.state_dict()])
    with pytest.raises(ValueError, match="has no 'fc2.weight'"):
        sharded_soup(into, [states[0], {k: v for k, v in states[1].items() if k != "fc2.weight"}])
    assert torch.equal(into.fc2.weight, make_cnn().fc2.weight)  # nothing written before the refusals


def test_a_smaller_model_that_removes_little_says_how_to_remove_more(caplog):
    """Item 9: filters at 50% on an smp PSPNet with a named encoder removed 1% of the parameters without a word."""
    import copy
    import logging

    import segmentation_models_pytorch as smp

    from hf_sms.plan.plan import resolve_pruning

    torch.manual_seed(0)
    model = smp.PSPNet("resnet18", encoder_weights=None, classes=3, encoder_depth=3).eval()
    x = torch.randn(2, 3, 64, 64)
    dense, plan = copy.deepcopy(model), resolve_pruning(structure="filters")
    plan.prune(model, 0.5, example_inputs=x)
    with caplog.at_level(logging.WARNING, logger="hf_sms"):
        final = plan.final(model, dense, x)
    assert final.shrunk.parameter_ratio > 0.9
    assert "fit_config=False prunes every unit" in caplog.text and "removes" in caplog.text


def test_a_full_disk_while_the_program_is_written_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    """Item 14: torch's C++ writer aborted Python (SIGABRT) on a full disk and left the temp folder."""
    import errno

    from hf_sms import atomic

    model = _hf("BloomForCausalLM", "BloomConfig", vocab_size=64, hidden_size=16, n_layer=2, n_head=2)().eval()
    x = _tokens()
    hf_sms.apply_masks(model, hf_sms.compute_masks(model, 0.5, structure="neurons", example_inputs=x))
    smaller = hf_sms.shrink(model, x, structure="neurons")

    def full(path, mode="r", *args, **kwargs):
        if str(path).endswith(".pt2") and "w" in mode:  # the temp file beside model.pt2
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(atomic, "open", full, raising=False)
    with pytest.raises(OSError, match="No space left"):
        hf_sms.save_sparse(smaller, str(tmp_path / "small"), example_inputs=x)
    assert os.listdir(tmp_path) == []  # no folder, no temporary one


@pytest.mark.parametrize("world", [[1, 2], {"processes": 2, "jobs": [], "seconds": 1.0}])
def test_timeline_refuses_a_results_file_whose_world_is_not_a_schedule(tmp_path, capsys, world):
    """Item 16: a list, or a record without groups, ended in a traceback."""
    from hf_sms.cli import main

    if isinstance(world, dict):
        world["groups"] = "two"
    (tmp_path / "results.json").write_text(json.dumps({"rows": {"sms_uniform": [{}]}, "phases": [0.5], "world": world}))
    assert main(["timeline", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_from_pretrained_checks_a_dense_folder_whose_record_says_bitmask(tmp_path):
    """Item 16: a dense folder whose sparsity.json says bitmask, a byte flipped, loaded through from_pretrained."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = _tiny_lm()
    hf_sms.prune(model, 0.5)
    folder = tmp_path / "soup"
    hf_sms.save_sparse(model, str(folder), "dense")
    info = json.loads((folder / "sparsity.json").read_text())
    (folder / "sparsity.json").write_text(json.dumps({**info, "format": "bitmask"}))
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[tensors[name].view(-1).nonzero()[0]] += 1.0
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="says bitmask but the weights are not"):
        AutoModelForCausalLM.from_pretrained(str(folder))


def test_example_inputs_as_a_one_item_tuple_of_a_dict(tmp_path):
    """Item 16: ``example_inputs=({"x": x},)`` ended in "'dict' object has no attribute 'to'"."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    masks = hf_sms.compute_masks(model, 0.5, structure="neurons", example_inputs=({"x": x},))
    assert all(
        torch.equal(masks[k], m)
        for k, m in hf_sms.compute_masks(model, 0.5, structure="neurons", example_inputs=x).items()
    )
    hf_sms.apply_masks(model, masks)
    smaller = hf_sms.shrink(model, ({"x": x},), structure="neurons")
    assert smaller.a.out_features == 8 and torch.allclose(smaller(x), model(x), atol=1e-6)


@pytest.mark.parametrize(
    ("env", "warned"),
    [
        ({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, True),  # --num_processes 2
        ({"ACCELERATE_USE_CPU": "True"}, False),  # --num_processes 1
        ({"MASTER_ADDR": "127.0.0.1"}, False),  # not accelerate's
    ],
)
def test_accelerate_launch_cpu_with_several_processes_says_it_runs_one(monkeypatch, caplog, env, warned):
    """Item 11: ``accelerate launch --cpu --num_processes 2`` ran one process and said so only as ``rank 0/1``
    (accelerate sets these variables in its one process: checked by hand with a script printing them)."""
    from hf_sms.loop.distributed import ReplicaWorld

    for key in ("ACCELERATE_USE_CPU", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level("WARNING", logger="hf_sms"):
        assert ReplicaWorld(3, cpu=True).size == 1
    assert ("torchrun --nproc_per_node N" in caplog.text) == warned


def test_inspect_on_a_folder_it_may_not_read_says_so(tmp_path, monkeypatch, capsys):
    """Item 16: ``inspect`` on a folder of mode 000 said "not a model checkpoint" (as a user without access; the test
    may run as root, whom mode 000 does not stop: the access check is made to fail instead)."""
    from hf_sms.checkpoint import folder as folder_module
    from hf_sms.cli import main

    hf_sms.save_sparse(torch.nn.Sequential(torch.nn.Linear(8, 8)), str(tmp_path / "f"))
    os.chmod(tmp_path / "f", 0)
    real_access, real_lexists = os.access, os.path.lexists
    monkeypatch.setattr(folder_module.os, "access", lambda p, m: p != str(tmp_path / "f") and real_access(p, m))
    monkeypatch.setattr(folder_module.os.path, "lexists", lambda p: str(tmp_path / "f") not in p and real_lexists(p))
    try:
        assert main(["inspect", str(tmp_path / "f")]) == 2
    finally:
        os.chmod(tmp_path / "f", 0o755)
    err = capsys.readouterr().err
    assert "Permission denied" in err and "permissions" in err and "not a checkpoint" not in err


def test_shrink_names_the_weights_a_branch_the_batch_did_not_take_would_read():
    """Item 16: a data-dependent branch the trace did not take made the smaller model fail on another batch with
    "mat1 and mat2 shapes cannot be multiplied", and nothing had said why: shrink names the weights it never saw."""

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h) if float(x.sum()) > 0 else self.c(h)

    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4, 8).abs()
    hf_sms.apply_masks(model, hf_sms.compute_masks(model, 0.5, structure="neurons", example_inputs=x))
    with pytest.warns(UserWarning, match=r"read none of c\.bias, c\.weight .*example_inputs that take every branch"):
        hf_sms.shrink(model, x, structure="neurons")


def test_a_hooked_mlp_is_cut_in_place_with_its_hooks_not_rebuilt_without_them():
    """Item 16: a model whose MLP carries a forward hook was rebuilt from its config (the hook lost), and shrink
    then said "computes other outputs ... please report it": the rebuild cannot run hooks, so the units are cut in
    place, hooks kept, and a warning names the hooked modules."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2}
    config = LlamaConfig(vocab_size=64, num_hidden_layers=2, **shape)
    model = LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        layer.mlp.up_proj.register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randint(0, 64, (2, 8))
    with pytest.warns(UserWarning, match=r"forward hooks on model\.layers\.0\.mlp\.up_proj"):
        hf_sms.apply_masks(model, hf_sms.compute_masks(model, 0.5, structure="neurons", example_inputs=x))
        smaller = hf_sms.shrink(model, x, structure="neurons")
    mlp = smaller.model.layers[0].mlp
    assert mlp.up_proj.out_features < 32 and len(mlp.up_proj._forward_hooks) == 1
    with torch.no_grad():
        torch.testing.assert_close(smaller(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)
