"""What a soup method is: which candidates with which weights, and how their tensors combine.

A soup method is a :class:`SoupMethod` registered in :data:`hf_sms.registry.SOUPS`, one file each
(:mod:`hf_sms.soup.uniform`, :mod:`hf_sms.soup.greedy`, :mod:`hf_sms.soup.ties`, ...), as mergekit does it. A
method's options are declared on it (:class:`Option`, after mergekit's ``ConfigParameterDef``) and checked before
any training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

# select(validation scores of the m candidates, trial(weights) -> validation score of that soup, config)
#   -> one weight per candidate (0 leaves a candidate out)
Select = Callable[[Sequence[float], Callable[[list[float]], float], object], list[float]]


@dataclass(frozen=True)
class Tensors:
    """What a method's ``combine`` sees of one tensor beside the candidates' values and weights.

    Attributes:
        name: the tensor's name (keys a method's random stream, e.g. DARE's drop).
        base: the phase's start tensor, the pruned model every candidate was retrained from (methods with
            ``needs_base``; ``None`` otherwise). Its zeros are the shared mask.
        options: the method's options, defaults filled in and checked.
        seed: the soup's seed (derived per phase by the loop).
    """

    name: str
    base: torch.Tensor | None = None
    options: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0


# combine(the candidates' tensors of one name, their weights (summing to 1), Tensors) -> the soup's tensor
Combine = Callable[[list[torch.Tensor], list[float], Tensors], torch.Tensor]
# fit(every candidate's state dict, the architecture, held-out data, options, seed)
#   -> {parameter name: one weight per candidate}
Fit = Callable[[list[dict], object, object, Mapping[str, float], int], dict[str, list[float]]]


@dataclass(frozen=True)
class Option:
    """One option of a soup method: a number in ``[low, high]`` (``low`` excluded when ``open_low``)."""

    name: str
    default: float
    low: float = -math.inf
    high: float = math.inf
    open_low: bool = False
    help: str = ""
    integer: bool = False

    def check(self, value, method: str) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > self.low if self.open_low else value >= self.low) and value <= self.high
        if not ok or (self.integer and value != int(value)):
            bound = "(" if self.open_low else "["
            raise ValueError(
                f"soup_options[{method!r}][{self.name!r}] must be {'a whole' if self.integer else 'a'} number in "
                f"{bound}{self.low}, {self.high}], got {value!r} ({self.help})"
            )
        return float(value)


@dataclass(frozen=True)
class SoupMethod:
    """A soup method.

    Attributes:
        select: the candidates' weights, from their validation scores and trial soups.
        combine: how one tensor of the soup is made from the candidates' (floating-point tensors only; integer
            buffers come from the first kept candidate). ``None``: the weighted mean (:mod:`hf_sms.soup.averaging`),
            which keeps a shared mask exactly and, across processes, needs one all-reduce. Any other per-tensor
            function (TIES, DARE, Model Stock) gathers the candidates to every process; the shared mask is applied
            to its result.
        needs_base: ``combine`` uses the phase's start (``Tensors.base``): the loop passes the pruned model the
            replicas started from, ``hf-sms merge`` a ``--base`` folder.
        options: the options ``combine`` reads (``SparseSoupConfig.soup_options[name]``), with their defaults.
        fit: per-parameter weights over the candidates learned from held-out data (the learned soup): each
            parameter is the mix of the candidates' with its own weights; buffers are the mean. Needs ``fit=`` data
            in :func:`~hf_sms.soup.soup`.
        needs_validation: ``select`` evaluates trial soups, or ``fit`` trains on held-out data (so it needs
            validation data; ``hf-sms merge`` cannot run it).
        same_mask: the candidates must share one mask (checked); ``False``: their masks may differ.
        reprune: with differing masks, magnitude-prune the soup to the phase's sparsity (IMP-RePrune); ``False``:
            leave it as it is (DPF's dense copies, which the next pruning step masks).
        superpose: ``fn(k, options) -> w``: the candidates join one at a time, the k-th (k >= 2, in candidate
            order) with weight w against the running soup's 1 - w, the soup re-pruned after each (Sup-tickets' CAA
            and CIA, Yin et al. 2022a); ``None``: all at once.
    """

    select: Select
    combine: Combine | None = None
    fit: Fit | None = None
    needs_base: bool = False
    options: tuple[Option, ...] = ()
    needs_validation: bool = False
    same_mask: bool = True
    reprune: bool = True
    superpose: Callable[[int, Mapping[str, float]], float] | None = None

    @property
    def weighted_mean(self) -> bool:
        """A weighted mean of candidates under one mask (uniform, greedy): what subset replicas and streamed merges
        can make without every candidate's tensors at once."""
        return self.combine is None and self.fit is None and self.superpose is None and self.same_mask

    def resolve(self, name: str, given: Mapping | None) -> dict[str, float]:
        """``given`` checked against the declared options, defaults filled in; raises naming what is wrong."""
        given = dict(given or {})
        known = {o.name: o for o in self.options}
        unknown = sorted(set(given) - set(known))
        if unknown:
            offered = sorted(known) or "none"
            raise ValueError(f"the {name!r} soup has no option {unknown}; its options: {offered}")
        return {o.name: o.check(given.get(o.name, o.default), name) for o in self.options}


def indicator_weights(indices: Sequence[int], n: int) -> list[float]:
    """Uniform weights over ``indices``, 0 for the other of ``n`` candidates."""
    return [1.0 / len(indices) if i in indices else 0.0 for i in range(n)]
