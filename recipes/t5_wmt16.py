"""Sparse Model Soups for T5 on WMT16 translation (the paper's NLP setting), BLEU with sacrebleu.

# one GPU, the paper's setting from YAML (flags override it)
accelerate launch recipes/t5_wmt16.py --config recipes/configs/t5_wmt16.yaml
# 3 GPUs: the 3 replicas of each phase train at once
accelerate launch --num_processes 3 recipes/t5_wmt16.py --config recipes/configs/t5_wmt16.yaml
# local JSON-lines files {"translation": {"en": ..., "de": ...}} instead of the Hub
python recipes/t5_wmt16.py --output_dir out --train_file train.jsonl --validation_file dev.jsonl --test_file test.jsonl
# a 1+1-layer T5 over bytes and 40 sentence pairs, end to end on CPU in seconds
python recipes/t5_wmt16.py --smoke --output_dir smoke

WMT16 EN-DE as in the paper. Soups are selected on `validation_fraction` (10%) of the training data, split off
with a fixed seed, as the paper does (`--validation_split validation` selects on newstest2015 instead, or
`--validation_file` locally); BLEU is reported on the test split (newstest2016).
The data fields (`hf_sms.cli.scripts.DataArguments`) are shared by all recipes; `DATA_DEFAULTS` fills those left unset.
"""

import os
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

from hf_sms import SparseModelSoup, SparseSoupConfig, SparseSoupSeq2SeqTrainer
from hf_sms.cli.scripts import DataArguments, finish, load_splits, parse_args, prepared_splits, public_weights_note
from hf_sms.cli.smoke import smoke_translation
from hf_sms.evaluation import BleuMetric

# The paper's WMT16 EN-DE; soups are selected on 10% of the training data (validation_fraction), as the paper does.
DATA_DEFAULTS = dict(dataset_name="wmt16", dataset_config="de-en", test_split="test")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="google-t5/t5-small", metadata={"help": "Dense model to prune."})
    source_lang: str = field(default="en", metadata={"help": "Key of the source text in `translation`."})
    target_lang: str = field(default="de", metadata={"help": "Key of the target text in `translation`."})
    source_prefix: str = field(default="translate English to German: ", metadata={"help": "T5's task prefix."})
    max_source_length: int = 128
    max_target_length: int = 128


@dataclass(kw_only=True, repr=False)
class T5SoupConfig(SparseSoupConfig, Seq2SeqTrainingArguments):
    """The SMS run's config (the paper's defaults) with Seq2SeqTrainingArguments' generation fields: BLEU generates
    with ``generation_num_beams`` and ``generation_max_length`` (default: 1 beam, ``max_target_length``)."""


def smoke(folder: str) -> dict:
    """--smoke: a 1+1-layer T5 (d_model 16) over ByT5's bytes, saved as a local model, and JSON-lines pairs."""
    from transformers import ByT5Tokenizer, T5Config, T5ForConditionalGeneration

    tokenizer, path = ByT5Tokenizer(), os.path.join(folder, "t5")
    ids = {"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
    config = T5Config(vocab_size=tokenizer.vocab_size, d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=1, **ids)
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"model_name_or_path": path, "max_source_length": 32, "max_target_length": 8, **smoke_translation(folder)}


def main(model_args: ModelArguments, data_args: DataArguments, args: T5SoupConfig):
    data_args = data_args.with_defaults(**DATA_DEFAULTS)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=False)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path, trust_remote_code=False)
    raw = load_splits(data_args)

    def tokenize(batch):
        pairs = batch["translation"]
        sources = [model_args.source_prefix + p[model_args.source_lang] for p in pairs]
        enc = tokenizer(sources, max_length=model_args.max_source_length, truncation=True)
        targets = [p[model_args.target_lang] for p in pairs]
        enc["labels"] = tokenizer(text_target=targets, max_length=model_args.max_target_length, truncation=True)[
            "input_ids"
        ]
        return enc

    def prepare(data, training):  # no augmentation: both sides are tokenized alike
        return data.map(tokenize, batched=True, remove_columns=data.column_names)

    train, val, test = prepared_splits(raw, prepare, args, data_args)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    public = not os.path.isdir(model_args.model_name_or_path)  # a Hub id: public weights, e.g. t5-small
    notes = {"notes": [public_weights_note(model_args.model_name_or_path)]} if public else {}
    length = getattr(args, "generation_max_length", None) or model_args.max_target_length  # any config works
    beams = getattr(args, "generation_num_beams", None) or 1
    bleu = BleuMetric(tokenizer, length, beams, collate_fn=collator)
    runner = SparseModelSoup(
        model,
        args,
        train,
        bleu,
        eval_dataset=val,
        test_dataset=test,
        data_collator=collator,
        processing_class=tokenizer,
        trainer_class=SparseSoupSeq2SeqTrainer,  # replicas train with Seq2SeqTrainer and its generation settings
        model_card={"base_model": model_args.model_name_or_path, "datasets": data_args.hub_datasets, **notes},
    )
    runner.run()
    finish(runner)
    return runner


if __name__ == "__main__":
    main(*parse_args(ModelArguments, DataArguments, T5SoupConfig, smoke=smoke))
