"""The record of a structured soup in its ``sparsity.json`` (``recipe["shrunk"]``), typed: written where the final
soup is cut (``hf_sms.plan.structures``, ``hf_sms.shrinking.shrink_record``), read by ``load_sparse``, the model card,
the transformers check and ``hf-sms speed``. Torch-free, as the rest of the schema: ``hf-sms inspect`` reads it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SMALLER, PRUNED = "smaller", "pruned"  # what was saved: the plain smaller model, or the pruned one (and why)
BY_CONFIG, IN_PLACE = "config", "in place"  # how: its family's config states the widths, or a cut


_TYPES = {  # what a field read from a file must be
    "structure": str,
    "cut": str,
    "units": dict,
    "dense_config": dict,
    "zero_units_kept": dict,
    "parameters": int,
    "dense_parameters": int,
    "parameter_ratio": (int, float),
    "why": str,
    "plain": str,
    "program_inputs": list,
}


@dataclass(frozen=True)
class ShrinkRecord:
    """What became of a structured soup.

    Attributes:
        saved: :data:`SMALLER` (a model with whole units cut out) or :data:`PRUNED` (the pruned model, ``why``).
        structure: the unit kinds cut (``"neurons+heads"``).
        cut: :data:`BY_CONFIG` (loads with its own library) or :data:`IN_PLACE` (``hf_sms.load_sparse`` cuts the
            model its family or a template builds to the stored widths).
        units: ``{kind: {"sparsity", ...}}`` measured on the pruned model.
        dense_config: the config values of the dense shapes (``hf-sms speed`` rebuilds them).
        zero_units_kept: removed units kept as zeros where the config cannot state a smaller width.
        parameters, dense_parameters, parameter_ratio: the smaller model's parameters against the dense one's.
        why: why the pruned model was saved instead.
        plain: a smaller model cut in place: the route that loads it without hf-sms (``"timm"``: timm's
            ``adapt_model_from_string`` widths in ``pruned.txt``; ``"torch.export"``: ``model.pt2``), or ``None``.
        program_inputs: the names ``model.pt2``'s forward takes its inputs by (``None``: one tensor, positional).
    """

    saved: str
    structure: str | None = None
    cut: str | None = None
    units: dict | None = None
    dense_config: dict | None = None
    zero_units_kept: dict | None = None
    parameters: int | None = None
    dense_parameters: int | None = None
    parameter_ratio: float | None = None
    why: str | None = None
    plain: str | None = None
    program_inputs: list | None = None

    @property
    def smaller(self) -> bool:
        return self.saved == SMALLER

    @property
    def cut_in_place(self) -> bool:
        """A smaller model whose widths its family's config cannot state: only ``hf_sms.load_sparse`` rebuilds it."""
        return self.smaller and self.cut == IN_PLACE

    def as_pruned(self, why: str) -> ShrinkRecord:
        """The record of saving the pruned model instead, saying why."""
        return dataclasses.replace(self, saved=PRUNED, why=why)

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def of(cls, info) -> ShrinkRecord | None:
        """The record in a ``sparsity.json``'s contents (a dict read from any folder: entries of the wrong type are
        left out, unknown ones ignored), or None where there is none."""
        recipe = info.get("recipe") if isinstance(info, dict) else None
        shrunk = recipe.get("shrunk") if isinstance(recipe, dict) else None
        if not isinstance(shrunk, dict) or not isinstance(shrunk.get("saved"), str):
            return None
        ok = {k: v for k, v in shrunk.items() if k in _TYPES and isinstance(v, _TYPES[k]) and not isinstance(v, bool)}
        return cls(saved=shrunk["saved"], **ok)
