"""Making a soup: one function for every soup method, in memory or across processes (docs/method.md §4).

:func:`soup` runs a registered :class:`~hf_sms.soup.method.SoupMethod` on candidates wherever they live: the SMS loop
passes its :class:`~hf_sms.loop.distributed.ReplicaWorld`, the in-memory helpers :func:`hf_sms.uniform_soup` and
:func:`hf_sms.greedy_soup` (:mod:`hf_sms.soup.merging`) a :class:`LocalWorld`. The weighted mean goes through
:mod:`hf_sms.soup.averaging` (float64 sums, integer buffers from the first kept input), so inputs that share a mask
give a soup with that mask, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ..pruning.masks import apply_masks, masks_from_model
from ..pruning.prunable import Masks
from ..registry import SOUPS
from .averaging import average_tensors
from .method import SoupMethod, Tensors, indicator_weights

StateDict = dict[str, torch.Tensor]


class LocalWorld:
    """Every candidate in this process: the world of one, for soups made in memory."""

    size, is_main = 1, True

    def all_gather(self, value) -> list:
        return [value]

    def wait(self) -> None:
        pass

    def average(self, local: dict[int, StateDict], weights: Sequence[float], template: StateDict, into=None):
        used = [i for i, w in enumerate(weights) if w]
        out = average_state_dicts([local[i] for i in used], [weights[i] for i in used])
        for k, v in out.items() if into is not None else ():
            into[k].copy_(v)
        return out

    def all_candidates(self, local: dict[int, StateDict], n: int, template: StateDict) -> dict[int, StateDict]:
        return dict(local)

    def broadcast_masks(self, masks: Masks) -> Masks:
        return masks


@torch.no_grad()
def average_state_dicts(state_dicts: Sequence[StateDict], weights: Sequence[float] | None = None) -> StateDict:
    """Weighted mean of state dicts (uniform if ``weights`` is None); accumulates in float64."""
    if not state_dicts:
        raise ValueError("nothing to average: pass at least one model")
    keys = list(state_dicts[0])
    for i, sd in enumerate(state_dicts[1:], 1):
        if list(sd) != keys:
            missing = sorted(set(keys) ^ set(sd))[:5]
            raise ValueError(f"input {i} has different tensors than input 0 (e.g. {missing}): architectures differ")
    for k in keys:
        if any(sd[k].shape != state_dicts[0][k].shape for sd in state_dicts):
            raise ValueError(f"tensor {k!r} has different shapes across inputs: architectures differ")
    return {k: average_tensors([sd[k] for sd in state_dicts], weights) for k in keys}


def check_same_masks(models: Sequence[nn.Module]) -> Masks:
    """The shared mask of ``models``; raises if any prunable tensor's zero pattern differs."""
    ref = masks_from_model(models[0])
    for i, model in enumerate(models[1:], 1):
        for name, mask in ref.items():  # one tensor at a time: no second set of masks
            differ = int(torch.count_nonzero(mask != (model.get_parameter(name).detach() != 0)))
            if differ:
                raise ValueError(
                    f"model {i} and model 0 have different masks ({differ} entries of {name!r} differ), so their "
                    "average would not be sparse. Merge only replicas retrained from the same pruned model, or "
                    "use the 'reprune' soup (IMP-RePrune: average, then prune to a sparsity)."
                )
    return ref


def _checked_base(base: nn.Module, template: nn.Module, name: str) -> StateDict:
    """The base's state, refused where it is not the candidates' start: other tensors or shapes, or another mask
    (the dense model: its updates would count the entries the candidates prune)."""
    state, reference = base.state_dict(), template.state_dict()
    wrong = [k for k in reference if k not in state or state[k].shape != reference[k].shape]
    if wrong:
        raise ValueError(
            f"the {name!r} soup's base is another architecture than the candidates (e.g. {wrong[:3]}): pass the "
            "pruned model they were retrained from"
        )
    for key, mask in masks_from_model(template).items():
        differ = int(torch.count_nonzero(mask != (state[key] != 0)))
        if differ:
            raise ValueError(
                f"the {name!r} soup's base has another mask than the candidates ({differ} entries of {key!r}): pass "
                "the pruned model they were retrained from (the phase's start), not the dense model"
            )
    return state


def _combined(method: SoupMethod, world, local, weights, template: StateDict, base: StateDict | None, **seen):
    every = seen["every"] or world.all_candidates(local, len(weights), template)
    used = [i for i, w in enumerate(weights) if w]
    if seen["mixing"] is not None:  # a learned soup: each parameter its own weights, buffers the plain mean
        mixing = seen["mixing"]
        mean = [1 / len(used)] * len(used)
        return {
            k: average_tensors([every[i][k] for i in used], [mixing[k][i] for i in used] if k in mixing else mean)
            for k in template
        }
    return {
        k: method.combine(
            [every[i][k] for i in used],
            [weights[i] for i in used],
            Tensors(k, base[k] if base else None, seen["options"], seen["seed"]),
        )
        if template[k].is_floating_point()
        else every[used[0]][k].clone()
        for k in template
    }


@torch.no_grad()
def _superpose(spec: SoupMethod, model: nn.Module, every, weights, options, reprune, world) -> None:
    """Load ``model`` with the kept candidates joined one at a time (``spec.superpose``), re-pruned after each join
    but the last (the soup's own re-pruning follows)."""
    used = [i for i, w in enumerate(weights) if w]
    model.load_state_dict(every[used[0]])
    for k, i in enumerate(used[1:], 2):
        w, running = spec.superpose(k, options), model.state_dict()
        model.load_state_dict({key: average_tensors([running[key], every[i][key]], [1 - w, w]) for key in running})
        if k < len(used):
            apply_masks(model, world.broadcast_masks(reprune(model)))


