"""Sparse Model Soups for T5 on WMT16 translation (the paper's NLP setting), BLEU with sacrebleu.

# one GPU, the paper's setting from YAML (flags override it)
accelerate launch recipes/t5_wmt16.py --config recipes/configs/t5_wmt16.yaml
# 3 GPUs: the 3 replicas of each phase train at once
accelerate launch --num_processes 3 recipes/t5_wmt16.py --config recipes/configs/t5_wmt16.yaml
# local JSON-lines files {"translation": {"en": ..., "ro": ...}} instead of the Hub
python recipes/t5_wmt16.py --output_dir out --train_file train.jsonl --validation_file dev.jsonl --test_file test.jsonl

Soups are selected on the dataset's own validation split (WMT16's newstest dev set, `--validation_file`
locally) and BLEU is reported on its test split. Without one, `validation_fraction` of train is split off.
"""

from dataclasses import dataclass, field

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq

from hf_sms import SparseModelSoup, SparseSoupConfig
from hf_sms.evaluation import BleuMetric
from hf_sms.scripts import finish, parse_args, prepared_splits


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="google-t5/t5-small", metadata={"help": "Dense model to prune."})
    dataset_name: str = field(default="wmt16", metadata={"help": "Hub dataset with a `translation` column."})
    dataset_config: str = field(default="ro-en")
    train_file: str | None = field(default=None, metadata={"help": "Local JSON lines instead of the Hub."})
    validation_file: str | None = field(default=None, metadata={"help": "Local JSON lines for validation."})
    test_file: str | None = field(default=None, metadata={"help": "Local JSON lines for the test split."})
    validation_split: str = field(
        default="validation", metadata={"help": "Split used for soup selection; if missing, part of train is."}
    )
    source_lang: str = "en"
    target_lang: str = "ro"
    source_prefix: str = "translate English to Romanian: "
    max_source_length: int = 128
    max_target_length: int = 128
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    max_test_samples: int | None = None
    num_beams: int = 1


def load_translation(script_args: ScriptArguments):
    import datasets

    if script_args.train_file:
        files = {"train": script_args.train_file}
        if script_args.validation_file:
            files[script_args.validation_split] = script_args.validation_file
        if script_args.test_file:
            files["test"] = script_args.test_file
        return datasets.load_dataset("json", data_files=files)
    return datasets.load_dataset(script_args.dataset_name, script_args.dataset_config)


def main(script_args: ScriptArguments, args: SparseSoupConfig):
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(script_args.model_name_or_path)
    raw = load_translation(script_args)

    def tokenize(batch):
        pairs = batch["translation"]
        sources = [script_args.source_prefix + p[script_args.source_lang] for p in pairs]
        enc = tokenizer(sources, max_length=script_args.max_source_length, truncation=True)
        targets = [p[script_args.target_lang] for p in pairs]
        enc["labels"] = tokenizer(text_target=targets, max_length=script_args.max_target_length, truncation=True)[
            "input_ids"
        ]
        return enc

    limits = {
        "train": script_args.max_train_samples,
        script_args.validation_split: script_args.max_eval_samples,
        "test": script_args.max_test_samples,
    }
    for split, limit in limits.items():
        if split in raw and limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))

    def prepare(data, training):  # no augmentation: both sides are tokenized alike
        return data.map(tokenize, batched=True, remove_columns=data.column_names)

    train, val, test = prepared_splits(raw, prepare, args, "test", script_args.validation_split)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    bleu = BleuMetric(tokenizer, script_args.max_target_length, script_args.num_beams, collate_fn=collator)
    runner = SparseModelSoup(
        model,
        args,
        train,
        bleu,
        eval_dataset=val,
        test_dataset=test,
        data_collator=collator,
        processing_class=tokenizer,
        model_card={"base_model": script_args.model_name_or_path, "datasets": [script_args.dataset_name]},
    )
    runner.run()
    finish(runner)
    return runner


if __name__ == "__main__":
    main(*parse_args(ScriptArguments, SparseSoupConfig))
