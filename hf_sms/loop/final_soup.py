"""The final soup's folder: a sparse checkpoint, or, when whole units were pruned, the smaller model."""

from __future__ import annotations

import copy
import logging

from torch import nn

from ..checkpoint import load_sparse, save_sparse

logger = logging.getLogger(__name__)


def save_final_soup(soup: nn.Module, directory: str, *, dense: nn.Module, plan, example, recipe: dict, **kwargs) -> str:
    """Save what ``plan`` makes of ``soup`` (:meth:`hf_sms.plan.PruningPlan.final`) to ``directory``: a bitmask
    checkpoint for weight structures; for units the smaller model in its family's own dense format, its recipe
    saying what was cut (``recipe["shrunk"]``: units removed, parameters against ``dense``).

    The smaller folder is kept only if it loads back as a user would load it: by its family from its own config,
    or, where the config cannot state its widths (``recipe["shrunk"]["cut"] == "in place"``), by
    :func:`hf_sms.load_sparse`, which cuts the model its family (or a template, for plain torch) builds to the
    stored widths. Else the pruned soup is saved as a bitmask checkpoint, and the recipe says why. ``example`` is a
    batch (units are traced and outputs checked on it); ``kwargs`` go to :func:`hf_sms.save_sparse`.
    """
    final = plan.final(soup, dense, example)
    if final.shrunk is None:
        return save_sparse(final.model, directory, final.fmt, recipe=recipe, **kwargs)
    if final.shrunk.get("saved") != "smaller":
        why = final.shrunk.get("why", "")
        logger.warning("[hf-sms] the final soup is saved as the pruned model, not a smaller one: %s", why)
        return save_sparse(soup, directory, recipe={**recipe, "shrunk": final.shrunk}, **kwargs)
    template = copy.deepcopy(dense) if final.shrunk.get("cut") == "in place" else None  # its code builds it
    save_sparse(final.model, directory, final.fmt, recipe={**recipe, "shrunk": final.shrunk}, **kwargs)
    try:
        load_sparse(directory, model=template)  # as a user loads it: the family's own config, or hf-sms's cut
        return directory
    except (ValueError, RuntimeError) as e:
        why = f"it does not load back as saved ({str(e)[:200]})"
    logger.warning("[hf-sms] the final soup is saved as the pruned model, not the smaller one: %s", why)
    return save_sparse(
        soup, directory, recipe={**recipe, "shrunk": {**final.shrunk, "saved": "pruned", "why": why}}, **kwargs
    )
