"""The final soup's folder: a sparse checkpoint, or, when whole units were pruned, a plain smaller model."""

from __future__ import annotations

import logging

from torch import nn

from ..checkpoint import load_sparse, save_sparse
from ..checkpoint.families import family_of_model
from ..pruning.shrink import shrink, shrink_record
from ..pruning.structures import is_unit_structure

logger = logging.getLogger(__name__)


def save_final_soup(
    soup: nn.Module, directory: str, *, dense: nn.Module, structure: str, example, recipe: dict, **kwargs
) -> str:
    """Save ``soup`` to ``directory``: with unstructured or n:m sparsity as a bitmask checkpoint; with units
    (filters, neurons, heads) cut out by :func:`hf_sms.shrink` in the family's own dense format, which loads
    without hf-sms, its recipe saying what was cut (``recipe["shrunk"]``: units removed, parameters against
    ``dense``).

    The smaller folder is kept only if the family rebuilds it from its own config (loaded back here as a user
    would); a family that cannot say the smaller widths (a plain torch model, a timm ResNet whose filters differ per
    layer) gets the pruned model as a bitmask checkpoint instead, and the recipe says why. ``example`` is a batch
    (shrink follows conv channels and checks outputs on it); ``kwargs`` go to :func:`hf_sms.save_sparse`.
    """
    if not is_unit_structure(structure):
        return save_sparse(soup, directory, recipe=recipe, **kwargs)
    try:
        smaller = shrink(soup, example, structure=structure)
    except (NotImplementedError, ValueError) as e:  # fx cannot follow its channels; a layer shrink gets wrong
        why = f"hf_sms.shrink could not make it smaller ({str(e)[:200]})"
        logger.warning("[hf-sms] the final soup is saved as the pruned model, not a smaller one: %s", why)
        return save_sparse(soup, directory, recipe={**recipe, "shrunk": {"saved": "pruned", "why": why}}, **kwargs)
    record = shrink_record(dense, soup, smaller, structure)
    if family_of_model(smaller).library == "torch":
        why = (
            "a plain torch model is rebuilt from its code, not from a config; hf_sms.shrink(model, batch) after loading"
        )
    else:
        save_sparse(smaller, directory, "dense", recipe={**recipe, "shrunk": {**record, "saved": "smaller"}}, **kwargs)
        try:
            load_sparse(directory)  # from the folder's own config and weights, strictly
            return directory
        except (ValueError, RuntimeError) as e:
            why = f"its family's config cannot express the smaller widths ({str(e)[:200]})"
    logger.warning("[hf-sms] the final soup is saved as the pruned model, not the smaller one: %s", why)
    return save_sparse(
        soup, directory, recipe={**recipe, "shrunk": {**record, "saved": "pruned", "why": why}}, **kwargs
    )
