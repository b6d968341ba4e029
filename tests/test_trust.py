"""Silent wrong results turned into errors (or warnings) before any work, and the paper's protocol where it
differed: each test here failed before its fix (issue 14)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import forget_manifest, sms_config
from torch import nn

from hf_sms import SparseModelSoup, run_sms, save_sparse
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import load_digits_splits, split_validation
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.evaluation.subgroups import subgroup_recall


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits(seed=0)


# -- 14: the validation split never depends on the run's seed -------------------------------------------------------
def test_the_validation_split_is_the_same_for_every_seed(tmp_path, digits):
    train, _, _ = digits
    splits = []
    for seed in (0, 1):
        runner = SparseModelSoup(
            DigitsResNet(4), sms_config(tmp_path / str(seed), seed=seed), train, ClassificationAccuracy()
        )
        splits.append(sorted(runner.eval_dataset.indices))
    assert splits[0] == splits[1] == sorted(split_validation(train, 0.1)[1].indices)


def test_the_recipes_split_validation_with_a_fixed_seed(tmp_path):
    import datasets

    from hf_sms import SparseSoupConfig
    from hf_sms.cli.scripts import DataArguments, prepared_splits

    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": list(range(100)), "labels": [0] * 100})})
    vals = []
    for seed in (0, 7):
        args = SparseSoupConfig(output_dir=str(tmp_path), seed=seed, report_to="none", use_cpu=True)
        _, val, _ = prepared_splits(raw, lambda data, training: data, args, DataArguments())
        vals.append(sorted(val["x"]))
    assert vals[0] == vals[1]


# -- 6: pruning-during-training combinations that ran something else than asked ------------------------------------
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pruning_method": "dpf", "merge_methods": ["greedy"]}, "DPF's copies each move their own mask"),
        ({"pruning_method": "gmp", "merge_methods": ["uniform", "greedy"]}, "runs one SMS trajectory"),
        ({"pruning_method": "gmp", "max_steps": 20, "num_train_epochs": 10, "sms_start_epoch": 9.5}, "after the last"),
        (
            {
                "pruning_method": "bimp",
                "max_steps": -1,
                "num_train_epochs": 10,
                "bimp_pretrain_epochs": 4,
                "n_phases": 2,
                "sms_start_epoch": 8,
            },
            "after the start of BIMP's last cycle",
        ),
    ],  # fmt: skip
)
def test_pruning_during_training_refuses_what_it_would_not_run(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        sms_config(tmp_path, num_replicas=2, pruning_steps=3, **fields)


# -- 7: a subgroup without test items is reported, not dropped --------------------------------------------------
def test_a_missing_subgroup_is_reported_as_missing():
    predicted, labels = torch.tensor([0, 1, 1, 0]), torch.tensor([0, 1, 1, 0])
    groups = ["female", "female", "male", "female"]  # no blond man: (male, 0) has no items
    with pytest.warns(UserWarning, match="no test items"):
        result = subgroup_recall(predicted, labels, groups)
    assert result["missing"] == ["group=male,class=0"]
    assert result["per_group"]["group=male,class=0"] is None and result["counts"]["group=male,class=0"] == 0
    assert "missing: group=male,class=0" in result["worst_group"]


# -- 8: structured pruning of a model without convolutions, and replicas trained under another mask ------------
def test_filter_pruning_without_convolutions_is_refused_before_work(tmp_path, digits):
    train, val, _ = digits
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with pytest.raises(ValueError, match="'filters' finds no units in Sequential: the run would train at sparsity 0"):
        SparseModelSoup(mlp, sms_config(tmp_path, allocation="filter_l2"), train, ClassificationAccuracy(), val)
    assert not (tmp_path / "run").exists()


def _net():
    torch.manual_seed(0)
    return DigitsResNet(4)


def test_a_replica_trained_under_another_mask_is_refused_naming_its_folder(tmp_path, digits):
    train, val, _ = digits
    args = sms_config(tmp_path, n_phases=1, num_replicas=2, max_steps=2, measure_speedup=False)
    run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)
    other = sms_config(tmp_path / "other", n_phases=1, num_replicas=2, max_steps=2, target_sparsity=0.5)
    run_sms(_net(), other, train, ClassificationAccuracy(), eval_dataset=val)
    replica = tmp_path / "run" / "sms" / "phase1" / "replica1"
    shutil.rmtree(replica)
    shutil.copytree(tmp_path / "other" / "run" / "sms" / "phase1" / "replica1", replica)  # denser: another mask
    (tmp_path / "run" / "final_soup" / "sparsity.json").unlink()
    with pytest.raises(ValueError, match=r"phase1/replica1 holds weights where this phase's mask prunes them"):
        run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)


# -- 9: one job at a time, and no checkpoint lost to a kill between renames -------------------------------------
def test_a_second_pretraining_into_the_same_folder_stops_at_once(tmp_path, digits):
    import os

    from conftest import make_cnn

    from hf_sms import SparseSoupConfig
    from hf_sms.cli.scripts import pretrain
    from hf_sms.loop.run_directory import lock_folder

    train, _, _ = digits
    args = SparseSoupConfig(output_dir=str(tmp_path / "run"), pretrain_epochs=1, report_to="none", use_cpu=True)
    held = lock_folder(str(tmp_path / "dense"), "pretraining", "--dense_dir")  # the first job
    try:
        with pytest.raises(RuntimeError, match="another hf-sms process is pretraining in .*dense"):
            pretrain(make_cnn(), args, train, str(tmp_path / "dense"))
    finally:
        os.close(held)


def test_a_kill_between_the_two_renames_of_a_save_loses_nothing(tmp_path):
    import os

    from conftest import make_cnn

    from hf_sms import load_sparse, save_sparse
    from hf_sms.checkpoint.folder import PREVIOUS_SUFFIX

    old, new = make_cnn(seed=0), make_cnn(seed=1)
    folder = tmp_path / "ckpt"
    save_sparse(old, str(folder))
    (folder / "notes.txt").write_text("kept")
    os.replace(folder, str(folder) + PREVIOUS_SUFFIX)  # killed right after the first rename of the next save
    assert not folder.exists()
    save_sparse(new, str(folder))  # the next write puts the old folder back, then replaces its weights
    assert (folder / "notes.txt").read_text() == "kept" and not os.path.exists(str(folder) + PREVIOUS_SUFFIX)
    loaded = load_sparse(str(folder), make_cnn(seed=2))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), new.state_dict().values()))


# -- 10: resume refusals that help ---------------------------------------------------------------------------------
def test_resume_keeps_replicas_when_only_reported_test_sets_change(tmp_path, digits):
    train, val, test = digits
    args = sms_config(tmp_path, n_phases=1, max_steps=2, measure_speedup=False)
    run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=test)
    replica = tmp_path / "run" / "sms" / "phase1" / "replica0" / "sparsity.json"
    before = replica.stat().st_mtime_ns
    more = {"test": test, "again": test}
    _, results = run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=more)
    assert replica.stat().st_mtime_ns == before and "again" in results["rows"]["sms_uniform"][-1]["tests"]


def test_a_field_an_older_run_did_not_record_passes_at_its_default_and_is_named_otherwise(tmp_path, digits):
    import json

    train, val, _ = digits
    args = sms_config(tmp_path, n_phases=1, max_steps=2, measure_speedup=False)
    run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)
    run_file = tmp_path / "run" / "run.json"
    recorded = json.loads(run_file.read_text())
    del recorded["config"]["greedy_keep_ties"]  # as if written before the field existed
    run_file.write_text(json.dumps(recorded))
    run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)  # default: the old behaviour
    run_file.write_text(json.dumps(recorded))
    with pytest.raises(ValueError, match=r"changed: \['config.greedy_keep_ties'\]"):
        run_sms(_net(), sms_config(tmp_path, n_phases=1, max_steps=2, measure_speedup=False, greedy_keep_ties=True),
                train, ClassificationAccuracy(), eval_dataset=val)  # fmt: skip


def test_a_schedule_mistake_is_caught_before_the_run_folder_and_the_corrected_rerun_runs(tmp_path, digits):
    train, val, _ = digits
    bad = sms_config(tmp_path, pruning_method="gmp", num_replicas=1, max_steps=4, pruning_steps=6)
    with pytest.raises(ValueError, match="6 pruning steps need total_steps >= 7"):
        run_sms(_net(), bad, train, ClassificationAccuracy(), eval_dataset=val)
    assert not (tmp_path / "run" / "run.json").exists()
    good = sms_config(tmp_path, pruning_method="gmp", num_replicas=1, max_steps=4, pruning_steps=2)
    run_sms(_net(), good, train, ClassificationAccuracy(), eval_dataset=val)
    assert (tmp_path / "run" / "final_soup" / "sparsity.json").is_file()


# -- 11: clear messages instead of tracebacks ----------------------------------------------------------------------
def test_a_cifar_c_folder_with_only_labels_is_explained(tmp_path):
    import numpy as np

    from hf_sms.evaluation.corruptions import load_cifar_c

    np.save(tmp_path / "labels.npy", np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="no corruption files"):
        load_cifar_c(tmp_path)


def test_an_unnamed_test_pair_is_explained(tmp_path, digits):
    train, val, test = digits
    accuracy = ClassificationAccuracy()
    with pytest.raises(ValueError, match=r"needs a name: pass test_dataset=\{'test': \(dataset, metric\)\}"):
        SparseModelSoup(_net(), sms_config(tmp_path), train, accuracy, val, test_dataset=(test, accuracy))


def test_a_missing_group_column_is_explained_before_work(tmp_path):
    import datasets

    from hf_sms import SparseSoupConfig
    from hf_sms.cli.scripts import DataArguments, prepared_splits

    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [1, 2, 3, 4], "labels": [0, 1, 0, 1]})})
    args = SparseSoupConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="--group_column 'Male' is not a column of the 'train' split"):
        prepared_splits(raw, lambda data, training: data, args, DataArguments(group_column="Male"))


def test_a_meta_device_model_and_an_unsplittable_stream_are_explained(tmp_path, digits):
    from accelerate import init_empty_weights

    train, val, _ = digits
    with init_empty_weights():
        empty = DigitsResNet(4)
    with pytest.raises(ValueError, match="meta device"):
        SparseModelSoup(empty, sms_config(tmp_path), train, ClassificationAccuracy(), val)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(train)

    with pytest.raises(ValueError, match="cannot be split for validation: pass eval_dataset"):
        SparseModelSoup(_net(), sms_config(tmp_path), Stream(), ClassificationAccuracy())


def test_hf_sms_table_names_a_truncated_results_file(tmp_path, capsys):
    from hf_sms.cli import main

    (tmp_path / "results.json").write_text('{"phases": [0.5], "rows": {')
    assert main(["table", str(tmp_path / "results.json")]) == 2
    assert "results.json is not a readable results.json" in capsys.readouterr().err


def test_an_architecture_that_is_not_a_model_class_is_explained(tmp_path):
    import json

    from conftest import make_t5

    from hf_sms import load_sparse, save_sparse

    save_sparse(make_t5(), str(tmp_path / "ckpt"))
    info = json.loads((tmp_path / "ckpt" / "sparsity.json").read_text())
    info["architecture"] = "AutoConfig"
    (tmp_path / "ckpt" / "sparsity.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="'AutoConfig' is not a transformers model class"):
        load_sparse(str(tmp_path / "ckpt"))


# -- 5: streaming data is fingerprinted by what it holds, or resuming needs resume="force" ------------------------
class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, items, once=False):
        self.items, self.once, self.used = items, once, False

    def __iter__(self):
        if self.once and self.used:  # a stream that cannot be read again
            return iter(())
        self.used = True
        return iter(self.items)


def test_streaming_training_data_is_identified_by_its_items(tmp_path, digits):
    train, val, _ = digits
    items = [train[i] for i in range(256)]
    args = sms_config(tmp_path, n_phases=1, max_steps=2, measure_speedup=False)
    run_sms(_net(), args, _Stream(items), ClassificationAccuracy(), eval_dataset=val)
    run_sms(_net(), args, _Stream(items), ClassificationAccuracy(), eval_dataset=val)  # the same stream resumes
    with pytest.raises(ValueError, match=r"changed: \['data.train'\]"):
        run_sms(_net(), args, _Stream(items[::-1]), ClassificationAccuracy(), eval_dataset=val)


def test_a_stream_nothing_identifies_needs_resume_force(tmp_path, digits):
    train, val, _ = digits
    items = [train[i] for i in range(256)]
    args = sms_config(tmp_path, n_phases=1, max_steps=2, measure_speedup=False)
    run_sms(_net(), args, _Stream(items), ClassificationAccuracy(), eval_dataset=val)
    stream = _Stream(items, once=True)
    list(stream)  # read once already: hf-sms cannot look at it
    with pytest.raises(ValueError, match="stream hf-sms cannot identify.*resume='force'"):
        run_sms(_net(), args, stream, ClassificationAccuracy(), eval_dataset=val)
    forced = sms_config(tmp_path, n_phases=1, max_steps=2, measure_speedup=False, resume="force")
    replica = tmp_path / "run" / "sms" / "phase1" / "replica0" / "sparsity.json"
    before = replica.stat().st_mtime_ns
    with pytest.raises(ValueError, match="recalibrate_batchnorm got no batches"):  # vouched for: it resumes, and
        run_sms(_net(), forced, stream, ClassificationAccuracy(), eval_dataset=val)  # this spent stream has no data
    assert replica.stat().st_mtime_ns == before  # the finished replica was loaded, not retrained


# -- 12: DPF + SMS keeps DPF's dense values across merges, as plain DPF does -----------------------------------
def test_dpf_sms_copies_start_from_the_dense_mean_not_a_zeroed_model(tmp_path, digits):
    train, val, _ = digits
    args = sms_config(tmp_path, pruning_method="dpf", num_replicas=2, max_steps=12, pruning_steps=2, dpf_interval=2)
    runner = SparseModelSoup(_net(), args, train, ClassificationAccuracy(), val)
    starts, run_phase = [], runner.run_phase

    def spy(spec):
        params = dict(spec.start.named_parameters())
        starts.append(sum(int((params[n].detach()[~m] != 0).sum()) for n, m in spec.masks.items()))
        return run_phase(spec)

    runner.run_phase = spy
    soup = runner.run()
    assert len(starts) == 2 and starts[1] > 0  # phase 2 starts with values under its mask: they may come back
    assert runner.results["rows"]["sms_uniform"][-1]["sparsity"] == pytest.approx(0.8, abs=0.02)
    assert sum(int((p == 0).sum()) for n, p in soup.named_parameters() if n.endswith("weight")) > 0
    # the copies are dense: no candidate rows that would pair their dense scores with the soup's sparsity
    assert not any("candidate" in row for row in runner.results["rows"])


# -- 15: pretraining keeps the paper's global batch whatever the number of processes ---------------------------
def _spy_trainer(monkeypatch, module) -> dict:
    """``module.SparseSoupTrainer`` replaced by one that records the batch each process gets and stops there."""
    seen = {}

    class Spy(module.SparseSoupTrainer):
        def __init__(self, model, args, **kwargs):
            seen["per_device"] = args.per_device_train_batch_size
            raise RuntimeError("stop here")

    monkeypatch.setattr(module, "SparseSoupTrainer", Spy)
    return seen


def test_pretraining_splits_the_global_batch_over_the_processes(tmp_path, digits, monkeypatch):
    from conftest import make_cnn

    import hf_sms.cli.scripts as scripts
    from hf_sms import SparseSoupConfig

    train, _, _ = digits
    seen = _spy_trainer(monkeypatch, scripts)
    monkeypatch.setattr(scripts, "launched_world_size", lambda: 2)
    args = SparseSoupConfig(
        output_dir=str(tmp_path / "run"), pretrain_epochs=1, per_device_train_batch_size=128, report_to="none",
        use_cpu=True,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="stop here"):
        scripts.pretrain(make_cnn(), args, train, str(tmp_path / "dense"))
    assert seen["per_device"] == 64  # 2 x 64 = the global 128
    odd = SparseSoupConfig(output_dir=str(tmp_path / "run"), pretrain_epochs=1, per_device_train_batch_size=127,
                           report_to="none", use_cpu=True)  # fmt: skip
    with pytest.raises(ValueError, match="launch a number of processes that divides it"):
        scripts.pretrain(make_cnn(), odd, train, str(tmp_path / "dense2"))


# -- issue 21: more hostile inputs, each refused before any work with what to do -----------------------------------
def test_merge_weights_that_overflow_are_refused(tmp_path):
    from conftest import make_cnn

    from hf_sms import apply_masks, compute_masks, save_sparse
    from hf_sms.cli import main

    dirs = []
    for i in range(2):
        model = make_cnn(seed=i)
        apply_masks(model, compute_masks(model, 0.5))
        dirs.append(save_sparse(model, str(tmp_path / f"r{i}")))
    for weights in (["1e308", "1e308"], ["inf", "1"], ["nan", "1"]):
        assert main(["merge", *dirs, "--weights", *weights, "--output", str(tmp_path / "soup")]) == 2
        assert not (tmp_path / "soup").exists()


def test_speed_options_and_inputs_it_cannot_make_are_explained(tmp_path, capsys):
    from conftest import make_t5
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    from hf_sms import apply_masks, compute_masks, save_sparse
    from hf_sms.cli import main

    t5 = make_t5()
    apply_masks(t5, compute_masks(t5, 0.5))
    folder = save_sparse(t5, str(tmp_path / "t5"))
    for argv, message in (
        (["--threads", "0"], "--threads must be a positive integer"),
        (["--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--repeats", "0"], "--repeats must be a positive integer"),
    ):
        assert main(["speed", folder, "--no-memory", *argv]) == 2
        assert message in capsys.readouterr().err
    config = Wav2Vec2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_feat_extract_layers=2)  # fmt: skip
    speech = Wav2Vec2ForCTC(config)
    apply_masks(speech, compute_masks(speech, 0.5))
    folder = save_sparse(speech, str(tmp_path / "speech"))
    assert main(["speed", folder, "--no-memory"]) == 2
    assert "takes 'input_values'" in capsys.readouterr().err


def test_runtime_repeats_and_empty_test_sets_are_explained(digits):
    from conftest import make_cnn

    from hf_sms import to_sparse_runtime
    from hf_sms.evaluation.named import named_tests

    with pytest.raises(ValueError, match="repeats is how often each timing runs"):
        to_sparse_runtime(make_cnn(), "auto", torch.randn(2, 3, 8, 8), repeats=0)
    accuracy = ClassificationAccuracy()
    for empty in ({"ood": ({}, accuracy)}, {"test": []}, []):
        with pytest.raises(ValueError, match="is empty"):
            named_tests(empty, accuracy)


def test_meta_templates_remote_code_and_a_half_replaced_folder_are_handled(tmp_path):
    import os

    from conftest import make_t5
    from transformers import T5ForConditionalGeneration

    from hf_sms import apply_masks, compute_masks, load_sparse, save_sparse, to_sparse_runtime

    model = make_t5()
    apply_masks(model, compute_masks(model, 0.5))
    folder = save_sparse(model, str(tmp_path / "soup"))
    with torch.device("meta"):
        template = T5ForConditionalGeneration(model.config)
    loaded = load_sparse(folder, template)  # a template built without weights gets them, ties restored
    assert all(p.device.type == "cpu" for p in loaded.parameters()) and loaded.lm_head.weight is loaded.shared.weight
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match="never runs code from a checkpoint folder"):
        load_sparse(folder, trust_remote_code=True)
    with torch.device("meta"):
        empty = T5ForConditionalGeneration(model.config)
    with pytest.raises(ValueError, match="parameters on the meta device"):
        to_sparse_runtime(empty, "csr")
    os.replace(folder, folder + ".hf_sms-previous")  # a save killed between its two renames
    assert torch.equal(load_sparse(folder).shared.weight, model.shared.weight)  # the old folder is put back


def test_a_runtime_model_refuses_another_shape_and_a_second_conversion():
    from conftest import make_t5

    from hf_sms import apply_masks, compute_masks, to_sparse_runtime

    model = make_t5()
    apply_masks(model, compute_masks(model, 0.9, "uniform"))
    runtime = to_sparse_runtime(model, "csr")
    state = runtime.state_dict()
    name = "encoder.block.0.layer.0.SelfAttention.q.weight"  # a bias-less layer
    state[name] = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match=f"size mismatch for {name}"):
        runtime.load_state_dict(state)
    with pytest.raises(ValueError, match="already runs the sparse runtime"):
        to_sparse_runtime(runtime, "csr")
    assert runtime.hf_sms_runtime.layers  # its report is untouched


def test_a_tied_lm_head_loaded_into_the_runtime_is_timed_as_a_linear_layer(tmp_path):
    from conftest import make_t5

    from hf_sms import apply_masks, compute_masks, load_sparse, save_sparse

    model = make_t5()
    apply_masks(model, compute_masks(model, 0.9, "uniform"))
    folder = save_sparse(model, str(tmp_path / "soup"))
    ids = torch.randint(2, 384, (1, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "decoder_input_ids": ids}
    runtime = load_sparse(folder, runtime="auto", sample_input=batch)
    (head,) = [c for c in runtime.hf_sms_runtime.layers if c.name == "lm_head"]
    assert head.kind == "linear" and head.dense_ms is not None and not head.reason.startswith("memory")
    with torch.no_grad():
        torch.testing.assert_close(runtime(**batch).logits, model.eval()(**batch).logits, rtol=1e-4, atol=1e-4)


def test_a_runtime_load_into_a_template_lacking_checkpoint_tensors_is_refused(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_sms import apply_masks, compute_masks, load_sparse, save_sparse

    config = T5Config(vocab_size=64, d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=2, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config)
    apply_masks(model, compute_masks(model, 0.9, "uniform"))
    folder = save_sparse(model, str(tmp_path / "soup"))
    config.num_layers = config.num_decoder_layers = 1
    for runtime in ("csr", None):  # the runtime path now refuses what the dense path refuses
        with pytest.raises(ValueError, match="no place for|unexpected tensors"):
            load_sparse(folder, T5ForConditionalGeneration(config), runtime=runtime)
    assert load_sparse(folder, runtime="csr").hf_sms_runtime.layers  # its own architecture loads


def _flip_a_bit(path, key: str) -> None:
    """Flip the lowest bit of the first byte of tensor ``key`` in a safetensors file, in place."""
    from hf_sms.checkpoint.safetensors_io import SafetensorsFile

    f = SafetensorsFile(str(path))
    at = f.data_start + f.entries[key][2]
    with open(path, "r+b") as out:
        out.seek(at)
        byte = out.read(1)[0]
        out.seek(at)
        out.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
def test_one_flipped_bit_in_a_tensor_stored_as_it_is_is_refused(tmp_path, fmt):
    """Case 4: biases, norms, BatchNorm statistics and dense-stored weights carry a checksum too."""
    from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

    from hf_sms import load_sparse, prune, save_sparse

    torch.manual_seed(0)
    cnn = DigitsResNet(width=4)
    prune(cnn, 0.5)
    save_sparse(cnn, tmp_path / "cnn", format=fmt)
    raw = ["fc.bias", "layer1.bn1.running_var", "layer1.bn1.num_batches_tracked"]
    for key in raw + ["fc.weight"] if fmt == "dense" else raw:  # bitmask: the weight is encoded, its index checks it
        folder = tmp_path / f"cnn-{key}"
        shutil.copytree(tmp_path / "cnn", folder)
        _flip_a_bit(folder / "model.safetensors", key)
        with pytest.raises(ValueError, match=f"checksum mismatch in '{key}'"):
            load_sparse(folder, model=DigitsResNet(width=4))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    save_sparse(t5, tmp_path / "t5", format=fmt)
    _flip_a_bit(tmp_path / "t5" / "model.safetensors", "encoder.final_layer_norm.weight")
    with pytest.raises(ValueError, match="checksum mismatch in 'encoder.final_layer_norm.weight'"):
        load_sparse(tmp_path / "t5")
    if fmt == "bitmask":  # through transformers, with hf_sms imported
        with pytest.raises(ValueError, match="checksum mismatch"):
            AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5")


def test_a_merge_of_a_corrupted_replica_is_refused(tmp_path):
    """Stored values of an encoded tensor are checked before they are averaged (the merged index is re-stamped)."""
    from hf_sms import prune, save_sparse
    from hf_sms.checkpoint import merge_checkpoints

    torch.manual_seed(0)
    model = DigitsResNet(width=4)
    prune(model, 0.5)
    for name in "ab":
        save_sparse(model, tmp_path / name)
    key = next(n for n, p in model.named_parameters() if p.dim() > 1)
    _flip_a_bit(tmp_path / "b" / "model.safetensors", key)
    with pytest.raises(ValueError, match=f"checksum mismatch in '{key}'"):
        merge_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "soup")
    assert not (tmp_path / "soup").exists()


def _claiming(values: torch.Tensor, positions, shape) -> torch.Tensor:
    """An Elias-Fano index placing ``values`` at ``positions`` of a tensor of ``shape`` (any size: nothing dense)."""
    import zlib

    import numpy as np

    from hf_sms.checkpoint import codec

    pos, numel = np.asarray(positions, dtype=np.int64), int(np.prod(shape, dtype=np.float64))
    k, ubits = codec._elias_fano_k(numel, len(pos))
    unary = np.zeros(ubits, dtype=bool)
    unary[(pos >> k) + np.arange(len(pos))] = True
    low = pos & ((1 << k) - 1)
    payload = [np.packbits(unary, bitorder="little")] + [
        np.packbits((low >> j) & 1, bitorder="little") for j in range(k)
    ]
    crc = zlib.crc32(codec.bytes_of(values))
    for part in payload:
        crc = zlib.crc32(part, crc)
    head = codec.HEAD.pack(codec.MAGIC, codec.FORMAT_VERSION, codec.ELIAS_FANO, k, len(shape), len(pos), ubits, crc)
    dims = np.asarray(shape, dtype="<u8").view(np.uint8)
    return torch.from_numpy(np.concatenate([np.frombuffer(head, np.uint8), dims, *payload]))


def test_an_index_claiming_a_huge_shape_is_refused_before_anything_is_decoded(tmp_path):
    """Case 5: a small index claiming 2^35 entries stalled a runtime load for 14 s before any shape was compared."""
    import time

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_sms import load_sparse, prune, save_sparse

    config = T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    model = T5ForConditionalGeneration(config)
    prune(model, 0.5)
    save_sparse(model, tmp_path / "t5")
    path = tmp_path / "t5" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    key = "encoder.block.0.layer.1.DenseReluDense.wi.weight"
    values = torch.ones(100)
    tensors[key], tensors[key + ".sp_index"] = values, _claiming(values, range(0, 10**9, 10**7), (2**20, 2**15))
    save_file(tensors, path, metadata=metadata)
    forget_manifest(tmp_path / "t5")  # the shape check behind the manifest's (which refuses the rewritten file)
    assert path.stat().st_size < 40_000
    for kwargs in ({"runtime": "csr"}, {}, {"model": T5ForConditionalGeneration(config)}):
        start = time.perf_counter()
        with pytest.raises(ValueError, match=r"claims shape \(1048576, 32768\), but the model's \(32, 16\)"):
            load_sparse(tmp_path / "t5", **kwargs)
        # refused from the header, not after decoding 2^35 entries (hours, and 32 GiB): a bound no loaded machine meets
        assert time.perf_counter() - start < 60, kwargs


def test_a_runtime_model_does_not_follow_its_file_unless_mapped_on_request(tmp_path):
    """Case 7: rewriting model.safetensors in place changed a runtime model's outputs, truncating it killed the
    process (SIGBUS). The values are copied by default; ``mmap=True`` maps them, with the hazard documented."""
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_sms import load_sparse, prune, save_sparse
    from hf_sms.checkpoint.safetensors_io import SafetensorsFile

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2))
    prune(model, 0.9)
    save_sparse(model, tmp_path / "t5")
    path = tmp_path / "t5" / "model.safetensors"
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def out(m):
        with torch.no_grad():
            return m(input_ids=ids, decoder_input_ids=ids).logits

    copied, mapped = load_sparse(tmp_path / "t5", runtime="csr"), load_sparse(tmp_path / "t5", runtime="csr", mmap=True)
    before = out(copied)
    assert torch.equal(out(mapped), before)
    f = SafetensorsFile(str(path))
    with open(path, "r+b") as w:  # every stored value of every encoded weight rewritten in place
        for key, (dtype, shape, begin, _) in f.entries.items():
            if key + ".sp_index" in f.entries:
                w.seek(f.data_start + begin)
                w.write(torch.full(shape, 7.0, dtype=dtype).numpy().tobytes())
    assert torch.equal(out(copied), before)
    assert not torch.equal(out(mapped), before)  # the documented hazard of mmap=True
    del mapped
    with open(path, "r+b") as w:
        w.truncate(100)
    assert torch.equal(out(copied), before)  # no SIGBUS: nothing of the file is used after loading
    with pytest.raises(ValueError, match="mmap=True maps the values of a runtime load"):
        load_sparse(tmp_path / "t5", mmap=True)


def test_a_runtime_model_copies_and_runs_under_autocast_and_refuses_a_dtype_it_cannot_compute_in():
    """Case 19: copy.deepcopy, .to(torch.bfloat16) and CPU autocast(bfloat16) of a runtime model gave raw errors."""
    import copy

    from transformers import T5Config, T5ForConditionalGeneration

    from hf_sms import prune, to_sparse_runtime

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, tie_word_embeddings=True)
    model = T5ForConditionalGeneration(config).eval()
    prune(model, 0.9)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "decoder_input_ids": ids}
    runtime = to_sparse_runtime(copy.deepcopy(model), "csr", batch, min_sparsity=0.0)
    assert type(runtime.lm_head).__name__ == "SparseLinear"
    with torch.no_grad():
        expected = runtime(**batch).logits
        twin = copy.deepcopy(runtime)
        assert twin.lm_head.weight is not runtime.lm_head.weight  # its own sparse weights
        assert twin.lm_head.weight is twin.shared.weight  # ties kept inside the copy
        torch.testing.assert_close(twin(**batch).logits, expected)
        runtime.lm_head.weight.values().zero_()
        torch.testing.assert_close(twin(**batch).logits, expected)  # independent of the original
        with torch.autocast("cpu", torch.bfloat16):  # the sparse layers compute in float32 inside it
            torch.testing.assert_close(twin(**batch).logits.float(), expected, rtol=0.1, atol=0.1)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half()):
        with pytest.raises(ValueError, match="cannot become torch.(bfloat16|float16) on cpu: torch's CSR product"):
            cast(twin)
        assert {p.dtype for p in twin.parameters()} == {torch.float32}  # refused before any module changed
        assert twin.shared.weight is twin.lm_head.weight and twin.shared.weight.dtype == torch.float32
    torch.testing.assert_close(twin(**batch).logits, expected)
    assert twin.double()(**batch).logits.dtype == torch.float64  # a dtype the CSR product takes


def test_data_is_identified_by_all_of_it_where_cheap_and_run_json_says_what_was_compared(tmp_path, digits):
    """Case 3: a stream's .take(96) instead of .take(24), more rows appended to its file, or map-style data changed
    away from 16 sampled items resumed the old run and returned the old soup."""
    import json

    import datasets

    from hf_sms.data import TensorDictDataset
    from hf_sms.loop.run_directory import data_identity

    train, val, _ = digits
    x, labels = train.x[:200].clone(), train.labels[:200].clone()
    changed = labels.clone()
    changed[101] = (changed[101] + 1) % 10  # not one of the 16 items spread over 200
    (a, how), (b, _) = (data_identity(TensorDictDataset(x, y)) for y in (labels, changed))
    assert a != b and how == "every one of its 200 items"
    table = datasets.Dataset.from_dict({"x": x.flatten(1).tolist(), "labels": labels.tolist()})
    stream = table.to_iterable_dataset(num_shards=2)
    takes = {n: data_identity(stream.take(n)) for n in (24, 96)}
    assert takes[24][0] != takes[96][0] and "take/skip/shuffle" in takes[24][1]
    assert data_identity(table.to_iterable_dataset(num_shards=4))[0] != data_identity(stream)[0]  # more shards
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"x": r, "labels": int(y)}) + "\n" for r, y in zip(x[:40].flatten(1).tolist(), labels[:40]))
    )
    before = data_identity(datasets.load_dataset("json", data_files=str(rows), split="train", streaming=True))[0]
    with open(rows, "a") as f:
        f.write(json.dumps({"x": x[40].flatten().tolist(), "labels": int(labels[40])}) + "\n")  # appended data
    after = data_identity(datasets.load_dataset("json", data_files=str(rows), split="train", streaming=True))[0]
    assert before != after

    args = sms_config(tmp_path / "a", n_phases=1, max_steps=2, measure_speedup=False)
    run_sms(_net(), args, TensorDictDataset(x, labels), ClassificationAccuracy(), eval_dataset=val)
    record = json.loads((tmp_path / "a" / "run" / "run.json").read_text())
    assert record["data_compared"] == {"train": "every one of its 200 items", "eval": "every one of its 144 items"}
    with pytest.raises(ValueError, match=r"changed: \['data.train'\]"):
        run_sms(_net(), args, TensorDictDataset(x, changed), ClassificationAccuracy(), eval_dataset=val)


def test_a_replica_data_parallel_over_its_group_keeps_the_runs_batch(tmp_path, digits, monkeypatch):
    """With N = k * m processes each replica trained at k x per_device_train_batch_size; the paper retrains at the
    pretraining batch. Now each of the k processes takes 1 / k of it; a batch k does not divide is refused."""
    import hf_sms.loop.sms as loop
    from hf_sms.methods.common import empty_step, total_steps

    train, val, _ = digits
    seen = _spy_trainer(monkeypatch, loop)
    args = sms_config(tmp_path, n_phases=1, per_device_train_batch_size=64, num_train_epochs=2, max_steps=-1)
    runner = SparseModelSoup(_net(), args, train, ClassificationAccuracy(), eval_dataset=val)
    steps_alone = total_steps(runner)
    runner.world.group_size = 4  # as on N = 4 * m processes
    with pytest.raises(RuntimeError, match="stop here"):
        runner.train_replica(runner.pretrained, empty_step(), args, "replica")
    assert seen["per_device"] == 16 and total_steps(runner) == steps_alone  # 4 x 16 = the run's 64, same steps
    odd = sms_config(tmp_path / "odd", n_phases=1, per_device_train_batch_size=30)
    with pytest.raises(ValueError, match="split 4 ways: give a batch size divisible by 4"):
        loop.check_world(odd, runner.world)  # what the loop checks once the world exists, before any work


def test_a_run_from_public_weights_says_so_in_its_output_and_card(tmp_path, digits, caplog):
    """Recipes starting from public weights (ResNet-50, MaxViT, T5, PSPNet's encoder) note that the validation split
    was in those weights' training data and that pretrain_* describe a training that did not run here."""
    import json
    import logging

    from hf_sms.cli.scripts import public_weights_note

    train, val, _ = digits
    note = public_weights_note("timm/resnet50.a1_in1k")
    assert "validation split held out here was in the training data" in note and "pretrain_*" in note
    assert "validation split" not in public_weights_note("resnet50 encoder (imagenet)", saw_validation=False)
    args = sms_config(
        tmp_path, n_phases=1, max_steps=2, measure_speedup=False, weight_decay=1e-4, optim_args="momentum=0.9"
    )
    with caplog.at_level(logging.WARNING, logger="hf_sms"):
        run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val, model_card={"notes": [note]})
    assert any(note in r.getMessage() for r in caplog.records)  # said in the run's output
    soup = tmp_path / "run" / "final_soup"
    assert json.loads((soup / "sparsity.json").read_text())["recipe"]["notes"] == [note]
    card = (soup / "README.md").read_text()
    assert "## Notes" in card and "was in the training data of those weights" in card


