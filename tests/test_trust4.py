"""Trust, fourth round (issue 36): the mixin and the run do what they say even where a user's code goes its own way."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import RUN, make_cnn, make_image_dataset, training_args
from torch import nn
from transformers import Trainer

from hf_sms import SparseSoupConfig, SparseSoupMixin, SparseSoupTrainer, compute_masks


def test_the_mixin_after_the_trainer_in_the_bases_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"write class Backwards\(SparseSoupMixin, Trainer\)"):

        class Backwards(Trainer, SparseSoupMixin):
            pass

    class Right(SparseSoupMixin, Trainer):  # the documented order stays fine
        pass


class OwnStep(SparseSoupTrainer):
    """A subclass whose training_step never calls super(): the mixin's gradient masking is skipped."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = self.compute_loss(model, inputs)
        loss.backward()
        return loss.detach()


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_masks_hold_when_a_subclass_skips_the_mixins_training_step(tmp_path, optim):
    model = make_cnn()
    masks = compute_masks(model, 0.7)
    args = training_args(str(tmp_path), SparseSoupConfig, max_steps=6, optim=optim, learning_rate=0.1)
    if optim == "sgd":
        args.optim_args = "momentum=0.9"
    trainer = OwnStep(model, args, masks=masks, train_dataset=make_image_dataset())
    trainer.train()
    params = dict(model.named_parameters())
    revived = sum(int((params[n].detach()[~m] != 0).sum()) for n, m in masks.items())
    assert revived == 0
    assert any(bool((params[n].detach()[m] != 0).any()) for n, m in masks.items())  # it did train


def test_resume_true_without_a_checkpoint_raises_and_a_second_train_works(tmp_path):
    args = training_args(str(tmp_path), SparseSoupConfig, max_steps=3)
    trainer = SparseSoupTrainer(make_cnn(), args, train_dataset=make_image_dataset())
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        trainer.train(resume_from_checkpoint=True)
    first = trainer.train()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    second = trainer.train()  # the schedule starts again from its own rate, not the last one's end (0)
    assert second.global_step == first.global_step == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


# -- hf-sms table / timeline on JSON that is not a results.json (item 11) ---------------------------------------


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"train_loss": 0.3, "epoch": 3.0}, "no 'rows' and 'phases'"),  # transformers' all_results.json
        ([1, 2], "JSON list"),
        ({**RUN, "rows": {"sms_uniform": "x"}}, "list of rows"),
        ({**RUN, "world": {**RUN["world"], "processes": 10**9}}, "count of processes"),
        ({**RUN, "world": {**RUN["world"], "jobs": [{"rank": 5}]}}, "records with rank"),
    ],
)
def test_table_and_timeline_refuse_what_is_not_a_results_json(tmp_path, capsys, content, match):
    import json

    from hf_sms.cli import main

    (tmp_path / "results.json").write_text(json.dumps(content))
    command = "table" if "rows" in match or "JSON list" in match else "timeline"
    for target in (tmp_path / "results.json", tmp_path) if command == "table" else (tmp_path,):
        assert main([command, str(target)]) == 2  # an error message, no traceback, no hang
        err = capsys.readouterr().err
        assert f"hf-sms {command}: error:" in err and match in err


def test_table_reads_a_run_folder_as_timeline_does(tmp_path, capsys):
    import argparse
    import json

    from hf_sms.records.results import table, timeline_command

    (tmp_path / "results.json").write_text(json.dumps(RUN))
    assert table(argparse.Namespace(results=[str(tmp_path)], split=None)) == 0
    assert timeline_command(argparse.Namespace(run_dir=str(tmp_path))) == 0
    out = capsys.readouterr().out
    assert "90.00" in out and "1 process(es)" in out


