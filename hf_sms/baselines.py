"""Baselines reported beside SMS (docs/method.md §6), in a registry: ``fn(runner)`` runs one on a
:class:`hf_sms.sms.SparseModelSoup` and records its rows. A new baseline is one function and one line."""

from __future__ import annotations

from collections.abc import Callable

from .registry import registrar

BASELINES: dict[str, Callable] = {}
register_baseline = registrar(BASELINES, "baseline")


@register_baseline("imp")
def imp(runner) -> None:
    """IMP: m = 1, the same retraining per phase as one replica."""
    if "imp_reprune" not in runner.args.baselines:  # IMP-RePrune's first track is this IMP run
        runner.run_imp("imp", n_tracks=1)


@register_baseline("imp_mx")
def imp_mx(runner) -> None:
    """IMP_mx: m = 1, retrained with the compute SMS spends per phase (the sum over its replicas)."""
    runner.run_imp("imp_mx", n_tracks=1, times_m=True)


@register_baseline("imp_reprune")
def imp_reprune(runner) -> None:
    """IMP-RePrune: m independent IMP runs (their masks diverge), averaged and re-pruned after each phase."""
    runner.run_imp("imp", n_tracks=runner.args.num_replicas)
