"""One phase step, for every trajectory: prune, retrain the replicas this process owns, score them on validation,
soup them, recalibrate (Algorithm 1's body; docs/method.md §1).

SMS, the pruning-during-training methods with SMS (GMP, DPF, BIMP) and the IMP baselines all describe a phase as
a :class:`PhaseSpec` and run it with :meth:`hf_sms.loop.sms.SparseModelSoup.run_phase` (or, the trajectories and
baselines as tracks, several phases at once: :mod:`hf_sms.loop.rounds`), which returns a :class:`PhaseResult`.
They differ only in what the spec says: one start and one broadcast mask for all replicas (SMS), or one start and
mask per replica (independent IMP tracks); which soup (a name in :data:`hf_sms.registry.SOUPS`), or none; and
per-replica trainer arguments (GMP's step window, DPF's masking).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..pruning.masks import PruningStep
from ..pruning.prunable import Masks


def phase_folder(run: str, index: int) -> str:
    """Where phase ``index`` (0-based) of the trajectory ``run`` keeps its replicas: ``run/phase{index + 1}``."""
    return f"{run}/phase{index + 1}"


@dataclass
class PhaseSpec:
    """What one phase does.

    Attributes:
        sparsity: the phase's target sparsity s_p.
        start: the model every replica starts from (pruned once, mask broadcast from rank 0), or ``{i: model}``
            per replica, each pruned on its own (independent tracks: no broadcast).
        masks: the previous phase's masks (``{i: masks}`` with per-replica starts); masks only grow.
        hparams: one config per replica (m = ``len(hparams)``).
        folder: the phase's folder inside the run folder (see :func:`phase_folder`); replica i is saved to
            ``folder/{member}{i}``.
        soup: the soup method (a name in ``SOUPS``), or ``None``: no soup, the candidates are the result.
        prune: prune at the start of the phase (``False``: train under the given masks only).
        exact_masks: the replicas end with the phase's mask (a finished replica loaded on resume is checked
            against it); ``False`` for replicas that move their mask (DPF).
        trainer_kwargs: ``fn(i) -> dict`` of extra :class:`~hf_sms.SparseSoupTrainer` arguments for replica i
            (callbacks, ``masking``, ``lr_schedule``, ``step_offset``, ``total_steps``).
    """

    sparsity: float
    start: nn.Module | dict[int, nn.Module]
    masks: Masks | dict[int, Masks] | None
    hparams: list
    folder: str
    soup: str | None = "uniform"
    prune: bool = True
    exact_masks: bool = True
    trainer_kwargs: Callable[[int], dict] = field(default=lambda i: {})
    member: str = "replica"  # "track" for independent IMP runs
    diagnosed: bool = True  # its diagnostics reach results.json (recorder.sms); False: a baseline's own phases
    also: tuple[str, ...] = ()  # more soups of the same candidates (IMP-RePrune's CIA/CAA beside its own)

    def replica_folder(self, i: int) -> str:
        return f"{self.folder}/{self.member}{i}"

    @property
    def shared(self) -> bool:
        """One start and one mask for all replicas (SMS), vs one per replica (IMP tracks)."""
        return not isinstance(self.start, dict)


@dataclass
class PhaseResult:
    """What a phase gave: the soup (``None`` without one), this process's candidates, every candidate's
    validation score, the candidates the soup kept, the pruning step(s) (``{i: step}`` per replica), the phase's
    wall-clock seconds and the process group of each replica (``None``: round robin)."""

    soup: nn.Module | None
    candidates: dict[int, nn.Module]
    val: list[float | None]
    kept: list[int]
    step: PruningStep | dict[int, PruningStep]
    seconds: float = 0.0
    owners: list[int] | None = None
    pairwise_l2: list[float] | None = None  # measured where the candidates are not whole models (subset replicas)
    rows: list[dict] | None = None  # a TrackJob's: the measured row of each of its phases
    pair_soups: list[dict] | None = None  # pairwise_soups: {"pair": [i, j], "val", "test", "tests"} per pair
    also: dict[str, nn.Module] = field(default_factory=dict)  # PhaseSpec.also's soups, by method
    # the candidates' test scores and diversity (Recorder.candidate_scores), measured before their soup was written
    # into the start their weights share (subset replicas); None: measured from ``candidates`` when recorded
    scored: dict | None = None

    @property
    def masks(self):
        if isinstance(self.step, dict):
            return {i: s.masks for i, s in self.step.items()}
        return self.step.masks


@dataclass
class TrackJob:
    """A whole independent track as one job of a round (hf_sms.loop.rounds): a track with no soup and nothing shared
    between its phases (IMP, IMP_mx) trains every phase in turn on one process group, beside the other tracks'
    rounds, and measures its rows there; the round hands them to the track (``PhaseResult.rows``).

    Attributes:
        folder: the track's folder (``imp_mx``), its name in the recorded jobs.
        hparams: one config per phase (what the schedule counts as its cost).
        run: ``fn() -> [row of each phase]``, called on the group that owns the job.
    """

    folder: str
    hparams: list
    run: Callable[[], list]

    def replica_folder(self, i: int) -> str:
        return self.folder
