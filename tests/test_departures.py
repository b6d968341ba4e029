"""An SMS run whose arguments retrain differently from the paper (an arguments class's own defaults: gradient
clipping, biases and norms exempt from decay) says so in its log, results.json and the model card (issue 37 item 3);
a run with the paper's settings says nothing."""

import json
import logging

import torch
from conftest import sms_config

from hf_sms import SparseSoupSeq2SeqConfig, run_sms
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.training.arguments import departures


def test_departures_name_what_differs_from_the_paper(tmp_path):
    paper = "momentum=0.9"  # transformers' SGD has momentum 0 unless optim_args name it
    assert departures(sms_config(tmp_path, weight_decay=1e-4, optim_args=paper)) == []  # SGD, decay everywhere
    said = departures(sms_config(tmp_path, weight_decay=1e-4))  # SGD without momentum: said (issue 54 item 7)
    assert said == [
        "replicas retrain with SGD at momentum 0 (optim_args; the paper's is 0.9: optim_args='momentum=0.9')"
    ]
    said = departures(sms_config(tmp_path, optim="adamw_torch"))  # AdamW and no decay: said
    assert len(said) == 2 and "adamw_torch" in said[0] and "no weight decay" in said[1]
    seq2seq = SparseSoupSeq2SeqConfig(output_dir=str(tmp_path), weight_decay=0.01, report_to="none", optim="sgd",
                                      optim_args=paper)  # fmt: skip
    said = departures(seq2seq)  # Seq2SeqTrainingArguments' own defaults: clip at 1.0, no decay on biases and norms
    assert len(said) == 2 and "clipped at norm 1" in said[0] and "exempt from weight decay" in said[1]
    plain = SparseSoupSeq2SeqConfig(output_dir=str(tmp_path), max_grad_norm=0, report_to="none", optim="sgd",
                                    weight_decay=1e-4, decay_all_parameters=True, optim_args=paper)  # fmt: skip
    assert departures(plain) == []
    said = departures(sms_config(tmp_path, replica_params="mask_lora", weight_decay=1e-4, baselines=["imp"],
                                 optim_args=paper))  # fmt: skip
    assert len(said) == 1 and "every replica and the baselines imp retrain MaskLoRA adapters" in said[0]
    said = departures(sms_config(tmp_path, replica_params="mask_lora", weight_decay=1e-4))  # no baseline: none named
    assert said[0].startswith("every replica retrains")


def test_a_run_says_its_departures_in_the_log_results_and_card(tmp_path, caplog):
    train, val, _ = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:64], train.labels[:64])
    args = sms_config(tmp_path, n_phases=1, max_steps=2, max_grad_norm=1.0, decay_all_parameters=False,
                      weight_decay=0.01, optim_args="momentum=0.9")  # fmt: skip
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="hf_sms"):
        run_sms(DigitsResNet(width=4), args, train, ClassificationAccuracy(), eval_dataset=val)
    notes = json.loads((tmp_path / "run" / "results.json").read_text())["notes"]
    assert notes == departures(args) and len(notes) == 2
    assert all(n in caplog.text for n in notes)
    card = (tmp_path / "run" / "final_soup" / "README.md").read_text()
    assert "## Notes" in card and "clipped at norm 1" in card and "exempt from weight decay" in card