def test_folders_are_written_with_the_users_umask(tmp_path):
    """Issue 30: a folder hf-sms writes gets the mode the user's umask gives, not mkdtemp's 0700."""
    old = os.umask(0o022)
    try:
        save_sparse(nn.Linear(4, 4), str(tmp_path / "soup"))
        assert os.stat(tmp_path / "soup").st_mode & 0o777 == 0o755
        os.umask(0o077)
        save_sparse(nn.Linear(4, 4), str(tmp_path / "private"))
        assert os.stat(tmp_path / "private").st_mode & 0o777 == 0o700
    finally:
        os.umask(old)


def test_batchnorm_recalibration_without_batches_is_refused():
    """Issue 30: recalibrating on no data would reset every BatchNorm to mean 0, variance 1 without a word."""
    from hf_sms import recalibrate_batchnorm

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    model[1].running_mean.fill_(3.0)
    with pytest.raises(ValueError, match="got no batches"):
        recalibrate_batchnorm(model, [])
    assert bool((model[1].running_mean == 3.0).all())  # untouched


def test_an_index_whose_weight_map_is_not_names_is_refused_with_a_message(tmp_path, capsys):
    """Issue 30: numbers in model.safetensors.index.json's weight_map crashed the reader (AttributeError) and
    `hf-sms inspect` printed a raw traceback."""
    import json

    from hf_sms import load_sparse
    from hf_sms.cli import main

    folder = tmp_path / "soup"
    save_sparse(nn.Linear(4, 4), str(folder))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"weight": 1, "bias": 2}}))
    with pytest.raises(ValueError, match="has no weight_map of tensor names to file names"):
        load_sparse(str(folder), model=nn.Linear(4, 4))
    assert main(["inspect", str(folder)]) == 2
    assert "has no weight_map of tensor names to file names" in capsys.readouterr().err


