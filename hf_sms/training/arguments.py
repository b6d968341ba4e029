"""The hf-sms fields in any Trainer's arguments class, its defaults kept: :class:`SparseSoupSeq2SeqConfig`
(Seq2SeqTrainingArguments) and :func:`sparse_config` for any other (trl's ``SFTConfig``); :func:`as_sparse_arguments`
converts a user's arguments value for value (docs/trainer.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from ..registry import REPLICA_PARAMS
from .config import SparseSoupArguments, SparseSoupConfig


@dataclass(kw_only=True, repr=False)
class SparseSoupSeq2SeqConfig(SparseSoupArguments, Seq2SeqTrainingArguments):
    """Seq2SeqTrainingArguments (``predict_with_generate``, ``generation_max_length``, ...) plus
    :class:`SparseSoupArguments`, every Seq2SeqTrainingArguments default as it is: the arguments of
    :class:`hf_sms.SparseSoupSeq2SeqTrainer`."""


_COMPOSED = {TrainingArguments: SparseSoupConfig, Seq2SeqTrainingArguments: SparseSoupSeq2SeqConfig}


def sparse_config(cls: type) -> type:
    """The arguments class of ``cls`` (a TrainingArguments subclass, e.g. trl's ``SFTConfig``) with the hf-sms fields
    mixed in and every default of ``cls`` kept; ``SparseSoupConfig`` for TrainingArguments itself. Use it in
    ``HfArgumentParser`` and with a trainer built from :class:`hf_sms.SparseSoupMixin`."""
    if issubclass(cls, SparseSoupArguments):
        return cls
    if not (isinstance(cls, type) and issubclass(cls, TrainingArguments)):
        raise TypeError(f"sparse_config takes a TrainingArguments subclass, got {cls!r}")
    if cls not in _COMPOSED:
        name = f"SparseSoup{cls.__name__}"
        composed = dataclass(kw_only=True, repr=False)(
            type(
                name,
                (SparseSoupArguments, cls),
                {
                    "__module__": __name__,
                    "__qualname__": name,
                    "__doc__": f"{cls.__name__} plus :class:`SparseSoupArguments`, every default of {cls.__name__} "
                    "as it is.",
                },
            )
        )
        globals()[name] = _COMPOSED[cls] = composed  # importable by name: the args pickle (training_args.bin)
    return _COMPOSED[cls]


def as_sparse_arguments(args, base: type = TrainingArguments):
    """``args`` with the hf-sms fields and those of ``base`` (a trainer's arguments class): itself if it has both,
    else the same values in :func:`sparse_config` of its class, or of ``base`` when it lacks ``base``'s fields (a
    ``SparseSoupConfig`` given to :class:`~hf_sms.SparseSoupSeq2SeqTrainer`); fields the target lacks are dropped."""
    if isinstance(args, SparseSoupArguments) and isinstance(args, base):
        return args
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be TrainingArguments (or a subclass), got {type(args).__name__}")
    target = sparse_config(type(args) if isinstance(args, base) else base)
    names = {f.name for f in dataclasses.fields(target) if f.init}
    values = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name in names and hasattr(args, f.name)
    }
    return target(**values)


def departures(args, model=None) -> list[str]:
    """Where ``args`` retrain differently from the paper's settings (SparseSoupConfig's defaults): an arguments
    class's own defaults (Seq2SeqTrainingArguments, trl's SFTConfig) clip gradients and exempt biases and norms from
    decay; replicas that train a subset (``replica_params``); with ``model``, weights its plan leaves dense (a causal
    LM's embeddings and lm_head). The SMS loop says these in its log, results.json and the model card's notes."""
    out = []
    plan = getattr(args, "plan", None)
    if model is not None and plan is not None and plan.modules.default_note(model):
        out.append(plan.modules.default_note(model))
    kind = getattr(args, "replica_params", "all")
    if kind != "all":  # the baselines train it too, so the rows compare like with like
        baselines = list(getattr(args, "baselines", None) or ())
        who = f"every replica and the baselines {', '.join(baselines)} retrain" if baselines else None
        who = who or "every replica retrains"
        out.append(
            f"{who} {REPLICA_PARAMS.get(kind).description}, the rest of the model frozen "
            f"(replica_params={kind!r}; the paper retrains every parameter)"
        )
    optim = str(getattr(args, "optim", "sgd")).split(".")[-1].lower()
    if "sgd" not in optim:
        out.append(f"replicas retrain with {optim} (optim; the paper retrains with SGD, momentum 0.9)")
    else:  # transformers' SGD takes its momentum from optim_args only: 0 where they name none
        given = dict(
            kv.split("=", 1)
            for kv in str(getattr(args, "optim_args", None) or "").replace(" ", "").split(",")
            if "=" in kv
        )
        momentum = float(given.get("momentum", 0))
        if momentum != 0.9:
            out.append(
                f"replicas retrain with SGD at momentum {momentum:g} (optim_args; the paper's is 0.9: "
                "optim_args='momentum=0.9')"
            )
    decays = [args.weight_decay, *(getattr(args, "replica_weight_decays", None) or ())]
    if not any(d > 0 for d in decays):
        out.append("no weight decay (weight_decay=0; the paper retrains with its pretraining's, e.g. 1e-4 or 5e-4)")
    if (getattr(args, "max_grad_norm", 0) or 0) > 0:
        out.append(f"gradients are clipped at norm {args.max_grad_norm:g} (max_grad_norm; the paper does not clip)")
    if not getattr(args, "decay_all_parameters", True) and any(d > 0 for d in decays):
        out.append(
            "biases and norm weights are exempt from weight decay (decay_all_parameters=False; the paper decays "
            "every parameter)"
        )
    if "learned" in (getattr(args, "merge_methods", None) or ()):
        fraction = (getattr(args, "soup_options", None) or {}).get("learned", {}).get("fraction", 0.5)
        out.append(
            f"the learned soup fits on {fraction:g} of the validation set, split off: every method's validation "
            "scores (greedy's choices, the candidates') use the rest"
        )
    return out
