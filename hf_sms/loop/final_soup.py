"""The final soup's folder: a sparse checkpoint, or, when whole units were pruned, a plain smaller model."""

from __future__ import annotations

from torch import nn

from ..checkpoint import save_sparse
from ..pruning.shrink import shrink, shrink_record
from ..pruning.structures import is_unit_structure


def save_final_soup(
    soup: nn.Module, directory: str, *, dense: nn.Module, structure: str, example, recipe: dict, **kwargs
) -> str:
    """Save ``soup`` to ``directory``: with unstructured or n:m sparsity as a bitmask checkpoint; with units
    (filters, neurons, heads) cut out by :func:`hf_sms.shrink` as the family's own dense format, which loads
    without hf-sms, its recipe saying what was cut (``recipe["shrunk"]``: units removed, parameters against
    ``dense``). ``example`` is a batch (shrink follows conv channels and checks outputs on it); ``kwargs`` go to
    :func:`hf_sms.save_sparse`."""
    if not is_unit_structure(structure):
        return save_sparse(soup, directory, recipe=recipe, **kwargs)
    smaller = shrink(soup, example)
    recipe = {**recipe, "shrunk": shrink_record(dense, soup, smaller, structure)}
    return save_sparse(smaller, directory, "dense", recipe=recipe, **kwargs)
