"""Which weights are prunable, and in which order the model's layers use them (docs/method.md §2).

A weight is prunable if a linear, convolution, embedding or attention layer owns it (never biases or
normalisation parameters). Positions of use (module order, or call order on an example batch) let
allocations such as uniform+ find "the first conv" and "the last linear".
"""

from __future__ import annotations

import inspect
import itertools
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..batchnorm import forward_batch

Masks = dict[str, torch.Tensor]

# Module type -> (kind, weight attributes). Only these weights are prunable: biases and normalisation
# parameters never are. nn.MultiheadAttention packs q/k/v into ``in_proj_weight``, or keeps three matrices
# when kdim/vdim != embed_dim (unused slots are None); its out_proj is an nn.Linear subclass, found as such.
# nn.TransformerEncoderLayer/DecoderLayer are built from these, so they are covered too.
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
_WEIGHTS_BY_TYPE: list[tuple[type | tuple[type, ...], str, tuple[str, ...]]] = [
    (_CONV, "conv", ("weight",)),
    (nn.Linear, "linear", ("weight",)),
    (nn.Embedding, "embedding", ("weight",)),
    (nn.MultiheadAttention, "linear", _MHA_WEIGHTS),
]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2 style Conv1D: a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _kind_and_attributes(module: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    for types, kind, attributes in _WEIGHTS_BY_TYPE:
        if isinstance(module, types):
            return kind, attributes
    # transformers' GPT-2 style Conv1D is a linear layer with a transposed weight.
    if is_conv1d(module):
        return "linear", ("weight",)
    return None


def _layer_weights(module: nn.Module) -> tuple[str, list[nn.Parameter]] | None:
    """``(kind, prunable weights)`` that ``module`` itself holds, or None if it is not a prunable layer."""
    entry = _kind_and_attributes(module)
    if entry is None:
        return None
    kind, attributes = entry
    weights = [getattr(module, a, None) for a in attributes]
    return kind, [w for w in weights if isinstance(w, nn.Parameter) and w.is_floating_point()]


Use = tuple[int, str]  # (position in the forward or in module order, kind of the layer using the weight)


@dataclass(frozen=True)
class PrunableTensor:
    """A prunable weight, named as in ``model.named_parameters()``.

    ``kind`` is the layer type it was first found in; ``uses`` lists every layer that uses it as
    ``(position, kind)``, so a tied weight such as T5's ``shared.weight`` (an Embedding, and the
    weight of the lm_head Linear) shows both uses. Positions follow module registration order, or
    call order when masks are computed with ``example_inputs``.
    """

    name: str
    param: nn.Parameter
    kind: str  # "conv" | "linear" | "embedding"
    uses: tuple[Use, ...] = ()
    # Conv layout, so filter (structured) allocations find each output filter: ConvTranspose weights are
    # (in, out / groups, *k), other conv weights (out, in / groups, *k). For linear layers: Conv1D's (in, out).
    transposed: bool = False
    groups: int = 1


def _registration_uses(model: nn.Module) -> dict[int, list[Use]]:
    """``{id(weight): uses}`` with positions in ``model.modules()`` order; a tied weight has one use per layer."""
    uses: dict[int, list[Use]] = defaultdict(list)
    for position, module in enumerate(model.modules()):
        entry = _layer_weights(module)
        for weight in entry[1] if entry else ():
            uses[id(weight)].append((position, entry[0]))
    return uses


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model``, tied ones counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def check_weights_loaded(model: nn.Module) -> None:
    """Raise, with the reason, where ``model`` has parameters on the meta device (built without weights)."""
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device (e.g. {meta[:3]}): built without weights "
            "(init_empty_weights, device_map='meta'); load its weights first, e.g. with from_pretrained"
        )


