"""The launcher's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) while a run uses replica groups.

Once replica groups exist they are hidden from accelerate, so that each replica's Trainer runs as a single process
(or data-parallel inside its own group) instead of over all N processes; when the outermost run returns or fails
they are put back, so the user's code after ``run_sms`` runs on every rank as the launcher set it up.
"""

from __future__ import annotations

import contextlib
import logging
import os

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE")
_saved: dict[str, str] = {}  # the launcher's variables while hidden
_runs = 0  # runs in progress in this process (nested: BIMP's cycles)


_MPI_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def one_of_several_asked() -> bool:
    """Whether ``accelerate launch --cpu --num_processes N`` (N > 1) started this one process alone: without
    ``--mpirun_hostfile`` accelerate runs the script once, with a rendezvous address (for N) but no rank or world
    size, where torchrun would start N processes."""
    accelerate_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1")
    launched = any(k in os.environ for k in ("WORLD_SIZE", "RANK", *_MPI_SIZES))
    return accelerate_cpu and "MASTER_ADDR" in os.environ and not launched


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def hide_launcher_env(use_cuda: bool, local_rank: int) -> None:
    """Hide the launcher's variables from accelerate (kept to be put back by :func:`restore_launcher_env`)."""
    # transformers warns that the process group is not used for DDP: here that is the point.
    logging.getLogger("transformers.training_args").addFilter(
        lambda record: "parallel_mode != ParallelMode.DISTRIBUTED" not in record.getMessage()
    )
    _saved.update({k: os.environ[k] for k in LAUNCHER_ENV if k in os.environ})
    for key in LAUNCHER_ENV:
        os.environ.pop(key, None)
    if use_cuda:
        os.environ["ACCELERATE_TORCH_DEVICE"] = f"cuda:{local_rank}"
    _reset_accelerate()


def restore_launcher_env() -> None:
    """Put back the launcher's variables that replica groups hid (nothing where none were, or inside a run)."""
    if _saved and _runs == 0:
        os.environ.update(_saved)
        _reset_accelerate()


@contextlib.contextmanager
def launcher_env_hidden(use_cuda: bool, local_rank: int):
    """Hidden inside (hidden again for a second run of the same loop), put back when the outermost run leaves."""
    global _runs
    if _saved and _runs == 0 and any(k in os.environ for k in _saved):
        hide_launcher_env(use_cuda, local_rank)
    _runs += 1
    try:
        yield
    finally:
        _runs -= 1
        restore_launcher_env()