# -- the trainer's mask file (item 12) ------------------------------------------------------------------------------
def _checkpointed(tmp_path):
    args = training_args(str(tmp_path / "o"), SparseSoupConfig, max_steps=4, save_strategy="steps", save_steps=2)
    trainer = SparseSoupTrainer(make_cnn(), args, train_dataset=make_image_dataset())
    trainer.train()
    return args, tmp_path / "o" / "checkpoint-2"


def test_a_changed_byte_or_a_nan_in_the_trainers_mask_file_is_refused_on_resume(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hf_sms.checkpoint.constants import MASKS_NAME

    args, ckpt = _checkpointed(tmp_path)
    path = ckpt / MASKS_NAME
    good = path.read_bytes()
    data = bytearray(good)
    data[-1] ^= 1  # a kept weight's True becomes False (or the reverse)
    path.write_bytes(bytes(data))
    fresh = SparseSoupTrainer(make_cnn(), args, train_dataset=make_image_dataset())
    with pytest.raises(ValueError, match="differ from their checksums"):
        fresh.train(resume_from_checkpoint=str(ckpt))
    path.write_bytes(good)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    save_file(load_file(str(path)), str(path), metadata={**meta, "norm_fraction": "nan"})
    with pytest.raises(ValueError, match="norm_fraction='nan' is not a fraction"):
        fresh.train(resume_from_checkpoint=str(ckpt))


def test_the_trainers_mask_file_is_neither_counted_as_weights_nor_uploaded(tmp_path):
    import re

    from conftest import fake_hub

    from hf_sms import push_to_hub
    from hf_sms.checkpoint.constants import MASKS_NAME, WEIGHTS_NAME

    args = training_args(str(tmp_path / "o"), SparseSoupConfig, max_steps=2)
    trainer = SparseSoupTrainer(make_cnn(), args, train_dataset=make_image_dataset())
    trainer.train()
    trainer.save_model()
    out = tmp_path / "o"
    assert (out / MASKS_NAME).is_file()
    card = (out / "README.md").read_text()
    mb = float(re.search(r"weights ([0-9.]+) MB on disk", card).group(1))
    assert mb == round((out / WEIGHTS_NAME).stat().st_size / 1e6, 2)
    with fake_hub() as sent:
        push_to_hub(str(out), "me/r")
    assert MASKS_NAME not in sent["files"] and WEIGHTS_NAME in sent["files"]


# -- what a run says (item 18) ---------------------------------------------------------------------------------
RUN_SCRIPT = """
import torch
from torch import nn
from hf_sms import SparseSoupConfig, run_sms
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.cli.demo import DigitsResNet
from hf_sms.evaluation import ClassificationAccuracy
train, val, _ = load_digits_splits(seed=0)
torch.manual_seed(0)
args = SparseSoupConfig(output_dir=OUT, target_sparsity=0.5, n_phases=1, num_replicas=1, max_steps=1,
                        per_device_train_batch_size=32, use_cpu=True, disable_tqdm=True, report_to="none",
                        measure_speedup=False)
run_sms(DigitsResNet(width=4), args, TensorDictDataset(train.x[:64], train.labels[:64]), ClassificationAccuracy(),
        eval_dataset=val)
"""


@pytest.mark.parametrize(("verbosity", "shown"), [(None, True), pytest.param("warning", False, marks=pytest.mark.slow)])
def test_a_run_shows_its_phase_lines_without_any_logging_setup(tmp_path, verbosity, shown):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"HF_SMS_VERBOSITY": verbosity} if verbosity else {})}
    code = RUN_SCRIPT.replace("OUT", repr(str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("[hf-sms] phase 1 sms_uniform" in proc.stderr) == shown, proc.stderr[-3000:]


# -- a measured speedup that is noise (item 20) -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("spread", "noise"), [((0.61, 1.12), True), ((0.9, 1.4), True), ((1.41, 1.55), False), ((0.7, 0.75), False)]
)
def test_a_speedup_whose_rounds_disagree_is_not_stated_as_a_result(spread, noise):
    from hf_sms.runtime.speed import format_measured, is_noise

    record = {
        "speedup": 0.73,
        "speedup_range": list(spread),
        "repeats": 7,
        "dense_ms": 1.0,
        "runtime_ms": 1.37,
        "device": "cpu",
        "threads": 2,
        "input": "x 1x8",
        "sparse_layers": 3,
    }
    line = format_measured(record)
    assert is_noise(record) == noise
    assert line.startswith("no reliable speedup") == noise and ("0.73x (" in line) == (not noise)


# -- unit_multiple that keeps everything (item 4) --------------------------------------------------------------------
def test_a_unit_multiple_that_keeps_every_unit_is_refused_before_work():
    from torch import nn

    from hf_sms import resolve_pruning

    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    batch = torch.randn(4, 8)
    plan = resolve_pruning(structure="neurons", unit_multiple=16, fit_config=False)
    with pytest.raises(ValueError, match=r"unit_multiple=16 keeps every unit of every group .* \(16 neurons\)"):
        plan.check(mlp, 0.5, batch)
    resolve_pruning(structure="neurons", unit_multiple=4, fit_config=False).check(mlp, 0.5, batch)  # 8 of 16: fine


# -- the mixin with units (item 16) -------------------------------------------------------------------------------
def test_a_trainer_with_units_says_how_to_get_the_smaller_model_and_that_works(tmp_path, caplog):
    import logging

    import hf_sms
    from hf_sms.shrinking import parameter_count

    model = make_cnn()
    data = make_image_dataset()
    args = training_args(str(tmp_path / "o"), SparseSoupConfig, max_steps=2, structure="filters", target_sparsity=0.5)
    trainer = SparseSoupTrainer(model, args, train_dataset=data)
    trainer.train()
    with caplog.at_level(logging.WARNING, logger="hf_sms"):
        trainer.save_model()
    assert "hf_sms.shrink(trainer.model, batch)" in caplog.text
    batch = trainer.data_collator(data[:4] if isinstance(data, dict) else [data[i] for i in range(4)])
    smaller = hf_sms.shrink(trainer.model, batch)  # what the log line says, as it says it
    assert parameter_count(smaller) < parameter_count(trainer.model)


# -- the trace and "stated" caches (item 3) -------------------------------------------------------------------------
class Flex(torch.nn.Module):
    """One class whose forward depends on an attribute: mixing the hidden neurons ties them all together."""

    def __init__(self, mix: bool):
        super().__init__()
        torch.manual_seed(0)
        self.mix = mix
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h + h.flip(-1) if self.mix else h)