def prunable_tensors(model: nn.Module) -> list[PrunableTensor]:
    """The prunable weights of ``model`` in module order, tied weights counted once.

    Works for transformers, timm, segmentation_models_pytorch and plain ``nn.Module``s: the decision
    is made on layer types (``_WEIGHTS_BY_TYPE``), so any model built from torch's layers is covered,
    attention included.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # de-duplicates tied parameters
    uses = _registration_uses(model)
    seen: set[int] = set()
    out = []
    for module in model.modules():
        entry = _layer_weights(module)
        for weight in entry[1] if entry else ():
            if id(weight) in seen or id(weight) not in names or ".lora_" in names[id(weight)]:
                continue  # peft's LoRA factors are adapters, not weights of the model
            seen.add(id(weight))
            layout = (bool(module.transposed), int(module.groups)) if entry[0] == "conv" else (is_conv1d(module), 1)
            out.append(PrunableTensor(names[id(weight)], weight, entry[0], tuple(uses[id(weight)]), *layout))
    return out


def filter_index(shape: torch.Size | tuple[int, ...], transposed: bool = False, groups: int = 1) -> torch.Tensor:
    """The output channel (filter) of every entry of a conv weight of ``shape``, shaped to broadcast over it.

    Filter ``o`` of a Conv is ``weight[o]``; of a ConvTranspose with ``g`` groups it is ``weight[i, j]`` for the
    input channels ``i`` of group ``o // (out / g)`` and ``j = o % (out / g)`` (Li et al. 2017 prune such filters).
    """
    d0, d1 = shape[0], shape[1]
    if transposed:
        per_group_in = d0 // groups
        index = (torch.arange(d0) // per_group_in * d1).view(d0, 1) + torch.arange(d1).view(1, d1)
    else:
        index = torch.arange(d0).view(d0, 1).expand(d0, d1)
    return index.reshape(d0, d1, *[1] * (len(shape) - 2))


def n_filters(shape: torch.Size | tuple[int, ...], transposed: bool = False, groups: int = 1) -> int:
    """How many output filters a conv weight of ``shape`` has."""
    return shape[1] * groups if transposed else shape[0]


def per_filter_sum(values: torch.Tensor, transposed: bool = False, groups: int = 1) -> torch.Tensor:
    """``values`` (shaped like a conv weight) summed over each output filter: one entry per filter."""
    index = filter_index(values.shape, transposed, groups).to(values.device).expand_as(values)
    out = torch.zeros(n_filters(values.shape, transposed, groups), dtype=values.dtype, device=values.device)
    return out.index_add_(0, index.reshape(-1), values.reshape(-1))


@contextmanager
def unfused_attention():
    """Turn off torch's fused attention fast path, so every matmul and layer call is visible.

    In eval mode without gradients nn.MultiheadAttention and nn.TransformerEncoderLayer run one fused
    kernel that neither calls their Linear submodules nor shows its matmuls to a dispatch mode.
    """
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


@contextmanager
def train_forward(model: nn.Module):
    """``model`` in train mode with its dropout modules off, for one forward whose effects are undone: buffers
    (BatchNorm statistics), modes and the random state are restored; draws inside (stochastic depth) start from
    seed 0, so two models of the same shapes draw alike."""
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    was_training = model.training
    model.train()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()
    device = next(model.parameters()).device
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            yield
    finally:
        model.train(was_training)
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(saved[n])


def accepts_labels(model: nn.Module) -> bool:
    # Seq2seq models derive their decoder inputs from labels, so they must get them when they take them.
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@torch.no_grad()
def call_order_uses(model: nn.Module, example_inputs) -> dict[int, list[Use]]:
    """``{id(weight): uses}`` with positions in the order layers are called on ``example_inputs``.

    ``example_inputs`` is a batch as :func:`hf_sms.batchnorm.forward_batch` takes it (a dict such as
    ``{"x": ...}`` or ``{"input_ids": ..., "labels": ...}``, or a tensor). The forward runs in eval mode
    without gradients; the training mode is restored. A weight whose layer is never called, like
    MHA's out_proj (MHA reads its weight without calling it), gets no use.
    """
    uses: dict[int, list[Use]] = defaultdict(list)
    calls = itertools.count()

    def record(module, args):
        kind, weights = _layer_weights(module)
        position = next(calls)
        for weight in weights:
            uses[id(weight)].append((position, kind))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if _layer_weights(m)]
    was_training = model.training
    model.eval()
    try:
        with unfused_attention():
            device = next(model.parameters()).device
            forward_batch(model, example_inputs, device, keep_labels=accepts_labels(model))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return uses


def first_use(tensors: list[PrunableTensor], kind: str) -> PrunableTensor | None:
    """The tensor that a layer of ``kind`` uses first (e.g. the first conv), None if no layer of that kind."""
    found = [(position, i) for i, t in enumerate(tensors) for position, k in t.uses if k == kind]
    return tensors[min(found)[1]] if found else None


def last_use(tensors: list[PrunableTensor], kind: str) -> PrunableTensor | None:
    """The tensor that a layer of ``kind`` uses last: a tied lm_head makes its embedding the last linear."""
    found = [(position, i) for i, t in enumerate(tensors) for position, k in t.uses if k == kind]
    return tensors[max(found)[1]] if found else None
