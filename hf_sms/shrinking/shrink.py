"""``shrink``: a pruned model with its removed units cut out, a physically smaller model of the same class
(docs/method.md §11)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..batchnorm import forward_batch
from ..checkpoint.shrink_record import BY_CONFIG, IN_PLACE, SMALLER, ShrinkRecord
from ..families import family_of
from ..pruning.graph import trace_units
from ..pruning.prunable import accepts_labels, parameter_count, train_forward, unfused_attention
from ..pruning.units import UnitGroup, removed_units, unit_report
from .cut import cut_in_place, cut_state_dict, kept_index
from .fit import fit, pad, states_itself

KINDS = ("filters", "neurons", "heads")


def kinds_of(structure) -> tuple[str, ...]:
    """The unit kinds a structure name prunes (``"neurons+heads"``; ``None``: all of them)."""
    if structure is None:
        return KINDS
    kinds = getattr(structure, "kinds", None)
    if kinds is not None:
        return tuple(kinds)
    if not isinstance(structure, str) or not all(k.strip() in KINDS for k in structure.split("+")):
        raise ValueError(
            f"shrink: structure={structure!r} is not a unit structure; name units of {KINDS}, e.g. 'neurons+heads'"
        )
    return tuple(k.strip() for k in structure.split("+"))


def main_output(out) -> torch.Tensor:
    """A forward's main output: the tensor, its ``logits``, or the first tensor of a mapping or tuple."""
    if torch.is_tensor(out):
        return out
    if isinstance(out, Mapping) or hasattr(out, "logits"):
        logits = getattr(out, "logits", None)
        if logits is not None:
            return logits
        return next(v for v in (out.values() if isinstance(out, Mapping) else out) if torch.is_tensor(v))
    return main_output(out[0])


@torch.no_grad()
def eval_output(model: nn.Module, example_inputs) -> torch.Tensor:
    """``model``'s main output (logits) in eval mode on ``example_inputs``, as float."""
    was_training = model.training
    model.eval()
    try:
        with unfused_attention():
            device = next(model.parameters()).device
            return main_output(forward_batch(model, example_inputs, device, keep_labels=accepts_labels(model))).float()
    finally:
        model.train(was_training)


@torch.no_grad()
def same_outputs(model: nn.Module, smaller: nn.Module, batch, rtol: float = 1e-4) -> bool:
    """Whether ``smaller`` gives ``model``'s eval outputs on ``batch``, within ``rtol`` of their largest magnitude."""
    expected, got = eval_output(model, batch), eval_output(smaller, batch)
    scale = float(expected.abs().max().clamp_min(1e-12))
    return expected.shape == got.shape and float((expected - got.to(expected.device)).abs().max()) <= rtol * scale


@torch.no_grad()
def train_output(model: nn.Module, example_inputs) -> torch.Tensor:
    """``model``'s main output in train mode (:func:`~hf_sms.pruning.prunable.train_forward`: dropout modules off,
    buffers and modes restored); an error carries the last module entered (``hf_sms_module``)."""
    entered = [None]
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, n=n: entered.__setitem__(0, n))
        for n, m in model.named_modules()
        if n
    ]
    try:
        with unfused_attention(), train_forward(model):
            device = next(model.parameters()).device
            return main_output(forward_batch(model, example_inputs, device, keep_labels=accepts_labels(model))).float()
    except (RuntimeError, ValueError, IndexError) as e:
        e.hf_sms_module = entered[0]
        raise
    finally:
        for h in hooks:
            h.remove()


def _check_train_mode(model: nn.Module, smaller: nn.Module, batch) -> None:
    """The smaller model runs in train mode where the pruned one does, with outputs of the same shape: units are
    traced in eval mode, so a channel that reaches code only training runs (an auxiliary head, a train-only branch)
    is not seen there. Values are not compared: dropout inside functions (attention weights) draws at each width's
    shapes."""
    try:
        expected = train_output(model, batch)
    except (RuntimeError, ValueError, IndexError):
        return  # the pruned model itself cannot run this batch in train mode (BatchNorm on one item): nothing to hold
    try:
        got = train_output(smaller, batch)
    except (RuntimeError, ValueError, IndexError) as e:
        where = getattr(e, "hf_sms_module", None)
        raise ValueError(
            f"shrink: the smaller {type(model).__name__} runs in eval mode but fails in train mode at "
            f"{where or 'a layer'} ({str(e)[:160]}): a unit's channels reach code only training runs (an auxiliary "
            "head, a train-only branch), which the eval-mode trace cannot see. Build the model without it (e.g. "
            "aux_logits=False) or prune unstructured"
        ) from None
    if expected.shape != got.shape:  # values are not compared: functional dropout draws differ between widths
        raise ValueError(
            f"shrink: the smaller {type(model).__name__} gives outputs of another shape in train mode: a branch only "
            "training runs reads the removed units; build the model without it or prune unstructured"
        )