@pytest.mark.parametrize("order", [(False, True), (True, False)])
def test_two_instances_of_one_class_with_different_forwards_get_their_own_trace(order):
    from hf_sms.pruning.graph import trace as trace_module
    from hf_sms.pruning.graph import trace_units

    def groups(mix):
        found = trace_units(Flex(mix), torch.randn(2, 8)).groups(("neurons",))
        return [(g.name, g.n_units) for g in found]

    trace_module._CACHE.clear()
    alone = {mix: (trace_module._CACHE.clear(), groups(mix))[1] for mix in order}
    trace_module._CACHE.clear()
    together = {mix: groups(mix) for mix in order}  # the second is traced after the first, cache warm
    assert together == alone and alone[False] != alone[True]


def test_a_hook_changes_the_trace_key():
    from hf_sms.pruning.graph.trace import architecture_key

    plain, hooked = Flex(False), Flex(False)
    assert architecture_key(plain) == architecture_key(Flex(False))
    hooked.up.register_forward_hook(lambda m, i, o: o.flip(-1))
    assert architecture_key(plain) != architecture_key(hooked)


# -- a cut-in-place soup opened with from_pretrained (item 19) ---------------------------------------------------
def test_from_pretrained_of_a_soup_cut_in_place_names_load_sparse(tmp_path, t5_dataset):
    from conftest import make_t5, sms_config
    from transformers import T5ForConditionalGeneration

    import hf_sms
    from hf_sms.loop.sms import run_sms

    def neg_loss(model, dataset):
        batch = {k: torch.stack([r[k] for r in dataset]) for k in dataset[0]}
        with torch.no_grad():
            return -float(model(**batch).loss)

    args = sms_config(tmp_path, structure="neurons", target_sparsity=0.5, n_phases=1, num_replicas=1, max_steps=1,
                      per_device_train_batch_size=4, fit_config=False, measure_speedup=False)  # fmt: skip
    run_sms(make_t5(), args, t5_dataset, neg_loss, eval_dataset=t5_dataset[:4])
    folder = tmp_path / "run" / "final_soup"
    shrunk = json.loads((folder / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert (shrunk["saved"], shrunk["cut"], shrunk["plain"]) == ("smaller", "in place", "torch.export")
    assert shrunk["program_inputs"] == ["input_ids", "attention_mask", "decoder_input_ids"]
    with pytest.raises(ValueError, match=r"hf_sms\.load_sparse\("):
        T5ForConditionalGeneration.from_pretrained(str(folder))
    loaded = hf_sms.load_sparse(str(folder))  # what the message says works
    batch = {k: torch.stack([r[k] for r in t5_dataset[:2]]) for k in t5_dataset[0]}
    with torch.no_grad():
        assert torch.isfinite(loaded(**batch).loss)
        program = torch.export.load(str(folder / "model.pt2")).module()  # the exported forward: the soup's logits
        inputs = {k: batch[k] for k in shrunk["program_inputs"] if k != "decoder_input_ids"}  # as the card says
        inputs["decoder_input_ids"] = loaded._shift_right(batch["labels"])
        torch.testing.assert_close(program(**inputs)["logits"], loaded(**inputs).logits, rtol=1e-4, atol=1e-5)


# -- unreadable folders and hf-sms inspect's exit codes (item 10) -------------------------------------------------
def test_inspect_exit_codes_tell_cannot_read_from_corrupted(tmp_path, capsys, monkeypatch):
    import builtins
    import os

    from hf_sms import save_sparse
    from hf_sms.cli import main

    folder = tmp_path / "soup"
    save_sparse(make_cnn(), str(folder), "bitmask")  # a dense model saves dense by default: its header has no CRCs
    assert main(["inspect", str(folder)]) == 0
    other = tmp_path / "other"
    save_sparse(make_cnn(seed=1), str(other), "bitmask")
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())  # a file of another save
    assert main(["inspect", str(folder)]) == 1
    assert "hf-sms inspect: error:" in capsys.readouterr().err
    (folder / "model.safetensors").unlink()
    os.symlink(folder / "gone.safetensors", folder / "model.safetensors")  # dangling, inside the folder
    assert main(["inspect", str(folder)]) == 2
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(weights)
    real_open = builtins.open

    def denied(path, *args, **kwargs):  # mode 000 as a user other than root sees it
        if str(path).endswith("model.safetensors"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)
    assert main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "Permission denied" in err and "Traceback" not in err
    monkeypatch.setattr(builtins, "open", real_open)
    assert main(["inspect", str(tmp_path / "missing")]) == 2


def test_importing_the_transformers_integration_first_still_registers_it():
    """The import hook of ``import hf_sms`` fires while the integration module is only half defined when that module
    is what first imports transformers' models; registration used to be lost then (order-dependent tests)."""
    import subprocess
    import sys

    code = (
        "from hf_sms import apply_masks\n"
        "from hf_sms.checkpoint import transformers_integration\n"
        "import transformers.quantizers.auto as qa, transformers.modeling_utils as mu\n"
        "assert any('hf-sms' in k for k in qa.AUTO_QUANTIZER_MAPPING)\n"
        "assert getattr(mu.PreTrainedModel.from_pretrained, 'hf_sms_checked', False)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# -- every reader checks the manifest and the mask hash (item 7) ---------------------------------------------------
def _t5_folder(path, seed=0):
    from conftest import make_t5

    from hf_sms import prune, save_sparse

    model = make_t5(seed)
    prune(model, 0.5)
    save_sparse(model, str(path))
    return path


def _readers(folder, tmp_path):
    """Every way to read a folder, each as a callable that raises or returns; inspect returns its exit code."""
    from transformers import T5ForConditionalGeneration

    from hf_sms import load_sparse
    from hf_sms.checkpoint.merge import convert_checkpoint
    from hf_sms.cli import main

    return {
        "load_sparse": lambda: load_sparse(str(folder)),
        "from_pretrained": lambda: T5ForConditionalGeneration.from_pretrained(str(folder)),
        "convert": lambda: convert_checkpoint(str(folder), str(tmp_path / "converted"), "dense", overwrite=True),
        "inspect": lambda: main(["inspect", str(folder)]),
    }


def _every_reader_refuses(folder, tmp_path, match: str) -> None:
    """Every reader raises ``match``; ``hf-sms inspect`` exits 1 (corrupted)."""
    for name, read in _readers(folder, tmp_path).items():
        if name == "inspect":
            assert read() == 1, name
        else:
            with pytest.raises(ValueError, match=match):
                read()


def _rebuild_manifest(folder) -> None:
    """Record the folder's files as they are now: a manifest that agrees with a rewritten file."""
    from hf_sms.checkpoint.folder import weight_files
    from hf_sms.checkpoint.integrity import weight_manifest

    info = json.loads((folder / "sparsity.json").read_text())
    info["files"] = weight_manifest(str(folder), weight_files(str(folder)))
    (folder / "sparsity.json").write_text(json.dumps(info))


@pytest.mark.parametrize("how", ["deleted", "renamed"])
def test_a_folder_without_its_manifest_is_refused_by_every_reader(tmp_path, how):
    folder = _t5_folder(tmp_path / "t5")
    info = json.loads((folder / "sparsity.json").read_text())
    files = info.pop("files")
    if how == "renamed":
        info["filez"] = files
    (folder / "sparsity.json").write_text(json.dumps(info))
    _every_reader_refuses(folder, tmp_path, "records no weight files")


def test_weights_of_another_save_with_a_rebuilt_manifest_are_refused_by_their_mask(tmp_path):
    folder, other = _t5_folder(tmp_path / "t5"), _t5_folder(tmp_path / "other", seed=1)
    (folder / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    _rebuild_manifest(folder)
    _every_reader_refuses(folder, tmp_path, "do not have the mask recorded")


def test_a_folder_saved_before_the_manifest_loads_with_a_warning(tmp_path, caplog):
    import logging

    from conftest import forget_manifest

    from hf_sms import load_sparse

    folder = _t5_folder(tmp_path / "t5")
    forget_manifest(folder)
    with caplog.at_level(logging.WARNING, logger="hf_sms"):
        load_sparse(str(folder))
    assert "no file manifest" in caplog.text


# -- crafted headers (item 8) -----------------------------------------------------------------------------------------
def _rewrite_header(path, edit) -> None:
    """Rewrite a safetensors file's JSON header with ``edit(header)`` (the data bytes stay)."""
    import struct

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


@pytest.mark.parametrize("bad", [2.0, -2, True])
def test_a_crafted_shape_with_a_rebuilt_manifest_is_refused_not_verified(tmp_path, bad):
    from hf_sms.cli import main

    folder = _t5_folder(tmp_path / "t5")
    path = folder / "model.safetensors"

    def edit(header):  # dims whose product is still the byte count: the old checks passed them
        key = next(
            k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 1 and v["shape"][0] % 2 == 0
        )
        n = header[key]["shape"][0]
        header[key]["shape"] = [bad, n] if bad is True else [bad, int(n / bad)]

    _rewrite_header(path, edit)
    _rebuild_manifest(folder)
    assert main(["inspect", str(folder)]) == 2  # cannot be read as a checkpoint: never "verified"
    assert main(["convert", str(folder), "-o", str(tmp_path / "c"), "--format", "dense"]) == 2  # no traceback


def test_a_dense_folder_whose_record_says_bitmask_is_refused(tmp_path):
    from hf_sms import load_sparse, prune, save_sparse

    model = make_cnn()
    prune(model, 0.5)
    save_sparse(model, str(tmp_path / "d"), "dense")
    info = json.loads((tmp_path / "d" / "sparsity.json").read_text())
    info["format"] = "bitmask"
    (tmp_path / "d" / "sparsity.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="says bitmask but the weights are not hf-sms bitmask files"):
        load_sparse(str(tmp_path / "d"), model=make_cnn())


# -- a requested unit kind no group can take (item 5) ---------------------------------------------------------------
def test_neurons_and_heads_on_bart_is_refused_unless_heads_are_optional():
    from zoo import ZOO

    from hf_sms import compute_masks, resolve_pruning

    entry = ZOO["bart"]  # its config cannot state fewer heads (head size is d_model / heads)
    model, batch = entry.make(), entry.batch()
    with pytest.raises(ValueError, match=r"no heads this run can prune .* structure='neurons\+heads\?'"):
        resolve_pruning(structure="neurons+heads").check(model, 0.5, batch)
    plan = resolve_pruning(structure="neurons+heads?")
    plan.check(model, 0.5, batch)  # allowed: heads where the config can state them, here none
    masks = compute_masks(model, 0.5, structure="neurons+heads?", example_inputs=batch)
    assert any(not bool(m.all()) for m in masks.values())  # the neurons are pruned
    assert plan.describe()["structure"] == "neurons+heads?"  # the run records what it was allowed


# -- following the advice, tuple batches, meta models (item 6) ---------------------------------------------------
class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, shift):
        return self.b(torch.relu(self.a(x))) + shift


def test_a_tuple_batch_reaches_a_forward_that_takes_it_whole_and_a_meta_model_is_refused_for_why():
    from hf_sms import compute_masks, shrink
    from hf_sms.pruning.masks import apply_masks

    model, batch = TwoInputs(), (torch.randn(4, 8), torch.zeros(4, 4))
    masks = compute_masks(model, 0.5, structure="neurons", example_inputs=batch, fit_config=False)
    apply_masks(model, masks)
    smaller = shrink(model, batch, fit_config=False)
    torch.testing.assert_close(smaller(*batch), model(*batch))
    pair = (torch.randn(4, 8), torch.zeros(4, dtype=torch.long))  # (inputs, labels) for a one-input forward
    compute_masks(Flex(False), 0.5, structure="neurons", example_inputs=pair, fit_config=False)
    with torch.device("meta"):
        meta = Flex(False)
    with pytest.raises(ValueError, match="parameters on the meta device"):
        compute_masks(meta, 0.5, structure="neurons", example_inputs=torch.randn(2, 8))


def test_following_the_refusals_advice_ends_in_a_smaller_model_not_a_torch_error():
    from hf_sms import compute_masks, shrink
    from hf_sms.pruning.masks import apply_masks

    model, x = Flex(False), torch.randn(4, 8)
    model.up.register_forward_hook(lambda m, i, o: o * 2)  # a hooked plain MLP, re-run with fit_config=False
    apply_masks(model, compute_masks(model, 0.5, structure="neurons", example_inputs=x, fit_config=False))
    smaller = shrink(model, x, fit_config=False)
    assert sum(p.numel() for p in smaller.parameters()) < sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(smaller(x), model(x))


# -- a smaller model off the traced path (item 2) -------------------------------------------------------------------
def test_a_unit_reaching_a_train_only_head_is_refused_before_training_and_the_smaller_model_trains(caplog):
    """Units are traced in train mode too: the groups googlenet's auxiliary heads read (inception4a, 4d) stay dense,
    named before any training, and the smaller model runs in both modes."""
    import torchvision

    from hf_sms import compute_masks, shrink
    from hf_sms.pruning.masks import apply_masks

    torch.manual_seed(0)
    model = torchvision.models.googlenet(num_classes=4, aux_logits=True, init_weights=False)  # aux heads: train only
    x = torch.randn(2, 3, 96, 96)
    with caplog.at_level("WARNING", logger="hf_sms"):
        masks = compute_masks(model, 0.5, structure="filters", example_inputs=x, fit_config=False)
    assert "read by code only training runs" in caplog.text and "inception4a.branch1.conv" in caplog.text

    def filters_kept(name):
        return masks[name].flatten(1).any(1).float().mean().item()

    assert (
        filters_kept("inception4a.branch1.conv.weight") == 1.0
        and filters_kept("inception3a.branch1.conv.weight") == 0.5
    )
    apply_masks(model, masks)
    smaller = shrink(model, x, fit_config=False)
    assert sum(p.numel() for p in smaller.parameters()) < sum(p.numel() for p in model.parameters())
    smaller.train()
    with torch.no_grad():
        out = smaller(x)
        assert out.logits.shape == (2, 4) and out.aux_logits1.shape == (2, 4)


def test_shrink_still_refuses_a_smaller_model_that_fails_in_train_mode():
    """The second guard, for what a trace in either mode cannot see (a data-dependent branch): the smaller model
    is run in train mode, and a failure names the layer."""
    from hf_sms.shrinking.shrink import _check_train_mode

    class TrainOnly(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.conv, self.aux = nn.Conv2d(3, width, 3), nn.Linear(8, 2)

        def forward(self, x):
            h = self.conv(x).mean((2, 3))
            return h.sum(1, keepdim=True) + (self.aux(h).sum(1, keepdim=True) if self.training else 0)

    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match="fails in train mode at aux"):
        _check_train_mode(TrainOnly(8), TrainOnly(4), x)


class Branchy(nn.Module):
    """A data-dependent branch: the other one reads channels by position, so cutting units moves them."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 8, 3), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.conv(x)).mean((2, 3))
        if x.mean() > 0:
            return self.head(h)
        return self.head(torch.cat([h[:, :4], h[:, :4]], 1))


def test_a_saved_smaller_soup_is_checked_on_other_batches_than_the_traced_one(tmp_path):
    """A data-dependent branch the traced batch did not take: the smaller model agrees on that batch and not on
    another, so the run's final soup is saved as the pruned model, saying why (issue 36 item 2)."""
    import copy
    import json

    from hf_sms import apply_masks, compute_masks, resolve_pruning
    from hf_sms.loop.final_soup import save_final_soup

    torch.manual_seed(0)
    dense = Branchy()
    traced, other = torch.randn(2, 3, 8, 8).abs(), -torch.randn(2, 3, 8, 8).abs()
    plan = resolve_pruning(structure="filters", fit_config=False)
    soup = copy.deepcopy(dense)
    apply_masks(soup, compute_masks(soup, 0.5, structure="filters", example_inputs=traced, fit_config=False))
    kept = save_final_soup(soup, str(tmp_path / "same"), dense=dense, plan=plan, example=traced, recipe={},
                           checks=[traced.flip(0)])  # fmt: skip
    assert json.loads((tmp_path / "same" / "sparsity.json").read_text())["recipe"]["shrunk"]["saved"] == "smaller"
    save_final_soup(soup, str(tmp_path / "other"), dense=dense, plan=plan, example=traced, recipe={}, checks=[other])
    shrunk = json.loads((tmp_path / "other" / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert shrunk["saved"] == "pruned" and "on another validation batch" in shrunk["why"] and kept