def test_data_built_on_the_fly_is_read_in_full_and_a_partial_comparison_is_said(tmp_path, digits, caplog):
    """Issue 30: a map-style set building items on the fly with one item changed, and a plain torch stream grown from
    24 to 96 items, resumed the old run without a word; now both are read in full (up to ITEMS items), and a resume
    that compared only part of a larger set says so."""
    from torch.utils.data import Dataset, IterableDataset

    from hf_sms.loop import run_directory
    from hf_sms.loop.run_directory import data_identity

    class OnTheFly(Dataset):
        def __init__(self, n, changed=None):
            self.n, self.changed = n, changed

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {"x": torch.full((1, 8, 8), float(i == self.changed)), "labels": torch.tensor(i % 10)}

    class Stream(IterableDataset):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return ({"x": torch.full((1, 8, 8), float(i)), "labels": torch.tensor(i % 10)} for i in range(self.n))

    assert data_identity(OnTheFly(300))[0] != data_identity(OnTheFly(300, changed=101))[0]
    (a, how), (b, _) = data_identity(Stream(24)), data_identity(Stream(96))
    assert a != b and how == "all its 24 items"
    train, val, _ = digits
    args = sms_config(tmp_path, n_phases=1, max_steps=2, measure_speedup=False)
    big = OnTheFly(5000)  # above ITEMS: its length and 16 items
    run_sms(_net(), args, big, ClassificationAccuracy(), eval_dataset=val)
    with caplog.at_level("WARNING", logger=run_directory.__name__):
        run_sms(_net(), args, big, ClassificationAccuracy(), eval_dataset=val)
    assert "its train data was compared with the run's by its length and 16 of its 5000 items" in caplog.text
