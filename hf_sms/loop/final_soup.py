"""The final soup's folder: a sparse checkpoint, or, when whole units were pruned, the smaller model."""

from __future__ import annotations

import copy
import logging

from torch import nn
from torch.utils.data import DataLoader

from ..checkpoint import load_sparse, save_sparse
from ..shrinking.shrink import same_outputs

logger = logging.getLogger(__name__)


def other_batches(dataset, batch_size: int, collate, n: int = 2) -> list:
    """Up to ``n`` batches of ``dataset`` after its first (the one units are traced and checked on)."""
    batches = iter(DataLoader(dataset, batch_size, collate_fn=collate))
    next(batches, None)
    return [b for _, b in zip(range(n), batches)]


def save_final_soup(
    soup: nn.Module, directory: str, *, dense: nn.Module, plan, example, recipe: dict, checks=(), **kwargs
) -> str:
    """Save what ``plan`` makes of ``soup`` (:meth:`hf_sms.plan.PruningPlan.final`) to ``directory``: a bitmask
    checkpoint for weight structures; for units the smaller model in its family's own dense format, its recipe
    saying what was cut (``recipe["shrunk"]``: units removed, parameters against ``dense``).

    The smaller folder is kept only if it loads back as a user would load it: by its family from its own config,
    or, where the config cannot state its widths (:attr:`hf_sms.checkpoint.shrink_record.ShrinkRecord.cut_in_place`), by
    :func:`hf_sms.load_sparse`, which cuts the model its family (or a template, for plain torch) builds to the
    stored widths, and gives the soup's outputs on the batches in ``checks`` too (other data than ``example``: a
    branch the traced batch did not take). Else the pruned soup is saved as a bitmask checkpoint, and the recipe
    says why. ``example`` is a batch (units are traced and outputs checked on it); ``kwargs`` go to
    :func:`hf_sms.save_sparse`.
    """
    final = plan.final(soup, dense, example)
    if final.shrunk is None:
        return save_sparse(final.model, directory, final.fmt, recipe=recipe, **kwargs)
    if not final.shrunk.smaller:
        logger.warning("[hf-sms] the final soup is saved as the pruned model, not a smaller one: %s", final.shrunk.why)
        return save_sparse(soup, directory, recipe={**recipe, "shrunk": final.shrunk.to_json()}, **kwargs)
    template = copy.deepcopy(dense) if final.shrunk.cut_in_place else None  # its code builds it
    recipe = {**recipe, "shrunk": final.shrunk.to_json()}
    save_sparse(final.model, directory, final.fmt, recipe=recipe, example_inputs=example, **kwargs)
    try:
        loaded = load_sparse(directory, model=template)  # as a user loads it: its own config, or hf-sms's cut
    except (ValueError, RuntimeError) as e:
        loaded, why = None, f"it does not load back as saved ({str(e)[:200]})"
    if loaded is not None:
        try:
            if all(same_outputs(soup, loaded, b) for b in checks):
                return directory
            detail = ""
        except (ValueError, RuntimeError, IndexError) as e:
            detail = f": {str(e)[:160]}"
        why = "its outputs are not the soup's on another validation batch (a branch its traced batch did not take)"
        why += detail
    logger.warning("[hf-sms] the final soup is saved as the pruned model, not the smaller one: %s", why)
    return save_sparse(soup, directory, recipe={**recipe, "shrunk": final.shrunk.as_pruned(why).to_json()}, **kwargs)
