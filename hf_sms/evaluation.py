"""Metrics the SMS loop records: accuracy and the prediction ensemble."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader
from torch.utils.flop_counter import flop_registry
from transformers import PreTrainedModel, default_data_collator

from .batchnorm import forward_batch
from .prunable import prunable_tensors, unfused_attention

MetricFn = Callable[[nn.Module, object], float]


def _logits(outputs) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs


@torch.no_grad()
def predict_proba(
    model: nn.Module, dataset, batch_size: int = 256, collate_fn=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities and labels of a classifier over ``dataset`` (dicts with a ``labels`` key)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    probs, labels = [], []
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn or default_data_collator):
        probs.append(_logits(forward_batch(model, batch, device)).float().softmax(-1).cpu())
        labels.append(batch["labels"])
    model.train(was_training)
    return torch.cat(probs), torch.cat(labels)


class ClassificationAccuracy:
    """Top-1 accuracy in % as a metric for the SMS loop: ``metric(model, dataset) -> float``.

    It also defines ``predict(model, dataset)`` (softmax probabilities) and ``score(probs, dataset)``, which
    the loop uses for the prediction-ensemble diagnostic (docs/method.md §8); any metric object with those two
    methods gets the ensemble row.
    """

    def __init__(self, batch_size: int = 256, collate_fn=None):
        self.batch_size, self.collate_fn = batch_size, collate_fn

    def predict(self, model: nn.Module, dataset) -> torch.Tensor:
        return predict_proba(model, dataset, self.batch_size, self.collate_fn)[0]

    def score(self, probs: torch.Tensor, dataset) -> float:
        labels = torch.cat([b["labels"] for b in DataLoader(dataset, self.batch_size, collate_fn=self._collate)])
        return 100.0 * float((probs.argmax(-1) == labels).float().mean())

    def __call__(self, model: nn.Module, dataset) -> float:
        probs, labels = predict_proba(model, dataset, self.batch_size, self.collate_fn)
        return 100.0 * float((probs.argmax(-1) == labels).float().mean())

    @property
    def _collate(self):
        return self.collate_fn or default_data_collator


class BleuMetric:
    """Corpus BLEU (sacrebleu) of greedy or beam-search generations against ``labels`` (seq2seq models)."""

    def __init__(self, tokenizer, max_new_tokens: int = 128, num_beams: int = 1, batch_size: int = 64, collate_fn=None):
        self.tokenizer, self.max_new_tokens, self.num_beams = tokenizer, max_new_tokens, num_beams
        self.batch_size, self.collate_fn = batch_size, collate_fn or default_data_collator

    @torch.no_grad()
    def __call__(self, model: nn.Module, dataset) -> float:
        import sacrebleu

        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        hyps, refs = [], []
        for batch in DataLoader(dataset, self.batch_size, collate_fn=self.collate_fn):
            out = model.generate(
                input_ids=batch["input_ids"].to(device),
                attention_mask=batch["attention_mask"].to(device),
                max_new_tokens=self.max_new_tokens,
                num_beams=self.num_beams,
            )
            labels = batch["labels"].masked_fill(batch["labels"] == -100, self.tokenizer.pad_token_id)
            hyps += self.tokenizer.batch_decode(out, skip_special_tokens=True)
            refs += self.tokenizer.batch_decode(labels, skip_special_tokens=True)
        model.train(was_training)
        return float(sacrebleu.corpus_bleu([h.strip() for h in hyps], [[r.strip() for r in refs]]).score)


class MeanIoU:
    """Mean intersection over union in % for segmentation logits ``(N, C, H, W)`` vs ``labels`` ``(N, H, W)``.

    Pixels labelled ``ignore_index`` are skipped; classes absent from both prediction and labels are
    left out of the mean.
    """

    def __init__(self, num_classes: int, batch_size: int = 16, ignore_index: int = -100, collate_fn=None):
        self.num_classes, self.batch_size, self.ignore_index = num_classes, batch_size, ignore_index
        self.collate_fn = collate_fn or default_data_collator

    @torch.no_grad()
    def __call__(self, model: nn.Module, dataset) -> float:
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        confusion = torch.zeros(self.num_classes, self.num_classes, dtype=torch.long)
        for batch in DataLoader(dataset, self.batch_size, collate_fn=self.collate_fn):
            pred = _logits(forward_batch(model, batch, device)).argmax(1).cpu()
            labels = batch["labels"]
            keep = labels != self.ignore_index
            idx = labels[keep] * self.num_classes + pred[keep]
            confusion += torch.bincount(idx, minlength=self.num_classes**2).view(self.num_classes, -1)
        model.train(was_training)
        inter = confusion.diag().double()
        union = confusion.sum(0).double() + confusion.sum(1).double() - inter
        present = union > 0
        return 100.0 * float((inter[present] / union[present]).mean()) if present.any() else 0.0


# aten matmuls and convolutions -> argument positions of their two operands (addmm/baddbmm add a bias first).
_aten = torch.ops.aten
_OPERANDS = {
    _aten.mm: (0, 1),
    _aten.bmm: (0, 1),
    _aten.addmm: (1, 2),
    _aten.baddbmm: (1, 2),
    _aten.convolution: (0, 1),
    _aten._convolution: (0, 1),
}


class _WeightFlops(TorchDispatchMode):
    """Adds up dense and zero-skipping FLOPs of every matmul or convolution with a prunable weight operand.

    FLOPs come from torch's own formulas (``torch.utils.flop_counter.flop_registry``). An operand is a
    weight if it shares storage with one, so views such as ``weight.t()`` or MHA's q/k/v slices of
    ``in_proj_weight`` count, however the layer calls the op (Linear, GPT-2's Conv1D, MHA, ConvTranspose).
    """

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.dense, self.sparse = storages, 0.0, 0.0

    def _weight_operand(self, func, args) -> torch.Tensor | None:
        for i in _OPERANDS.get(getattr(func, "_overloadpacket", None), ()):
            if torch.is_tensor(args[i]) and args[i].untyped_storage().data_ptr() in self.storages:
                return args[i]
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        weight = self._weight_operand(func, args)
        if weight is not None:
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
            self.dense += flops
            # The operand itself, so a slice of a weight (MHA's q/k/v) counts its own zeros.
            self.sparse += flops * float(torch.count_nonzero(weight)) / weight.numel()
        return out


@torch.no_grad()
def theoretical_speedup(model: nn.Module, batch) -> float:
    """Dense FLOPs / FLOPs with zeros skipped, over conv and linear layers, on one batch (docs/method.md §8).

    Every matmul and convolution with a prunable weight as an operand counts, its sparse cost being
    ``flops * nnz / numel`` of that weight (ShrinkBench's convention, Blalock et al. 2020). Products of
    two activations (attention scores) are left out of both totals, as the paper counts conv and linear
    layers only.
    """
    storages = {t.param.untyped_storage().data_ptr() for t in prunable_tensors(model)}
    counter = _WeightFlops(storages)
    was_training = model.training
    model.eval()
    try:
        with unfused_attention(), counter:
            device = next(model.parameters()).device
            forward_batch(model, batch, device, keep_labels=isinstance(model, PreTrainedModel))
    finally:
        model.train(was_training)
    return counter.dense / counter.sparse if counter.sparse else float("inf")
