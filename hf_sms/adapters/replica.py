"""Replicas that train a subset of the pruned model (``SparseSoupArguments.replica_params``; docs/replicas.md).

A replica of a subset kind shares the frozen weights of the phase's start (the same storage: no copy, no gradient,
no optimizer state) and owns only what it trains: biases and normalization weights (``bias_norm``), or MaskLoRA /
ScaleLoRA adapters (``mask_lora``, ``scale_lora``, :mod:`hf_sms.adapters.lora`) injected with peft. Its *trained
state* (those tensors, a few MB) is what is saved, exchanged between processes and souped: a soup is the start plus
the weighted sum of the replicas' updates, added layer by layer (one dense update at a time, never m models), and
it has the start's zeros exactly.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..master_weights import HALF, MASTER, master_of
from ..pruning.prunable import prunable_tensors
from ..registry import REPLICA_PARAMS, SOUPS
from ..seeding import derive_seed
from ..soup.averaging import average_tensors
from .lora import LAYERS, gate_of, lora_config, oriented, row_blocks
from .merge import merge_adapters, plain_name

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ReplicaParams:
    """A kind of replica: which parameters train.

    Attributes:
        adapters: a peft LoRA kind (``"mask_lora"``, ``"scale_lora"``) injected into the start, or ``None``: train
            the start's own parameters that ``trains`` selects.
        trains: ``trains(name, param, module) -> bool`` for the start's parameters (``None``: all of them).
        description: what the results and the card say.
    """

    adapters: str | None = None
    trains: object = None
    description: str = ""

    @property
    def full(self) -> bool:
        return self.adapters is None and self.trains is None


def is_norm(module: nn.Module) -> bool:
    """Normalization layers of every library: torch's BatchNorm/LayerNorm/GroupNorm/InstanceNorm, and any class
    named ``*Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``, timm's ``LayerNorm2d``)."""
    torch_norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)
    return isinstance(module, torch_norms) or type(module).__name__.endswith(("Norm", "Norm2d"))


