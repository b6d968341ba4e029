"""The final soup's folder: a sparse checkpoint, or, when whole units were pruned, the smaller model."""

from __future__ import annotations

import logging

from torch import nn

from ..checkpoint import load_sparse, save_sparse
from ..checkpoint.families import family_of_model

logger = logging.getLogger(__name__)


def save_final_soup(soup: nn.Module, directory: str, *, dense: nn.Module, plan, example, recipe: dict, **kwargs) -> str:
    """Save what ``plan`` makes of ``soup`` (:meth:`hf_sms.plan.PruningPlan.final`) to ``directory``: a bitmask
    checkpoint for weight structures; for units the smaller model in its family's own dense format, which loads
    without hf-sms, its recipe saying what was cut (``recipe["shrunk"]``: units removed, parameters against
    ``dense``).

    The smaller folder is kept only if it loads back as a user would load it (its family from its own config, or
    hf-sms for a plain torch model with a template); else the pruned soup is saved as a bitmask checkpoint, and the
    recipe says why. ``example`` is a batch (units are traced and outputs checked on it); ``kwargs`` go to
    :func:`hf_sms.save_sparse`.
    """
    final = plan.final(soup, dense, example)
    if final.shrunk is None:
        return save_sparse(final.model, directory, final.fmt, recipe=recipe, **kwargs)
    if final.shrunk.get("saved") != "smaller":
        why = final.shrunk.get("why", "")
        logger.warning("[hf-sms] the final soup is saved as the pruned model, not a smaller one: %s", why)
        return save_sparse(soup, directory, recipe={**recipe, "shrunk": final.shrunk}, **kwargs)
    if family_of_model(final.model).library == "torch":
        why = (
            "a plain torch model is rebuilt from its code, not from a config; hf_sms.shrink(model, batch) after loading"
        )
    else:
        save_sparse(final.model, directory, final.fmt, recipe={**recipe, "shrunk": final.shrunk}, **kwargs)
        try:
            load_sparse(directory)  # from the folder's own config and weights, strictly
            return directory
        except (ValueError, RuntimeError) as e:
            why = f"its family's config cannot express the smaller widths ({str(e)[:200]})"
    logger.warning("[hf-sms] the final soup is saved as the pruned model, not the smaller one: %s", why)
    return save_sparse(
        soup, directory, recipe={**recipe, "shrunk": {**final.shrunk, "saved": "pruned", "why": why}}, **kwargs
    )
