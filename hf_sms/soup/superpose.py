"""IMP-RePrune's merges that mitigate re-pruning (Yin et al. 2022a, "Sup-tickets"; docs/method.md §6): the
candidates join a running soup one at a time, which is magnitude-pruned back to the phase's sparsity after each.

- ``reprune_caa`` (cumulative arithmetic average, their CAA): the k-th joins with weight 1/k, so without the
  re-pruning the result would be the plain mean.
- ``reprune_cia`` (cumulative iterative moving average, their CIMA, which the SMS paper calls CIA): the k-th joins
  with weight ``decay`` (default 0.5, their ``--CIMA_factor``), an exponential moving average over the candidates.

Their code superposes each new ticket with the previous, already re-pruned superposition
(luuyin/Sup-tickets, ``CAA_average`` / ``CIMA_average``); the candidates' order here is the tracks' index order.
"""

from ..registry import SOUPS
from .method import Option, SoupMethod
from .uniform import uniform_weights

SOUPS.add("reprune_caa", SoupMethod(uniform_weights, same_mask=False, superpose=lambda k, options: 1.0 / k))
SOUPS.add(
    "reprune_cia",
    SoupMethod(
        uniform_weights,
        same_mask=False,
        superpose=lambda k, options: options["decay"],
        options=(Option("decay", 0.5, 0.0, 1.0, open_low=True, help="the weight each joining candidate gets"),),
    ),
)
