"""What a trace gives: the unit spaces of a model and why every other layer's output is no unit
(:mod:`hf_sms.pruning.graph`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ...batchnorm import forward_batch
from ..prunable import accepts_labels, prunable_tensors, train_forward, unfused_attention
from ..units import Member, UnitGroup
from .labels import CHANNELWISE, CONSUMER, PRODUCER, _output_tensors
from .ops import OPS
from .recorder import Recorder


# -- what the trace gives -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Found:
    """A space of units the trace found: its ``kinds`` (which structures may prune it), ``n_units``, and per
    tensor dimension the positions of each unit: ``slices[(name, dim)]`` is ``(n_units, k)``; ``roles`` says what
    each weight dimension does (``producer``, ``consumer``, ``channelwise``, or ``follower``: a bias, a norm)."""

    kinds: frozenset
    n_units: int
    slices: dict
    roles: dict
    name: str


@dataclass
class Trace:
    """What :func:`trace_units` saw: the unit spaces and, per prunable weight that produces a space that is no
    unit, why (``skipped``)."""

    found: list[Found]
    skipped: dict[str, str]
    prunable: frozenset = frozenset()
    unread: frozenset = frozenset()  # weights the forward never read: a branch the batch did not take, or unused

    def groups(self, kinds: tuple[str, ...]) -> list[UnitGroup]:
        """The unit groups of the spaces any of ``kinds`` may prune, each once, its kind the first of ``kinds`` it
        has (a 1x1-conv MLP is filters or neurons, whichever is asked first)."""
        out = []
        for f in self.found:
            kind = next((k for k in kinds if k in f.kinds), None)
            if kind is None:
                continue
            members = []
            for (name, dim), positions in f.slices.items():
                roles = f.roles[(name, dim)]
                role = next((r for r in (PRODUCER, CONSUMER, CHANNELWISE) if r in roles), "follower")
                members.append(Member(name, dim, positions, name in self.prunable, role))
            readers = {m.name for m in members if m.role == CONSUMER} or {m.name for m in members if m.masked}
            out.append(UnitGroup(kind, f.name, f.n_units, tuple(members), max(len(readers), 1), f.kinds))
        return out


def _skip(skipped: dict[str, str], layer: str, why: str) -> None:
    """Say why ``layer``'s output is no unit (two reasons at most: a head count and a head size may differ)."""
    said = skipped.get(layer)
    if said is None:
        skipped[layer] = why
    elif why not in said and ";" not in said:
        skipped[layer] = f"{said}; {why}"


def _module_of(name: str) -> str:
    return name.rpartition(".")[0] or name


def _describe(producers: list[str], consumers: list[str]) -> str:
    modules = list(dict.fromkeys(_module_of(n) for n in producers))
    head = modules[0] + (f" (+{len(modules) - 1} more)" if len(modules) > 1 else "")
    return head


