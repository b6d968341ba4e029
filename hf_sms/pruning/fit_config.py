"""The conv widths a family's config can state: which smaller timm or smp model a filter-pruned one fits
(docs/method.md §11).

:func:`hf_sms.pruning.structured.shrink_filters` can leave every conv its own width, but timm and smp rebuild a
model from a few constructor arguments (timm ResNet's ``base_width``, smp PSPNet's ``psp_out_channels``, ...), so
a checkpoint that loads without hf-sms must have widths those arguments produce. :func:`fit_filters` searches each
such argument (a *knob*) for the smallest model whose every conv keeps at least the channels the soup needs, builds
it on the meta device to read its widths, and cuts the pruned model to exactly those widths: channels a knob cannot
drop stay as the all-zero filters they are, which changes no output.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .structured import shrink_filters

# Constructor arguments that size conv widths: True where a larger value gives wider convs (timm ResNet's
# ``block_reduce_first`` divides them). smp passes unknown keyword arguments on to a ``tu-`` (timm) encoder.
KNOBS = {
    "base_width": True,  # timm ResNet bottleneck width per 64 channels
    "stem_width": True,  # timm ResNet deep stems
    "block_reduce_first": False,  # timm ResNet: a block's first conv has planes // block_reduce_first filters
    "psp_out_channels": True,  # smp PSPNet
    "decoder_channels": True,  # smp DeepLabV3 (an int; Unet's tuple is not searched)
    "decoder_pyramid_channels": True,  # smp FPN
    "decoder_segmentation_channels": True,
}
_LARGEST = 1 << 14


@dataclass
class Rebuild:
    """How a family rebuilds ``model`` from its constructor arguments: ``build(overrides)`` (the arguments it has
    now with ``overrides``; an override of ``None`` drops that argument), and ``commit(model, overrides)`` to write
    chosen ones into its config."""

    build: Callable[[dict], nn.Module]
    arguments: dict
    commit: Callable[[nn.Module, dict], None]
    accepts: Callable[[str], bool]


def _merged(args: dict, overrides: dict) -> dict:
    return {k: v for k, v in {**args, **overrides}.items() if v is not None or k not in overrides}


def _timm(model: nn.Module) -> Rebuild | None:
    if not (type(model).__module__.startswith("timm.") and hasattr(model, "pretrained_cfg")):
        return None
    import timm

    name, args = model.pretrained_cfg.get("architecture"), dict(getattr(model, "_model_args", None) or {})
    if not name:
        return None
    parameters = inspect.signature(type(model).__init__).parameters

    def commit(m, overrides):
        m._model_args = {**(getattr(m, "_model_args", None) or {}), **overrides}  # what timm's save_for_hf writes

    def build(overrides):
        return timm.create_model(name, pretrained=False, **_merged(args, overrides))

    return Rebuild(build, args, commit, lambda k: k in parameters)


def _smp(model: nn.Module) -> Rebuild | None:
    config = getattr(model, "_hub_mixin_config", None)
    if not (type(model).__module__.startswith("segmentation_models_pytorch") and isinstance(config, dict)):
        return None
    args = {k: v for k, v in config.items() if not k.startswith("_")}
    parameters = inspect.signature(type(model).__init__).parameters
    timm_encoder = str(args.get("encoder_name", "")).startswith("tu-")

    def commit(m, overrides):
        m._hub_mixin_config.update(overrides)  # what smp's save_pretrained writes to config.json

    def build(overrides):
        return type(model)(**{**_merged(args, overrides), "encoder_weights": None})  # never download weights

    return Rebuild(build, args, commit, lambda k: k in parameters or timm_encoder)


REBUILDS: list[Callable[[nn.Module], Rebuild | None]] = [_timm, _smp]


def rebuild_of(model: nn.Module) -> Rebuild | None:
    """The :class:`Rebuild` of ``model``'s family, or ``None`` (a plain torch model is rebuilt from its code)."""
    return next((r for f in REBUILDS if (r := f(model)) is not None), None)


def _conv_widths(model: nn.Module) -> dict[str, int]:
    return {n: m.out_channels for n, m in model.named_modules() if isinstance(m, nn.modules.conv._ConvNd)}


def _built_widths(rebuild: Rebuild, overrides: dict) -> dict[str, int] | None:
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zero-width layers of a value too small say so; the search refuses them
            return _conv_widths(rebuild.build(overrides))
    except Exception:  # a value the constructor refuses (e.g. timm's BasicBlock asserts base_width == 64)
        return None