def _check_arguments(model: nn.Module, rtol, multiple_of) -> None:
    if not (isinstance(rtol, (int, float)) and math.isfinite(rtol) and rtol > 0):
        raise ValueError(f"shrink: rtol={rtol!r} must be a positive number (the largest relative output change)")
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"shrink: multiple_of={multiple_of!r} must be a positive integer (e.g. 8)")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("shrink: the model has parameters on the meta device; load its weights first")
    runtime = [n for n, m in model.named_modules() if type(m).__module__.startswith("hf_sms.runtime")]
    if runtime:
        raise ValueError(
            f"shrink: {runtime[0]} is a sparse-runtime layer (to_sparse_runtime); shrink the pruned model before "
            "converting it"
        )


def example_batch(model: nn.Module, example_inputs=None):
    """``example_inputs``, or a small batch ``model``'s family makes; ``ValueError`` where neither is there."""
    if example_inputs is not None:
        return example_inputs
    batch = family_of(model).example(model)
    if batch is None:
        raise ValueError(
            f"hf-sms finds units by tracing one forward; {type(model).__name__} needs a batch: pass example_inputs"
        )
    return batch


@torch.no_grad()
def shrink(
    model: nn.Module,
    example_inputs=None,
    rtol: float = 1e-4,
    structure=None,
    fit_config: bool = True,
    multiple_of: int = 1,
) -> nn.Module:
    """A physically smaller copy of ``model`` without its removed units: conv filters, FFN neurons and attention
    heads whose weights are all exactly zero (pruned with ``structure="filters"``, ``"neurons"``, ``"heads"``).

    Units are found by tracing ``model`` on the batch (:mod:`hf_sms.pruning.graph`). The copy has ``model``'s class
    and module names and smaller layers. With ``fit_config`` its family's own config states the smaller widths
    (transformers' ``intermediate_size``/``d_ff``/``num_attention_heads``..., timm's ``base_width``/``mlp_ratio``,
    smp's decoder channels: :mod:`hf_sms.families`), so its own ``save_pretrained`` loads with plain
    transformers / timm / smp; units its config cannot drop stay as the zeros they are (exact), with a warning.
    ``model`` is not changed; the copy's eval outputs on the batch are checked against ``model``'s.

    Args:
        model: a pruned model (transformers, timm, smp or plain torch).
        example_inputs: a batch (tensor, tuple, or dict by forward argument name); default: a small one the model's
            family makes (transformers, timm, smp). Plain torch models need one.
        rtol: the largest difference of the outputs allowed, relative to their largest magnitude.
        structure: whose units to cut: ``"filters"``, ``"neurons"``, ``"heads"`` or several joined by ``"+"``;
            default all.
        fit_config: write the widths into the family's config (above). ``False``: cut every removed unit in place
            (smaller still where the config cannot state a width: saved with a plain route, hf_sms.checkpoint.plain).
        multiple_of: each layer keeps a multiple of this many units (some removed ones stay as zeros), widths
            tensor-core kernels run at full rate (e.g. 8 for bf16).

    Returns:
        The smaller model, in ``model``'s training mode.

    Raises:
        ValueError: bad arguments; no unit of ``structure`` removed (e.g. unstructured pruning); or outputs that
            differ (a layer hf-sms reads wrong: please report it).
    """
    _check_arguments(model, rtol, multiple_of)
    batch = example_batch(model, example_inputs)
    kinds = kinds_of(structure)
    trace = trace_units(model, batch)
    groups = trace.groups(kinds)
    keep = [~removed_units(model, g) for g in groups]
    keep = [k if bool(k.any()) else pad(k, 1) for k in keep]  # never a zero-width layer
    if not any(not bool(k.all()) for k in keep):
        raise ValueError(
            f"shrink: no {'/'.join(kinds)} unit of {type(model).__name__} is entirely zero (found {len(groups)} "
            "groups of units); prune whole units first, e.g. compute_masks(model, 0.5, structure='neurons'). "
            "Unstructured zeros make no layer smaller"
        )
    fitted = fit(model, groups, keep, multiple_of) if fit_config else None
    if fitted is not None and not any(fitted.stated):  # its config states none of these widths: cut in place
        fitted = None
    if fitted is None:
        keep = [pad(k, min(math.ceil(int(k.sum()) / multiple_of) * multiple_of, len(k))) for k in keep]
        # widths from a config rebuild every layer alike; a cut in place follows the trace (train-only heads too)
        _warn_unread(trace.unread and trace.unread & trace_units(model, batch, train=True).unread)
        smaller = cut_in_place(copy.deepcopy(model), kept_index(model, groups, keep))
    else:
        smaller = _rebuilt(model, groups, fitted)
        _warn_kept(groups, keep, fitted.keep)
    if not same_outputs(model, smaller, batch, rtol):
        raise ValueError(
            f"shrink: the smaller {type(model).__name__} computes other outputs than the pruned one; a layer "
            "does not keep its units independent. Please report it with the model's class"
        )
    _check_train_mode(model, smaller, batch)
    return smaller


