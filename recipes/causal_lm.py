"""Sparse Model Soups for a causal language model (LLaMA family), perplexity on held-out text.

# a LLaMA-family model from the Hub, WikiText-2, three MaskLoRA replicas per phase (docs/recipes/causal_lm.md)
accelerate launch recipes/causal_lm.py --config recipes/configs/llama_wikitext2.yaml
# 3 GPUs: the 3 replicas of each phase train at once; they exchange adapters, not models
accelerate launch --num_processes 3 recipes/causal_lm.py --config recipes/configs/llama_wikitext2.yaml
# local JSON-lines files {"text": ...}
python recipes/causal_lm.py --output_dir out --train_file train.jsonl --validation_file dev.jsonl --test_file test.jsonl
# a 2-layer LLaMA over bytes and generated text, end to end on CPU in seconds
python recipes/causal_lm.py --smoke --output_dir smoke --replica_params mask_lora

Text is tokenized and cut into blocks of ``block_size`` tokens (as transformers' run_clm.py does); the metric is
perplexity on the validation split (negated: soups are picked by a higher-is-better metric) and reported on test.
``--replica_params mask_lora`` (or ``bias_norm``, ``scale_lora``) trains a few parameters per replica: a model whose
full replicas do not fit a GPU m times over (docs/replicas.md).
"""

import os
from dataclasses import dataclass, field
from itertools import chain

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

from hf_sms import SparseModelSoup, SparseSoupConfig
from hf_sms.cli.scripts import DataArguments, finish, load_splits, parse_args, prepared_splits, public_weights_note
from hf_sms.cli.smoke import smoke_text
from hf_sms.evaluation import NegativePerplexity

DATA_DEFAULTS = dict(
    dataset_name="Salesforce/wikitext",
    dataset_config="wikitext-2-raw-v1",
    validation_split="validation",
    test_split="test",
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="meta-llama/Llama-3.2-1B", metadata={"help": "Dense model to prune."})
    text_column: str = field(default="text", metadata={"help": "Column of the raw text."})
    block_size: int = field(default=512, metadata={"help": "Tokens per training and evaluation sequence."})
    torch_dtype: str = field(default="auto", metadata={"help": "dtype the weights load in (auto, bfloat16, ...)."})


def smoke(folder: str) -> dict:
    """--smoke: a 2-layer LLaMA (hidden 32) over ByT5's bytes, saved as a local model, and generated text."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer, path = ByT5Tokenizer(), os.path.join(folder, "llama")
    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    ids = dict(pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size + 3, **sizes, **ids)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"model_name_or_path": path, "block_size": 32, "torch_dtype": "float32", **smoke_text(folder)}


def main(model_args: ModelArguments, data_args: DataArguments, args: SparseSoupConfig):
    data_args = data_args.with_defaults(**DATA_DEFAULTS)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, dtype=model_args.torch_dtype, trust_remote_code=False
    )
    raw = load_splits(data_args)
    column, block = model_args.text_column, model_args.block_size

    def blocks(batch):  # concatenate the texts, cut into blocks; the labels are the inputs (the model shifts them)
        ids = tokenizer(batch[column])["input_ids"]
        flat = list(chain.from_iterable(ids))
        n = len(flat) // block * block
        chunks = [flat[i : i + block] for i in range(0, n, block)]
        return {"input_ids": chunks, "attention_mask": [[1] * block for _ in chunks], "labels": chunks}

    def prepare(data, training):
        return data.map(blocks, batched=True, remove_columns=data.column_names)

    train, val, test = prepared_splits(raw, prepare, args, data_args)
    public = not os.path.isdir(model_args.model_name_or_path)
    notes = {"notes": [public_weights_note(model_args.model_name_or_path)]} if public else {}
    runner = SparseModelSoup(
        model,
        args,
        train,
        NegativePerplexity(collate_fn=default_data_collator),
        eval_dataset=val,
        test_dataset=test,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        model_card={"base_model": model_args.model_name_or_path, "datasets": data_args.hub_datasets, **notes},
    )
    runner.run()
    finish(runner)
    return runner


if __name__ == "__main__":
    main(*parse_args(ModelArguments, DataArguments, SparseSoupConfig, smoke=smoke))