def _signature(value):
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, Mapping):
        return tuple((k, _signature(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    return repr(value)[:50]


def _small(batch, n: int = 2):
    """The first ``n`` examples of a batch whose tensors share a first dimension (tracing needs no more)."""
    tensors = _output_tensors(batch)
    sizes = {t.shape[0] for t in tensors if t.dim() > 0}
    if len(sizes) != 1 or sizes.pop() <= n:
        return batch

    def cut(v):
        if torch.is_tensor(v):
            return v[:n] if v.dim() > 0 else v
        if isinstance(v, Mapping):
            return {k: cut(x) for k, x in v.items()}
        if isinstance(v, (tuple, list)):
            return type(v)(cut(x) for x in v)
        return v

    return cut(batch)


_CACHE: dict = {}


def _value_key(v) -> object:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return tuple(_value_key(x) for x in v)
    if isinstance(v, torch.Tensor):  # a plain tensor attribute: its shape and dtype decide what a forward does
        return ("tensor", tuple(v.shape), str(v.dtype))
    return (type(v).__qualname__, repr(v)[:2000])


def _hooks(module: nn.Module) -> tuple:
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return tuple(getattr(h, "__qualname__", type(h).__qualname__) for h in hooks)


def _attributes(module: nn.Module) -> tuple:
    plain = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}
    return tuple(sorted((k, _value_key(v)) for k, v in plain.items()))


def architecture_key(model: nn.Module) -> tuple:
    """What decides a model's trace besides its batch: every module's class (the object, so two classes of one name
    differ), its plain attributes (``Flex(mix=True)`` vs ``Flex(mix=False)``), its hooks, and every tensor's
    shape. Two copies of one model share it; two instances whose forwards differ do not."""
    modules = tuple((name, id(type(m)), _hooks(m), _attributes(m)) for name, m in model.named_modules())
    shapes = tuple((n, tuple(t.shape)) for n, t in [*model.named_parameters(), *model.named_buffers()])
    return modules, shapes, _hooks_global()


def _hooks_global() -> tuple:
    from torch.nn.modules import module as torch_module

    return tuple(len(d) for d in (torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks))


@torch.no_grad()
def trace_units(model: nn.Module, example_inputs, train: bool = False) -> Trace:
    """The unit spaces of ``model``, found from one eval forward on (the first two examples of)
    ``example_inputs``, a batch as :func:`hf_sms.batchnorm.forward_batch` takes it; ``train``: from a train-mode
    forward (dropout modules off, buffers such as BatchNorm statistics restored, the random state untouched), where
    code only training runs (an auxiliary head) reads the channels too. The model's training mode is restored.
    Remembered per :func:`architecture_key`, batch shape, mode and the ops registered: the spaces depend on the
    forward and the shapes, not on the weights."""
    batch = _small(example_inputs)
    key = (architecture_key(model), _signature(batch), train, OPS.version)  # a registered op changes the trace
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _trace(model, batch, train)
    return _CACHE[key]


def _trace(model: nn.Module, batch, train: bool = False) -> Trace:
    names: dict[int, str] = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    for n, b in model.named_buffers():
        names.setdefault(id(b), n)
    recorder = Recorder(names)
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        with unfused_attention(), train_forward(model) if train else contextlib.nullcontext(), recorder:
            try:
                out = forward_batch(model, batch, device, keep_labels=accepts_labels(model))
            except Exception as e:
                raise ValueError(
                    f"units are found by tracing one forward of {type(model).__name__}, and it failed on the batch "
                    f"given ({type(e).__name__}: {str(e)[:200]}); pass a batch the model takes (example_inputs)"
                ) from e
        for t in _output_tensors(out):
            for space in recorder.lab(t):
                recorder.s.pin(space, "the model's output")
    finally:
        model.train(was_training)
    return _units(model, recorder)


def _units(model: nn.Module, rec: Recorder) -> Trace:
    s = rec.s
    pinned: dict[int, str] = {}
    for space, reason in s.pins.items():
        for leaf in s.expand(space):
            pinned.setdefault(s.find(leaf), reason)
    # per leaf: where it lies in every tensor dimension, and what each dimension does
    slices: dict[int, dict] = {}
    roles: dict[int, dict] = {}
    for (name, dim), occ in rec.occurrences.items():
        for leaf, pos in s.expand(occ.space).items():
            slices.setdefault(leaf, {})[(name, dim)] = pos
            roles.setdefault(leaf, {})[(name, dim)] = occ.roles
    # heads: the first factor of a producer's output that stays is its head unit; later factors lie inside heads
    outer, inner = set(), set()

    def factor_roles(space: int, depth: int = 0) -> None:
        r = s.find(space)
        kind, children = s.refined.get(r, (None, []))
        if kind == "sum" and depth < 64:
            for c in children:
                factor_roles(c, depth + 1)
        elif kind == "prod":  # the innermost factor is the head size; the first other one that stays, the heads
            first = True
            factors = s.factors(r)
            for j, factor in enumerate(factors):
                leaves = [s.find(leaf) for leaf in s.expand(factor)]
                if first and j < len(factors) - 1 and not all(leaf in pinned for leaf in leaves):
                    outer.update(leaves)
                    first = False
                else:
                    inner.update(leaves)

    for occ in rec.occurrences.values():
        if any(r == PRODUCER for r, _ in occ.roles):
            factor_roles(occ.space)
    prunable = frozenset(t.name for t in prunable_tensors(model))
    found, skipped = [], {}
    for leaf, where in slices.items():
        by_role = {}
        for key, rs in roles[leaf].items():
            for role, kind in rs:
                by_role.setdefault(role, []).append((key[0], kind))
        producers = [n for n, k in by_role.get(PRODUCER, []) if n in prunable]
        if not producers:
            continue
        n = s.size(leaf)
        layer = _module_of(producers[0])
        if leaf in pinned:
            for p in producers:
                _skip(skipped, _module_of(p), f"its output is {pinned[leaf]}")
            continue
        if n < 2:
            _skip(skipped, layer, "one unit only")
            continue
        if leaf in inner:
            _skip(skipped, layer, "slices inside each head (head size, or query heads of a key/value group)")
            continue
        producer_kinds = {k for _, k in by_role.get(PRODUCER, [])}
        consumer_kinds = {k for _, k in by_role.get(CONSUMER, [])}
        kinds = set()
        if leaf in outer:
            kinds.add("heads")
        else:
            if producer_kinds & {"conv", "conv1x1"}:
                kinds.add("filters")
            linear = {"linear", "conv1x1"}
            if producer_kinds <= linear and consumer_kinds and consumer_kinds <= linear and CHANNELWISE not in by_role:
                kinds.add("neurons")  # an FFN: no norm or depthwise conv acts on its units
        if not kinds:
            _skip(
                skipped,
                layer,
                f"made by {', '.join(sorted(producer_kinds))} layers, read by "
                f"{', '.join(sorted(consumer_kinds)) or 'none'}",
            )
            continue
        flat_roles = {key: {r for r, _ in rs} or {"follower"} for key, rs in roles[leaf].items()}
        found.append(Found(frozenset(kinds), n, dict(where), flat_roles, _describe(producers, [])))
    order = {n: i for i, (n, _) in enumerate([*model.named_parameters(), *model.named_buffers()])}
    found.sort(key=lambda f: min(order.get(k[0], 0) for k in f.slices))
    unread = frozenset(n for n, p in model.named_parameters() if p.dim() and (n, 0) not in rec.occurrences)
    return Trace(found, skipped, prunable, unread)
