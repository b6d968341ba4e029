"""``SparseSoupConfig.soup_options`` checked before any training: each soup method's declared options
(:class:`hf_sms.soup.method.Option`), looked up in the registry (which imports the soup methods when first asked)."""

from __future__ import annotations

import json

from ..registry import SOUPS

# the soups IMP-RePrune's baselines make of its m tracks (hf_sms.baselines.imp); their options go in soup_options too
REPRUNE_SOUPS = {"imp_reprune": "reprune", "imp_reprune_cia": "reprune_cia", "imp_reprune_caa": "reprune_caa"}


def resolve_soup_options(config) -> dict[str, dict[str, float]]:
    """``config.soup_options`` (a dict, or its JSON text from the command line) checked against the options each
    method in ``config.merge_methods`` (or made by a baseline) declares, defaults filled in; raises before any
    training."""
    given = getattr(config, "soup_options", None) or {}
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as e:
            raise ValueError(f'soup_options must be JSON such as \'{{"ties": {{"density": 0.2}}}}\' ({e})') from None
    if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
        raise ValueError(
            f'soup_options maps a soup method to its options, e.g. {{"ties": {{"density": 0.2}}}}; got {given!r}'
        )
    used = list(config.merge_methods) + [s for b, s in REPRUNE_SOUPS.items() if b in (config.baselines or ())]
    stray = sorted(set(given) - set(used))
    if stray:
        raise ValueError(
            f"soup_options names {stray}, which this run does not run (merge_methods={config.merge_methods}, and the "
            "soups of the baselines asked for)"
        )
    bare = [m for m in used if given.get(m) and not SOUPS.get(m).options]
    if bare:
        raise ValueError(f"soup_options gives {bare[0]} {given[bare[0]]}, but {bare[0]} takes no options: leave it out")
    return {m: SOUPS.get(m).resolve(m, given.get(m)) for m in used if SOUPS.get(m).options}