def soup(
    candidates: Mapping[int, nn.Module] | Sequence[nn.Module],
    method: str | SoupMethod = "uniform",
    *,
    template: nn.Module | None = None,
    world=None,
    scores: Sequence[float | None] | None = None,
    evaluate: Callable[[nn.Module], float] | None = None,
    recalibrate: Callable[[nn.Module], nn.Module] | None = None,
    config=None,
    sparsity: float | None = None,
    reprune: Callable[[nn.Module, float], Masks] | None = None,
    base: nn.Module | None = None,
    options: dict | None = None,
    seed: int = 0,
    fit=None,
) -> tuple[nn.Module, list[float]]:
    """The soup of ``candidates`` by a soup method, recalibrated; returns ``(soup, one weight per candidate)``.

    Args:
        candidates: the models, or ``{replica index: model}`` of this process's share (with ``world``).
        method: a name in :data:`~hf_sms.registry.SOUPS` or a :class:`SoupMethod`.
        template: a model of the architecture (default: a candidate; needed by a process that holds none).
        world: where the candidates live (:class:`LocalWorld` by default; the loop's ``ReplicaWorld``).
        scores: every candidate's validation score, if known (else computed with ``evaluate``, or 0).
        evaluate: validation metric of a model, higher is better (methods that trial soups need it; never test
            data).
        recalibrate: called on every trial soup and the result (BatchNorm statistics).
        config: passed to the method's ``select`` (e.g. ``greedy_keep_ties``).
        sparsity, reprune: where a method re-prunes (``same_mask=False``), to what sparsity and how:
            ``reprune(model, sparsity) -> masks`` (the run's plan on its batch; :func:`hf_sms.uniform_soup`: global
            magnitude).
        base: the model every candidate was retrained from (the phase's pruned start), for methods that
            ``needs_base`` (model_stock, ties, dare).
        options: the method's options (checked against the ones it declares, defaults filled in).
        seed: the soup's random stream (DARE's drop, the learned soup's batch order).
        fit: held-out data for methods that learn their weights (:class:`hf_sms.soup.learned.FitData`; the
            learned soup); the main process fits, every process gets its weights.
    """
    spec = SOUPS.get(method) if isinstance(method, str) else method
    name = method if isinstance(method, str) else "this"
    if spec.needs_base and base is None:
        raise ValueError(f"the {name!r} soup merges updates from the candidates' common start: pass base=<that model>")
    if spec.fit is not None and fit is None:
        raise ValueError(f"the {name!r} soup learns its weights on held-out data: pass fit=FitData(...)")
    seen = {"options": spec.resolve(name, options), "seed": seed, "mixing": None, "every": None}
    local = dict(candidates) if isinstance(candidates, Mapping) else dict(enumerate(candidates))
    world = world if world is not None else LocalWorld()
    template = template if template is not None else next(iter(local.values()), None)
    if template is None:
        raise ValueError("nothing to soup: pass candidates, or a template in a process that holds none")
    if spec.same_mask and len(local) > 1:
        check_same_masks(list(local.values()))
    if not spec.same_mask and spec.reprune and (sparsity is None or reprune is None):
        raise ValueError(
            "this soup re-prunes the mean of candidates with different masks: pass sparsity= and reprune=<fn(model, "
            "sparsity) -> masks>, e.g. lambda m, s: hf_sms.compute_masks(m, s)"
        )
    state = {i: m.state_dict() for i, m in local.items()}
    reference = template.state_dict()
    base_state = _checked_base(base, template, name) if spec.needs_base else None
    # a method's own combine may not keep zeros (a rescaling, a sign vote): the shared mask is applied after it
    own = spec.combine is not None or spec.fit is not None
    shared_mask = masks_from_model(template) if own and spec.same_mask else None
    n = len(scores) if scores is not None else len(local)
    if spec.fit is not None:
        every = seen["every"] = world.all_candidates(state, n, reference)  # the fit's, then the soup's
        fitted = spec.fit([every[i] for i in range(n)], template, fit, seen["options"], seed) if world.is_main else None
        world.wait()  # the others wait for the fit however long it takes (a collective's timeout would end the run)
        seen["mixing"] = world.all_gather(fitted)[0]

    def build(weights: list[float]) -> nn.Module:
        model = copy.deepcopy(template)
        if spec.superpose is not None:
            every = seen["every"] = seen["every"] or world.all_candidates(state, n, reference)
            _superpose(spec, model, every, weights, seen["options"], lambda m: reprune(m, sparsity), world)
        elif spec.combine is None and seen["mixing"] is None:  # the weighted mean, written into the copy's tensors
            world.average(state, weights, reference, into=model.state_dict())
        else:
            model.load_state_dict(_combined(spec, world, state, weights, reference, base_state, **seen))
        if shared_mask is not None:
            apply_masks(model, shared_mask)
        if not spec.same_mask and spec.reprune:
            masks = reprune(model, sparsity)
            apply_masks(model, world.broadcast_masks(masks))
        return recalibrate(model) if recalibrate is not None else model

    def trial(weights: list[float]) -> float:
        if evaluate is None:
            raise ValueError("this soup method evaluates trial soups: pass evaluate=<validation metric>")
        return float(evaluate(build(weights)))

    if scores is None:
        scores = [trial(indicator_weights([i], n)) for i in range(n)] if evaluate else [0.0] * n
    weights = spec.select(list(scores), trial, config)
    return build(weights), weights