def _rebuilt(model: nn.Module, groups: list[UnitGroup], fitted) -> nn.Module:
    family = family_of(model)
    param = next(model.parameters())
    smaller = family.build(model, fitted.overrides)
    smaller.load_state_dict(cut_state_dict(model, kept_index(model, groups, fitted.keep)))
    family.commit(smaller, fitted.overrides)
    dtypes = {p.dtype for p in model.parameters()}
    smaller = smaller.to(param.device, dtype=dtypes.pop() if len(dtypes) == 1 else None)
    return smaller.train(model.training)


def _warn_unread(unread: frozenset) -> None:
    if unread:
        names = sorted(unread)
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        warnings.warn(
            f"shrink: the forward on the example batch read none of {', '.join(names[:4])}{more} (a branch it did "
            "not take, or weights forward never uses): the smaller model is checked on that forward only, and where "
            "forward takes another branch it can fail with a shape error. Pass example_inputs that take every branch",
            stacklevel=3,
        )


def _warn_kept(groups, keep, kept) -> None:
    zeros = {}
    for g, k, final in zip(groups, keep, kept):
        extra = int(final.sum()) - int(k.sum())
        if extra > 0:
            zeros[g.kind] = zeros.get(g.kind, 0) + extra * g.layers
    if zeros:
        said = ", ".join(f"{n} {kind}" for kind, n in zeros.items())
        warnings.warn(
            f"shrink kept {said} removed units as zeros: its family's config cannot state those widths (or one count "
            "sizes several layers). shrink(..., fit_config=False) cuts them, for a model cut in place "
            "(saved with a plain route: hf_sms.checkpoint.plain)",
            stacklevel=3,
        )


def zero_units_kept(smaller: nn.Module, example_inputs, structure=None) -> dict[str, int]:
    """``{kind: units}`` of ``smaller`` that are still all zero (kept where its config cannot drop them)."""
    groups = trace_units(smaller, example_batch(smaller, example_inputs)).groups(kinds_of(structure))
    report = unit_report(smaller, groups)
    return {kind: entry["removed"] for kind, entry in report.items() if entry["removed"]}


def dense_values(dense: nn.Module, smaller: nn.Module) -> dict:
    """``{knob: value in dense}`` for every knob of the family whose value differs in ``smaller``: what
    :func:`dense_shaped` needs to rebuild the dense widths."""
    family = family_of(dense)
    a, b = family.values(dense), family.values(smaller)
    return {k: a.get(k) for k in a if a.get(k) != b.get(k)}


def dense_shaped(smaller: nn.Module, dense_config: dict, device=None) -> nn.Module:
    """A randomly initialised model of ``smaller``'s kind with the dense knob values ``dense_config`` records (read
    from a checkpoint: only the family's knobs, numbers or ``None``): the shapes it was shrunk from, for timing; on
    ``device`` (default: ``smaller``'s; a meta-device ``smaller`` gives its config only)."""
    family = family_of(smaller)
    names = {k.name for k in family.knobs}

    def ok(v):
        if isinstance(v, (list, tuple)):  # timm ResNet's channels per stage (a list once read from JSON)
            return 0 < len(v) <= 16 and all(ok(x) and x is not None for x in v)
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 2**20)

    bad = {k: v for k, v in (dense_config or {}).items() if k not in names or not ok(v)}
    if bad or not dense_config or family.library == "transformers" and not hasattr(smaller, "config"):
        raise ValueError(f"cannot rebuild the dense shapes from {dense_config!r} (knobs {sorted(names)})")
    dense = family.build(smaller, {k: tuple(v) if isinstance(v, list) else v for k, v in dense_config.items()})
    if dense is None:
        raise ValueError(f"cannot rebuild the dense shapes of a plain {type(smaller).__name__}")
    return dense.to(device or next(smaller.parameters()).device).eval()


def shrink_record(dense: nn.Module, pruned: nn.Module, shrunk: nn.Module, structure, example_inputs) -> ShrinkRecord:
    """What a structured soup's ``sparsity.json`` and card say of it: the units removed (measured on the pruned
    model), the parameters of the smaller model against the dense one, and the removed units it keeps as zeros
    where its family's config cannot state a smaller width."""
    batch = example_batch(pruned, example_inputs)
    groups = trace_units(pruned, batch).groups(kinds_of(structure))
    return ShrinkRecord(
        saved=SMALLER,
        structure="+".join(kinds_of(structure)),
        cut=BY_CONFIG if states_itself(shrunk) else IN_PLACE,
        units=unit_report(pruned, groups),
        dense_config=dense_values(dense, shrunk),
        zero_units_kept=zero_units_kept(shrunk, batch, structure),
        parameters=parameter_count(shrunk),
        dense_parameters=parameter_count(dense),
        parameter_ratio=parameter_count(shrunk) / max(parameter_count(dense), 1),
    )
