"""The mean of candidates whose masks differ, magnitude-pruned back to the phase's sparsity: IMP-RePrune's merge of
independent IMP runs, and the merge of DPF's copies (each moves its own mask) (docs/method.md §6, §7)."""

from ..registry import SOUPS
from .method import SoupMethod
from .uniform import uniform_weights

SOUPS.add("reprune", SoupMethod(uniform_weights, same_mask=False))
