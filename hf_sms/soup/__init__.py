"""Soups: one model from m candidates. A soup method is one file that registers a :class:`SoupMethod` in
:data:`hf_sms.registry.SOUPS` (uniform, greedy, reprune here); :func:`soup` runs any of them."""

from . import greedy, mean, reprune, uniform  # noqa: F401  (each registers its soup method)
from .averaging import Accumulator, average_tensors
from .greedy import greedy_select
from .method import SoupMethod, indicator_weights
from .soup import LocalWorld, average_state_dicts, check_same_masks, greedy_soup, soup, uniform_soup

__all__ = [
    "Accumulator",
    "LocalWorld",
    "SoupMethod",
    "average_state_dicts",
    "average_tensors",
    "check_same_masks",
    "greedy_select",
    "greedy_soup",
    "indicator_weights",
    "soup",
    "uniform_soup",
]
