"""The recorder's shared state: a space per dimension of every tensor of a traced forward, which dimensions are
parameters' and what ops made of them (:mod:`hf_sms.pruning.graph`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .spaces import Spaces

PRODUCER, CONSUMER, CHANNELWISE = "producer", "consumer", "channelwise"


@dataclass
class Occurrence:
    """A dimension of a parameter or buffer: the space it indexes and what ops made of it (``roles``: ``(role, op
    kind)`` with role producer/consumer/channelwise and kind linear/conv1x1/conv/embedding)."""

    name: str
    dim: int
    space: int
    roles: set = field(default_factory=set)


def _flat(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = []
    for a in [*args, *kwargs.values()]:
        if torch.is_tensor(a):
            found.append(a)
        elif isinstance(a, (tuple, list)):
            found += [t for t in a if torch.is_tensor(t)]
    return found


def _arg(func, args, kwargs, name, default):
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else default
    return default


def _output_tensors(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _output_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _output_tensors(v)]
    return []  # a cache object, None, a number: not the model's outputs


class Labels:
    """Labels every tensor of one forward with a space per dimension."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.s = Spaces()
        self.names = names  # id(parameter or buffer) -> name
        self.labels: dict[int, tuple[int, ...]] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while the trace runs
        self.occurrences: dict[tuple[str, int], Occurrence] = {}
        self.owner: dict[int, Occurrence] = {}  # a parameter dimension's own space -> its occurrence
        self.weights: set[int] = set()  # ids of parameters and of views or casts of them

    # -- labels -----------------------------------------------------------------------------------------------
    def lab(self, t: torch.Tensor) -> tuple[int, ...]:
        key = id(t)
        if key not in self.labels:
            self.labels[key] = tuple(self.s.new(n) for n in t.shape)
            self.alive.append(t)
            name = self.names.get(key)
            if name is not None:
                for d, space in enumerate(self.labels[key]):
                    occurrence = Occurrence(name, d, space)
                    self.occurrences[(name, d)] = occurrence
                    self.owner[space] = occurrence
        return self.labels[key]

    def set(self, t, labels) -> None:
        if torch.is_tensor(t):
            self.labels[id(t)] = tuple(labels)
            self.alive.append(t)

    def is_weight(self, t) -> bool:
        return id(t) in self.weights or id(t) in self.names

    def fresh(self, t, pinned: str | None = None, free: bool = False) -> None:
        if torch.is_tensor(t):
            labels = tuple(self.s.new(n, free) for n in t.shape)
            for space in labels if pinned else ():
                self.s.pin(space, pinned)
            self.set(t, labels)

    def role(self, space: int, role: str, kind: str) -> None:
        occurrence = self.owner.get(space)
        if occurrence is not None:
            occurrence.roles.add((role, kind))

    def pin_all(self, tensors, reason: str) -> None:
        for t in tensors:
            for space in self.lab(t):
                self.s.pin(space, reason)