def _bias_or_norm(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    return name.rsplit(".", 1)[-1] == "bias" or is_norm(module)


def check_subset(config) -> None:
    """What a run with subset replicas needs, checked before any work."""
    if config.pruning_method != "imp":
        raise ValueError(
            f"subset replicas follow the masks of IMP's phases; pruning_method={config.pruning_method!r} moves masks "
            "while training (frozen weights cannot follow): use pruning_method='imp' or replica_params='all'"
        )
    linear = [m for m in config.merge_methods if SOUPS.get(m).weighted_mean]
    if linear != list(config.merge_methods):
        raise ValueError(
            f"merge_methods={config.merge_methods}: subset replicas are souped from their updates, which needs a "
            f"weighted mean under one mask; {sorted(set(config.merge_methods) - set(linear))} is not one (use uniform "
            "or greedy, or replica_params='all')"
        )
    reprunes = [b for b in config.baselines if b.startswith("imp_reprune")]
    if reprunes:
        raise ValueError(f"baselines: {reprunes} average replicas with different masks; leave them out with subsets")
    if isinstance(config.lora_rank, bool) or not isinstance(config.lora_rank, int) or config.lora_rank < 1:
        raise ValueError(f"lora_rank must be a positive integer, got {config.lora_rank!r}")
    if not 0 < config.lora_alpha < math.inf or not 0 <= config.lora_dropout < 1:
        raise ValueError(
            f"need a finite lora_alpha > 0 and 0 <= lora_dropout < 1, got {config.lora_alpha}, {config.lora_dropout}"
        )


REPLICA_PARAMS.add("all", ReplicaParams(description="every parameter (the paper's replicas)"))
REPLICA_PARAMS.add(
    "bias_norm",
    ReplicaParams(trains=_bias_or_norm, description="biases and normalization weights only (PERP)"),
    check=check_subset,
)
REPLICA_PARAMS.add(
    "mask_lora",
    ReplicaParams(adapters="mask_lora", description="MaskLoRA adapters W + M*(BA) on the prunable linears"),
    check=check_subset,
)
REPLICA_PARAMS.add(
    "scale_lora",
    ReplicaParams(adapters="scale_lora", description="ScaleLoRA adapters W*(1+BA) on the prunable linears"),
    check=check_subset,
)


def _norm(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    return is_norm(module)


for _kind, _what in (("mask_lora", "MaskLoRA adapters W + M*(BA)"), ("scale_lora", "ScaleLoRA adapters W*(1+BA)")):
    REPLICA_PARAMS.add(  # PERP's combinations: the adapters and the normalization layers' weights
        f"{_kind}_norms",
        ReplicaParams(adapters=_kind, trains=_norm, description=f"{_what} on the prunable linears and the norms"),
        check=check_subset,
    )
    REPLICA_PARAMS.add(  # PERP's default: the adapters, the biases and the norms
        f"{_kind}_bias_norm",
        ReplicaParams(
            adapters=_kind, trains=_bias_or_norm, description=f"{_what} on the prunable linears, biases and norms"
        ),
        check=check_subset,
    )


def kind_of(args) -> ReplicaParams:
    return REPLICA_PARAMS.get(getattr(args, "replica_params", "all"))


def lora_targets(model: nn.Module, plan=None) -> list[str]:
    """The default LoRA targets: every ``nn.Linear`` (and GPT-2's ``Conv1D``, a linear layer with its weight
    transposed) the run's ``plan`` prunes (every prunable one without a plan), as full module names."""
    modules = dict(model.named_modules())
    names = [t.name.rsplit(".", 1)[0] for t in (plan.tensors(model) if plan is not None else prunable_tensors(model))]
    return [n for n in dict.fromkeys(names) if isinstance(modules.get(n), (nn.Linear, Conv1D))]


def _module_of(model: nn.Module) -> dict[str, nn.Module]:
    """Each parameter's owning module, by the parameter's full name."""
    return {
        f"{m}.{p}" if m else p: mod for m, mod in model.named_modules() for p, _ in mod.named_parameters(recurse=False)
    }


def make_replica(start: nn.Module, args) -> nn.Module:
    """A replica of ``start`` that trains what ``args.replica_params`` says; ``"all"``: a full copy. A subset replica
    shares the storage of every frozen weight with ``start`` (never written: it has no gradient)."""
    kind = kind_of(args)
    if kind.full:
        return copy.deepcopy(start)
    owner = _module_of(start)
    frozen = {
        name: p
        for name, p in start.named_parameters(remove_duplicate=False)
        if kind.trains is None or not kind.trains(name, p, owner[name])
    }
    # new Parameter objects over the same storage: the start's own keep their requires_grad
    memo = {id(p): nn.Parameter(p.data, requires_grad=False) for p in frozen.values()}
    replica = copy.deepcopy(start, memo)
    replica.hf_sms_replica = True  # SparseSoupMixin trains it as it is (no replica of a replica)
    if kind.adapters is None:
        if len(frozen) == len(dict(start.named_parameters(remove_duplicate=False))):
            raise ValueError(
                f"replica_params={args.replica_params!r} trains nothing in {type(start).__name__}: it has no "
                f"parameter that kind selects ({kind.description}); use replica_params='mask_lora' or 'all'"
            )
        for name, p in replica.named_parameters():
            p.requires_grad_(name not in frozen)
        return replica
    targets = args.lora_target_modules or lora_targets(start, getattr(args, "plan", None))
    if not targets:
        raise ValueError(
            f"replica_params={args.replica_params!r} found no nn.Linear to adapt in {type(start).__name__} (LoRA "
            "adapts linear layers; convolutions are not): use replica_params='bias_norm', or name the layers with "
            "lora_target_modules"
        )
    config = lora_config(kind.adapters, args.lora_rank, args.lora_alpha, targets, args.lora_dropout)
    # A's random init from the replica's own stream: the same replica whatever ran before it in this process
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(getattr(args, "seed", 0), "lora"))
        replica = inject_adapter_in_model(config, replica)
    _check_adapted(start, replica, args)
    for name, p in replica.named_parameters():
        if ".lora_" in name:  # peft keeps adapters in the base's dtype: fp32 for the optimizer's sake
            if p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.float()
        elif plain_name(name) not in frozen:  # the norms a "_norms" kind trains too (peft froze them)
            p.requires_grad_(True)
    return replica


def _check_adapted(start: nn.Module, replica: nn.Module, args) -> None:
    """Refuse, before any training, adapted layers a soup cannot take: a layer peft adapts with its own LoRA (an
    embedding: no mask on its update), or one whose weight is tied to another (an lm_head tied to the embeddings:
    its update would have to move both)."""
    weights = dict(start.named_parameters(remove_duplicate=False))
    for name, layer in lora_layers(replica):
        if not isinstance(layer, tuple(LAYERS.values())):
            raise ValueError(
                f"lora_target_modules adapts {name} ({type(layer.get_base_layer()).__name__}), which "
                f"{args.replica_params} cannot adapt under a mask (it adapts linear layers): leave it out"
            )
        own = weights.get(f"{name}.weight")
        tied = [n for n, p in weights.items() if p is own and n != f"{name}.weight"] if own is not None else []
        if tied:
            raise ValueError(
                f"lora_target_modules adapts {name}, whose weight is tied to {tied}: a soup of its adapters would "
                "have to move both; leave it out (or untie the weights)"
            )


def trained_state(replica: nn.Module) -> State:
    """What a subset replica trained: ``{name: tensor}`` of its trainable parameters (detached, this device)."""
    return {n: master_of(p).detach() for n, p in replica.named_parameters() if p.requires_grad}


def load_trained_state(replica: nn.Module, state: State) -> None:
    params = dict(replica.named_parameters())
    missing = sorted(set(trained_state(replica)) ^ set(state))
    if missing:
        raise ValueError(f"the saved replica's tensors do not match this replica's (e.g. {missing[:3]})")
    with torch.no_grad():
        for name, t in state.items():
            params[name].copy_(t)
            if t.dtype != params[name].dtype and params[name].dtype in HALF:  # a float32 master copy, kept
                setattr(params[name], MASTER, t.float().clone())


def lora_layers(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


@torch.no_grad()
def layer_update(
    layer, states: Sequence[State], weights: Sequence[float], prefix: str, rows=slice(None), adapter: str = "default"
):
    """The weighted sum of the replicas' updates of one MaskLoRA / ScaleLoRA layer (``states``: one trained state
    per replica) as the merge writes it, for the output ``rows`` of the base weight: dense, float32."""
    base = oriented(layer, layer.get_base_layer().weight)[rows]
    product = None
    for w, state in zip(weights, states):
        a = state[f"{prefix}.lora_A.{adapter}.weight"].to(base.device, torch.float32)
        b = state[f"{prefix}.lora_B.{adapter}.weight"][rows].to(base.device, torch.float32)
        product = w * (b @ a) if product is None else product.add_(b @ a, alpha=w)
    return product.mul_(gate_of(base, layer.variant.gating).float()).mul_(layer.scaling[adapter])


@torch.no_grad()
def soup_of_states(
    start: nn.Module, states: Sequence[State], weights: Sequence[float], args, template=None, in_place: bool = False
):
    """The soup of subset replicas of ``start`` (made with ``args``): a plain copy of ``start`` plus the weighted sum
    of their updates (``weights`` sum to 1), layer by layer; pruned weights stay exactly zero. ``template``: a replica
    of ``start`` made with ``args`` (built here if not given; a caller making many soups builds it once).
    ``in_place``: written into ``start`` itself (no new weights; every replica sharing its weights changes too)."""
    kind = kind_of(args)
    layers = [] if kind.adapters is None else lora_layers(template or make_replica(start, args))
    plain = [k for k in states[0] if ".lora_" not in k]  # tensors a replica trains itself (biases, norms)
    changed = {plain_name(k) for k in plain} | {plain_name(prefix) + ".weight" for prefix, _ in layers}
    model = start if in_place else _sharing(start, changed)
    params = dict(model.named_parameters())
    for key in plain:  # the trained tensors themselves: their weighted mean (float64 sums, as every soup)
        params[plain_name(key)].copy_(average_tensors([s[key] for s in states], weights))
    if kind.adapters is None:
        return model
    for prefix, layer in layers:
        weight = oriented(layer, params[plain_name(prefix) + ".weight"])  # (out, in); a view of Conv1D's
        for rows in row_blocks(weight):  # a block of rows at a time: never a dense update of the whole layer
            block = weight[rows]
            summed = block.float().add_(layer_update(layer, states, weights, prefix, rows).mul_(block != 0))
            block.copy_(summed)  # rounded once into the base's dtype; zeros stay exactly zero whatever the rounding
    return model


def _sharing(start: nn.Module, changed: set[str]) -> nn.Module:
    """A copy of ``start`` whose parameters outside ``changed`` share ``start``'s storage (new Parameter objects, as a
    replica's frozen ones): a soup of subset replicas costs the tensors it changes, not a model (the phase's start
    is not used after its soup; the next phase prunes the soup in place)."""
    named = list(start.named_parameters(remove_duplicate=False))
    written = {id(p) for n, p in named if n in changed}  # a tied weight is written if any of its names is
    memo = {id(p): nn.Parameter(p.data, requires_grad=p.requires_grad) for _, p in named if id(p) not in written}
    return copy.deepcopy(start, memo)


def replica_distances(start: nn.Module, states: Sequence[State], args, template=None) -> list[float]:
    """L2 distance between every pair of replicas' weights (i < j order), from their trained states: the base is
    shared, so only the updates differ; one dense layer update at a time (``template``: as in
    :func:`soup_of_states`)."""
    n, kind = len(states), kind_of(args)
    sq = {(i, j): 0.0 for i in range(n) for j in range(i + 1, n)}
    for name in (k for k in states[0] if ".lora_" not in k):  # what a replica trains itself
        for i, j in sq:
            sq[i, j] += float((states[i][name].double() - states[j][name].double()).square().sum())
    if kind.adapters is not None:
        for prefix, layer in lora_layers(template or make_replica(start, args)):
            for rows in row_blocks(
                oriented(layer, layer.get_base_layer().weight)
            ):  # a block of each replica's update at a time
                deltas = [layer_update(layer, [s], [1.0], prefix, rows) for s in states]
                for i, j in sq:
                    sq[i, j] += float((deltas[i].double() - deltas[j].double()).square().sum())
    return [v**0.5 for v in sq.values()]


def adapted(model: nn.Module) -> bool:
    """``model`` holds LoRA layers (peft's, injected or in a ``PeftModel``); no peft import needed to ask."""
    return any(hasattr(m, "lora_A") for m in model.modules())


def adapter_masks(model: nn.Module, masks):
    """``masks`` (plain parameter names) under ``model``'s names (``.base_layer``, ``base_model.model.``)."""
    names = {plain_name(n): n for n, _ in model.named_parameters()}
    return {names.get(k, k): m for k, m in masks.items()}


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain copy of an adapted model with its updates merged under its zeros (the model itself is untouched)."""
    merged = merge_adapters(copy.deepcopy(model))
    vars(merged).pop("hf_sms_replica", None)
    for p in merged.parameters():
        p.requires_grad_(True)
    return merged
