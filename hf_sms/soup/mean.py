"""The plain mean of candidates whatever their masks, left as it is: DPF's copies keep dense weights, and their
mean is what the next pruning step masks (docs/method.md §7)."""

from ..registry import SOUPS
from .method import SoupMethod
from .uniform import uniform_weights

SOUPS.add("mean", SoupMethod(uniform_weights, same_mask=False, reprune=False))
