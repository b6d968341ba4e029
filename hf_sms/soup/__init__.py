"""Soups: one model from m candidates. A soup method is one file that registers a :class:`SoupMethod` in
:data:`hf_sms.registry.SOUPS` (uniform, greedy, reprune here); :func:`soup` runs any of them."""

from ..registry import import_submodules
from .averaging import Accumulator, average_tensors
from .greedy import greedy_select
from .method import SoupMethod, indicator_weights
from .soup import LocalWorld, average_state_dicts, check_same_masks, soup

__all__ = [
    "Accumulator",
    "LocalWorld",
    "SoupMethod",
    "average_state_dicts",
    "average_tensors",
    "check_same_masks",
    "greedy_select",
    "indicator_weights",
    "soup",
]

import_submodules(__name__, __path__)  # every file registers its entries: a new one needs no import line
