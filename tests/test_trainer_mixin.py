"""hf-sms in the Trainer a user already has (issue 30): the mixin with Seq2SeqTrainer (transformers'
run_translation.py pattern, BLEU from generate), trl's SFTTrainer where trl installs, and the user's defaults kept."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_t5
from safetensors.torch import load_file
from transformers import ByT5Tokenizer, Seq2SeqTrainingArguments, TrainingArguments

import hf_sms
from hf_sms import SparseSoupSeq2SeqConfig, SparseSoupSeq2SeqTrainer, sparse_config
from hf_sms.training.arguments import as_sparse_arguments

SCRIPT = Path(__file__).parent / "scripts" / "run_translation_sms.py"
REPO = str(Path(__file__).parent.parent)


def test_arguments_classes_keep_their_own_defaults_and_values():
    own = {f.name: f.default for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    composed = {f.name: f.default for f in dataclasses.fields(SparseSoupSeq2SeqConfig)}
    assert {k: composed[k] for k in own} == own  # every Seq2SeqTrainingArguments default as it is
    assert {"target_sparsity", "retrain_schedule", "num_replicas"} <= set(composed)
    assert composed["decay_all_parameters"] is False  # the Trainer's own weight decay
    # the SMS run's config keeps the paper's settings
    assert hf_sms.SparseSoupConfig(output_dir="x", report_to="none").max_grad_norm == 0.0
    user = Seq2SeqTrainingArguments(output_dir="x", sortish_sampler=True, predict_with_generate=True,
                                    generation_num_beams=3, hub_token="hf_user_token", report_to="none")  # fmt: skip
    args = as_sparse_arguments(user)  # what SparseSoupSeq2SeqTrainer does with plain Seq2SeqTrainingArguments
    assert type(args) is SparseSoupSeq2SeqConfig and args.sortish_sampler and args.generation_num_beams == 3
    assert args.hub_token == "hf_user_token" and args.max_grad_norm == 1.0 and args.save_strategy == "steps"
    assert sparse_config(TrainingArguments) is hf_sms.SparseSoupConfig
    with pytest.raises(TypeError, match="TrainingArguments subclass"):
        sparse_config(dict)


def test_a_composed_arguments_class_of_any_trainer_pickles_without_the_token(tmp_path):
    @dataclasses.dataclass
    class MyArguments(TrainingArguments):
        my_field: int = 7

    cls = sparse_config(MyArguments)
    assert sparse_config(MyArguments) is cls and cls.__name__ == "SparseSoupMyArguments"
    args = cls(output_dir=str(tmp_path), my_field=3, hub_token="hf_user_token", target_sparsity=0.5, report_to="none")
    assert args.my_field == 3 and args.plan.structure.name == "unstructured"
    torch.save(args, tmp_path / "training_args.bin")  # what Trainer writes into every checkpoint
    assert b"hf_user_token" not in (tmp_path / "training_args.bin").read_bytes()


def _translation_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    model_dir = tmp_path / "tiny-t5"
    make_t5().save_pretrained(model_dir)
    ByT5Tokenizer().save_pretrained(model_dir)
    pairs = [("one", "unu"), ("two", "doi"), ("three", "trei"), ("four", "patru"), ("five", "cinci"), ("six", "sase")]
    lines = [json.dumps({"translation": {"en": f"copy {en}", "ro": ro}}) for en, ro in pairs * 6]
    (tmp_path / "train.json").write_text("\n".join(lines))
    (tmp_path / "val.json").write_text("\n".join(lines[:8]))
    return model_dir, tmp_path / "train.json", tmp_path / "val.json"


def test_run_translation_with_two_changed_imports_prunes_trains_and_scores_bleu(tmp_path):
    """transformers' run_translation.py pattern with SparseSoupSeq2SeqTrainer: predict_with_generate BLEU, the
    masks exact after training, the script's defaults (checkpoints, clipping) its own, the card hf-sms's."""
    model_dir, train, val = _translation_files(tmp_path)
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--model_name_or_path", str(model_dir), "--train_file", str(train),
           "--validation_file", str(val), "--output_dir", str(out), "--max_steps", "6", "--save_steps", "3",
           "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--predict_with_generate",
           "--generation_max_length", "16", "--generation_num_beams", "2", "--learning_rate", "1e-2",
           "--target_sparsity", "0.5", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "script_results.json").read_text())
    assert "eval_bleu" in results["eval"] and results["eval"]["eval_bleu"] >= 0.0  # generated, then scored
    args = results["args"]
    assert args["save_strategy"] == "steps" and args["max_grad_norm"] == 1.0  # the user's defaults
    assert args["generation_num_beams"] == 2 and args["predict_with_generate"] is True
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    # the final save is hf-sms's: half of every prunable weight exactly zero, loadable with and without hf-sms
    info = json.loads((out / "sparsity.json").read_text())
    assert info["sparsity"] == pytest.approx(0.5, abs=0.01)
    model = hf_sms.load_sparse(str(out))  # refuses weights off the stored masks
    assert hf_sms.sparsity_report(model)["sparsity"] == pytest.approx(0.5, abs=0.01)
    assert (out / "README.md").read_text().lstrip().startswith("---") and "hf-sms" in (out / "README.md").read_text()
    state = load_file(out / "checkpoint-6" / "model.safetensors")  # a Trainer checkpoint: the same zeros
    name = "encoder.block.0.layer.1.DenseReluDense.wi.weight"
    pruned = dict(model.named_parameters())[name].detach() == 0
    assert pruned.any() and bool((state[name][pruned] == 0).all())


def test_seq2seq_trainer_in_process_keeps_masks_through_every_step(tmp_path, byt5_tokenizer):
    """The mixin's hooks run inside Seq2SeqTrainer: after each step the pruned weights are exactly zero."""
    from transformers import DataCollatorForSeq2Seq

    model = make_t5()
    items = [byt5_tokenizer(f"copy {i}", text_target=str(i)) for i in range(16)]
    args = SparseSoupSeq2SeqConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                   target_sparsity=0.7, use_cpu=True, report_to="none", save_strategy="no",
                                   learning_rate=0.05, disable_tqdm=True)  # fmt: skip
    trainer = SparseSoupSeq2SeqTrainer(model=model, args=args, train_dataset=items,
                                       data_collator=DataCollatorForSeq2Seq(byt5_tokenizer, model=model))  # fmt: skip
    masks = {k: v.clone() for k, v in trainer.masks.items()}
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    params = dict(model.named_parameters())
    assert masks and all(bool((params[k].detach()[~m] == 0).all()) for k, m in masks.items())
    assert any(not torch.equal(before[k], params[k].detach()) for k in masks)  # it trained


def test_trl_sft_trainer_composes_with_the_mixin(tmp_path):
    trl = pytest.importorskip("trl")  # an optional extra: hf-sms[trl]
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel

    class SparseSoupSFTTrainer(hf_sms.SparseSoupMixin, trl.SFTTrainer):
        pass

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=384, n_positions=64, n_embd=16, n_layer=1, n_head=2))
    tokenizer = ByT5Tokenizer()
    data = Dataset.from_list([{"text": f"copy {i} -> {i}"} for i in range(32)])
    args = sparse_config(trl.SFTConfig)(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                        target_sparsity=0.6, use_cpu=True, report_to="none", max_length=32,
                                        learning_rate=0.05, save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = SparseSoupSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    masks = {k: v.clone() for k, v in trainer.masks.items()}
    trainer.train()
    params = dict(model.named_parameters())
    assert masks and all(bool((params[k].detach()[~m] == 0).all()) for k, m in masks.items())
    assert hf_sms.sparsity_report(model)["sparsity"] == pytest.approx(0.6, abs=0.02)
