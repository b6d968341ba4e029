"""transformers' examples/pytorch/translation/run_translation.py, cut to its skeleton, with hf-sms in it.

The whole change to the user's script is the two imports marked "hf-sms" below (docs/trainer.md). Everything else
is the example's pattern: its argument dataclasses, HfArgumentParser, datasets' json loader, the tokenizer's
text_target, DataCollatorForSeq2Seq, BLEU from generated text (sacrebleu; the example loads it through evaluate,
which needs the Hub), trainer.train / evaluate / save_model / create_model_card.
"""

import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import sacrebleu
from datasets import load_dataset
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, HfArgumentParser

from hf_sms import SparseSoupSeq2SeqConfig as Seq2SeqTrainingArguments  # hf-sms
from hf_sms import SparseSoupSeq2SeqTrainer as Seq2SeqTrainer  # hf-sms


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to pretrained model or model identifier."})


@dataclass
class DataTrainingArguments:
    source_lang: str = field(default="en")
    target_lang: str = field(default="ro")
    train_file: str | None = field(default=None)
    validation_file: str | None = field(default=None)
    max_source_length: int = field(default=64)
    max_target_length: int = field(default=64)
    source_prefix: str = field(default="")


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    raw = load_dataset("json", data_files={"train": data_args.train_file, "validation": data_args.validation_file})
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)

    def preprocess_function(examples):
        inputs = [data_args.source_prefix + ex[data_args.source_lang] for ex in examples["translation"]]
        targets = [ex[data_args.target_lang] for ex in examples["translation"]]
        model_inputs = tokenizer(inputs, max_length=data_args.max_source_length, truncation=True)
        labels = tokenizer(text_target=targets, max_length=data_args.max_target_length, truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    train_dataset = raw["train"].map(preprocess_function, batched=True, remove_columns=["translation"])
    eval_dataset = raw["validation"].map(preprocess_function, batched=True, remove_columns=["translation"])
    data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        decoded_preds = tokenizer.batch_decode(preds, skip_special_tokens=True)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)
        return {"bleu": sacrebleu.corpus_bleu(decoded_preds, [decoded_labels]).score}

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.predict_with_generate else None,
    )
    train_result = trainer.train()
    trainer.save_model()
    metrics = trainer.evaluate(max_length=data_args.max_target_length, num_beams=training_args.generation_num_beams)
    trainer.create_model_card(model_name="tiny-t5-sms", language="en")
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "script_results.json"), "w") as f:
            json.dump({"train": train_result.metrics, "eval": metrics, "args": training_args.to_dict()}, f)


if __name__ == "__main__":
    sys.exit(main())