def _widths_by_arguments(rebuild: Rebuild) -> Callable[[dict], dict[str, int] | None]:
    """:func:`_built_widths` remembered per set of arguments: the search asks for the same ones again."""
    cache: dict[tuple, dict[str, int] | None] = {}

    def widths_of(overrides: dict) -> dict[str, int] | None:
        key = tuple(sorted(overrides.items()))
        if key not in cache:
            cache[key] = _built_widths(rebuild, overrides)
        return cache[key]

    return widths_of


def _search(widths_of, chosen: dict, knob: str, wider: bool, dense: dict, kept: dict) -> int | None:
    """The value of ``knob`` (beside the knobs ``chosen`` before it) giving the fewest channels with every conv
    between its kept and dense width."""

    def fits(value, top=False):
        widths = widths_of({**chosen, knob: value})
        if widths is None or widths.keys() != dense.keys():
            return False
        return all(kept[n] <= widths[n] for n in kept) and (not top or all(widths[n] <= dense[n] for n in dense))

    # fits() is monotone in the value: find where it turns, by doubling then bisection
    lo, hi = 0, 1
    while hi < _LARGEST and fits(hi) != wider:
        lo, hi = hi, hi * 2
    if hi >= _LARGEST:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) != wider else (lo, mid)
    value = hi if wider else lo
    return value if value > 0 and fits(value, top=True) else None


def _arguments(rebuild: Rebuild, widths_of, dense: dict, kept: dict) -> dict:
    """The knob values of the smallest model that holds ``kept`` (``{}`` where the arguments do not rebuild the
    model, or no knob makes it smaller)."""
    if widths_of({}) != dense:
        return {}
    overrides = {}
    for knob, wider in KNOBS.items():  # one after the other: timm's base_width and block_reduce_first both size a conv
        if rebuild.accepts(knob) and (value := _search(widths_of, overrides, knob, wider, dense, kept)) is not None:
            if widths_of({**overrides, knob: value}) != widths_of(overrides):
                overrides[knob] = value  # an argument that changes nothing is not written
    widths = widths_of(overrides)
    if widths is None or any(not kept[n] <= widths[n] <= dense[n] for n in kept):
        return {}  # knobs that do not combine: keep the dense widths
    return overrides


@torch.no_grad()
def fit_filters(model: nn.Module, example_inputs) -> tuple[nn.Module, dict]:
    """``model`` with its removed conv filters cut out down to widths its family's constructor arguments state
    (:data:`KNOBS`), and those arguments (``{}`` where none can be smaller); the copy's config says them, so its
    ``save_pretrained`` loads with plain timm / smp. A plain torch model gets every removable channel cut
    (:func:`shrink_filters`), since its code, not a config, rebuilds it."""
    rebuild = rebuild_of(model)
    if rebuild is None:
        return shrink_filters(model, example_inputs), {}
    dense, widths_of, chosen = _conv_widths(model), _widths_by_arguments(rebuild), {}

    def fitted(kept: dict[str, int]) -> dict[str, int]:  # called by shrink_filters with what its analysis keeps
        chosen.update(_arguments(rebuild, widths_of, dense, kept))
        widths = widths_of(chosen) if chosen else dense
        return {n: widths[n] for n in kept}

    smaller = shrink_filters(model, example_inputs, widths=fitted)
    if not chosen:  # the dense widths: nothing to state
        return smaller, chosen
    with torch.device("meta"):
        built = rebuild.build(chosen)
    if {k: v.shape for k, v in built.state_dict().items()} != {k: v.shape for k, v in smaller.state_dict().items()}:
        raise ValueError(
            f"fit_filters: {type(model).__name__} built with {chosen} has other shapes than its shrunk copy; "
            "please report it with the model's name"
        )
    rebuild.commit(smaller, chosen)
    return smaller, chosen


def dense_arguments(dense: nn.Module, smaller: nn.Module) -> dict:
    """``{knob: value in dense}`` for every knob whose value differs in ``smaller`` (``None``: the architecture's own
    default), from which :func:`rebuild_dense` gives the dense widths back."""
    a, b = rebuild_of(dense), rebuild_of(smaller)
    if a is None or b is None:
        return {}
    return {k: a.arguments.get(k) for k in KNOBS if a.arguments.get(k) != b.arguments.get(k)}


def rebuild_dense(smaller: nn.Module, arguments: dict) -> nn.Module | None:
    """A randomly initialised model of ``smaller``'s family with the knob values ``arguments`` (read from a
    checkpoint: only :data:`KNOBS`, integers or ``None``), or ``None`` if it has no :class:`Rebuild` or the
    arguments are not knobs."""
    rebuild = rebuild_of(smaller)
    ok = all(k in KNOBS and (v is None or (isinstance(v, int) and 0 < v < 2**20)) for k, v in arguments.items())
    if rebuild is None or not ok or not arguments:
        return None
    return rebuild.build(arguments)
