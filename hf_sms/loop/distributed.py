"""Replica parallelism: the m replicas of a phase train at once on N processes (torchrun, accelerate launch).

The paper's point is that the m retraining runs of a phase are independent. With N processes:

- N <= m: process groups of one;
- N = k * m: m groups of k processes; each replica is data-parallel over its own group.

Which group trains which replica is round robin, or the schedule's choice for a round (:meth:`ReplicaWorld.assigned`,
hf_sms.loop.rounds); with ``share_idle_groups`` a job may be data-parallel over several groups
(:meth:`ReplicaWorld.joined`).

Replicas never synchronise gradients with each other. Masks are computed once and broadcast from
rank 0; soups are formed with collectives (all-reduce of a flat float64 buffer; gathered scores),
so no shared filesystem is needed across nodes. A single process without a launcher is the
world of size 1 that trains every replica in turn: the same code path, no torch.distributed.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import functools
import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..pruning.masks import PackedMasks
from ..pruning.prunable import Masks
from ..soup.averaging import Accumulator, flat, pieces
from .launcher import hide_launcher_env, launcher_env_hidden, one_of_several_asked

StateDict = dict[str, torch.Tensor]


def launched_world_size() -> int:
    return (
        dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    )


@functools.cache
def _close_at_exit() -> None:
    # Nobody else closes the group (accelerate does not): a process that exits with it open can abort
    # ("terminate called without an active exception") when gloo's threads outlive the interpreter.
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


class GroupWorld:
    """The processes of one replica group (``size``, ``rank``, ``is_main``, ``all_gather``, as a world)."""

    def __init__(self, size: int, rank: int, group=None):
        self.size, self.rank, self.is_main, self._group = size, rank, rank == 0, group

    def all_gather(self, value) -> list:
        if self.size == 1:
            return [value]
        parts: list = [None] * self.size
        dist.all_gather_object(parts, value, group=self._group)
        return parts


class ReplicaWorld:
    """Who trains which replica, and the collectives that merge them.

    Args:
        num_replicas: m, the replicas of a phase.
        cpu: use gloo on CPU tensors (else nccl on this process's GPU); one process: sum on the CPU, else on its
            GPU where there is one.
    """

    def __init__(self, num_replicas: int, cpu: bool = False):
        self.size = launched_world_size()
        self.rank, self.group_size, self.group_rank, self.subgroup = 0, 1, 0, None
        self.device = torch.device("cpu")
        self.assignment: list[int] | None = None  # the group of each replica of the phase being run (assigned())
        self._waiting, self._joined = None, {}
        self._use_cuda, self._local_rank = False, 0
        if self.size == 1:  # soups and sums where the run trains (a GPU's, not copied through the CPU)
            if one_of_several_asked():
                logging.getLogger("hf_sms").warning(
                    "[hf-sms] accelerate launch --cpu --num_processes N started one process (several CPU processes "
                    "need MPI: --mpirun_hostfile): this process trains every replica in turn. For N CPU processes "
                    "without MPI: torchrun --nproc_per_node N SCRIPT"
                )
            self.n_groups, self.group_index = 1, 0
            if not cpu and torch.cuda.is_available():
                self.device = torch.device("cuda", torch.cuda.current_device())
            return
        if self.size > num_replicas and self.size % num_replicas:
            raise ValueError(
                f"{self.size} processes cannot share num_replicas={num_replicas} evenly: launch at most m processes "
                f"(each trains several replicas in turn) or a multiple of m (each replica data-parallel over k)"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = not cpu and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        if not dist.is_initialized():  # accelerate often opened it already, when the config was built
            dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        _close_at_exit()
        self.rank = dist.get_rank()
        k = self.size // num_replicas if self.size > num_replicas else 1
        self.group_size, self.n_groups = k, self.size // k
        self.group_index, self.group_rank = divmod(self.rank, k)
        if k > 1:  # every rank must create every group, in the same order
            groups = [dist.new_group(list(range(g * k, (g + 1) * k))) for g in range(self.n_groups)]
            self.subgroup = groups[self.group_index]
        # A group that finished its jobs waits here for the others, which may train for hours: a barrier on a gloo
        # group with no practical timeout (the backend's own, 10-30 min, would end the run).
        self._waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=30))
        self._use_cuda, self._local_rank = use_cuda, local_rank
        hide_launcher_env(use_cuda, local_rank)

    def launcher_env_hidden(self):
        """The launcher's variables hidden inside, put back when the outermost run leaves (:mod:`.launcher`)."""
        return launcher_env_hidden(self._use_cuda, self._local_rank)

    # -- who does what -----------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """The one process that writes run-level files (results.json, run.json, the final soup)."""
        return self.rank == 0

    @property
    def is_group_main(self) -> bool:
        """The process that writes its group's replica checkpoints and contributes them to merges."""
        return self.group_rank == 0

    def owner_group(self, i: int) -> int:
        """The group that trains replica ``i``: as :meth:`assigned` says, else round robin."""
        return self.assignment[i] if self.assignment is not None else i % self.n_groups

    def owned(self, n: int) -> list[int]:
        """Indices of the ``n`` replicas this process's group trains."""
        return [i for i in range(n) if self.owner_group(i) == self.group_index]

    @contextlib.contextmanager
    def assigned(self, groups: list[int] | None):
        """Replica ``i`` belongs to group ``groups[i]`` inside this block (the schedule's choice for one phase)."""
        before, self.assignment = self.assignment, groups
        try:
            yield self
        finally:
            self.assignment = before

    def join(self, groups: list[list[int]]) -> None:
        """Make the process groups that train a job over several groups (every process calls this alike)."""
        for ranks in sorted({self._ranks(g) for g in groups if len(g) > 1}):
            if ranks not in self._joined:  # one for training, one to wait on (however long) before it starts
                waiting = dist.new_group(list(ranks), backend="gloo", timeout=datetime.timedelta(days=30))
                self._joined[ranks] = (dist.new_group(list(ranks)), waiting)

    def _ranks(self, groups: list[int]) -> tuple[int, ...]:
        return tuple(r for g in sorted(groups) for r in range(g * self.group_size, (g + 1) * self.group_size))

    @contextlib.contextmanager
    def joined(self, groups: list[int]):
        """Inside this block the processes of ``groups`` are one group: a job trained data-parallel over them
        (:meth:`join` made it). The block starts when all of them are here."""
        if len(groups) == 1:
            yield self
            return
        ranks = self._ranks(groups)
        subgroup, waiting = self._joined[ranks]
        dist.barrier(group=waiting)
        before = (self.group_size, self.group_rank, self.subgroup)
        self.group_size, self.group_rank, self.subgroup = len(ranks), ranks.index(self.rank), subgroup
        try:
            yield self
        finally:
            self.group_size, self.group_rank, self.subgroup = before

    def _owner_rank(self, i: int) -> int:
        return self.owner_group(i) * self.group_size  # the owner group's main rank

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def wait(self) -> None:
        """Wait, however long, until every process gets here (groups that finished their jobs wait for the rest)."""
        if self.size > 1:
            dist.barrier(group=self._waiting)

    @property
    def group(self) -> GroupWorld:
        """This process's replica group as a world of its own: the processes that hold the same replica share
        its evaluation and BatchNorm pass."""
        return GroupWorld(self.group_size, self.group_rank, self.subgroup)

    # -- collectives -------------------------------------------------------------------------------
    def broadcast_masks(self, masks: Masks) -> Masks:
        """Rank 0's masks on every rank (masks must never differ across ranks, whatever the seeds)."""
        if self.size == 1:
            return masks
        if isinstance(masks, PackedMasks):  # as bits: a sixteenth of a bf16 model, never a bool tensor per weight
            packed = [t.to(self.device).contiguous() for t in masks.packed.values()]
            for t in packed:
                dist.broadcast(t, src=0)
            return PackedMasks(
                masks.names, masks.shapes.values(), [t.to(o.device) for t, o in zip(packed, masks.packed.values())]
            )
        out = {}
        for name, mask in masks.items():
            t = mask.to(self.device, torch.uint8).contiguous()
            dist.broadcast(t, src=0)
            out[name] = t.to(mask.device).bool()
        return out

    @torch.no_grad()
    def broadcast_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Rank 0's weights on every rank: ``model`` itself where they agree, else a copy holding rank 0's.

        Every replica must start from the same model. A head initialised at random (a new ``num_classes``) or
        a model built before seeding differs per process, and replicas of different models average to
        nothing useful; the user's object is never changed.
        """
        if self.size == 1:
            return model
        state = model.state_dict()
        received = {}
        for name, value in state.items():
            t = value.detach().to(self.device)
            t = (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous().clone()
            dist.broadcast(t, src=0)
            received[name] = t.to(value.device, value.dtype)
        differs = [None] * self.size
        dist.all_gather_object(differs, any(not torch.equal(received[k], v) for k, v in state.items()))
        if not any(differs):
            return model
        if self.is_main:
            logging.getLogger("hf_sms").warning(
                "[hf-sms] the starting model differs between processes (a randomly initialised layer, or a model "
                "built before seeding): every process uses rank 0's weights. Seed before building the model, or "
                "load it from one checkpoint, to silence this."
            )
        if differs[self.rank]:
            model = copy.deepcopy(model)
            model.load_state_dict(received)
        return model

    def all_gather(self, value) -> list:
        """Every process's ``value``, by rank (evaluation shared by all processes, hf_sms.evaluation.sharded)."""
        if self.size == 1:
            return [value]
        parts: list = [None] * self.size
        dist.all_gather_object(parts, value)
        return parts

    def gather(self, local: dict[int, object]) -> dict[int, object]:
        """Union of every group's ``{replica index: value}`` (group mains contribute)."""
        if self.size == 1:
            return dict(local)
        parts: list = [None] * self.size
        dist.all_gather_object(parts, local if self.is_group_main else {})
        return {i: v for part in parts for i, v in part.items()}

    @torch.no_grad()
    def average(
        self,
        local: dict[int, StateDict],
        weights: Sequence[float],
        template: StateDict,
        into: StateDict | None = None,
    ) -> StateDict:
        """Weighted mean of the replicas' state dicts (one weight per replica, 0 leaves it out), whichever
        process holds them; written into ``into``'s tensors where given (a model's ``state_dict()``: no second copy).

        The averaging kernel (:class:`hf_sms.soup.averaging.Accumulator`) piece by piece (at most ``BUCKET``
        elements, a large tensor split): each group main adds its replicas, one all-reduce sums the parts; integer
        buffers come from the first replica with a nonzero weight.
        """
        floats = [k for k, v in template.items() if v.is_floating_point()]
        ints = tuple(k for k, v in template.items() if not v.is_floating_point())
        first = next(i for i, w in enumerate(weights) if w)
        mine = [i for i, w in enumerate(weights) if w and i in local] if self.is_group_main else []
        # the result's tensors: ``into``'s, a new one where one of those is not contiguous (copied into it at the end)
        out = {}
        for k, v in template.items():
            given = into[k] if into is not None else None
            fresh = given is None or not given.is_contiguous()
            out[k] = torch.empty_like(v, memory_format=torch.contiguous_format) if fresh else given
        # float64 sums and copies of one piece at a time, never of a whole model or tensor
        for piece in pieces(template, floats):
            acc = Accumulator(torch.empty(sum(hi - lo for _, lo, hi in piece)), self.device)
            for i in mine:
                acc.add(torch.cat([local[i][k].reshape(-1)[lo:hi] for k, lo, hi in piece]), weights[i])
            if self.size > 1:
                dist.all_reduce(acc.total)
            offset = 0
            for k, lo, hi in piece:  # cast each slice from the float64 sum, as Accumulator.result does
                out[k].view(-1)[lo:hi].copy_(acc.total[offset : offset + hi - lo])
                offset += hi - lo
        if ints:
            acc = Accumulator(flat(template, ints), self.device)
            if first in mine:
                acc.add(flat(local[first], ints))
            if self.size > 1:
                dist.all_reduce(acc.total)
            offset = 0
            for k in ints:
                n = template[k].numel()
                out[k].copy_(acc.total[offset : offset + n].view(template[k].shape))
                offset += n
        if into is not None:
            for k in template:
                if out[k] is not into[k]:
                    into[k].copy_(out[k])
        return {k: (into if into is not None else out)[k] for k in template}

    @torch.no_grad()
    def all_candidates(self, local: dict[int, StateDict], n: int, template: StateDict) -> dict[int, StateDict]:
        """Every one of the ``n`` replicas' state dicts on every process, each sent by its owner (for soups that
        are not a weighted mean and need all candidates' tensors at once)."""
        return {i: self.from_owner(local, i, template) for i in range(n)}

    @torch.no_grad()
    def from_owner(self, local: dict[int, StateDict], i: int, template: StateDict) -> StateDict:
        """Replica ``i``'s state dict on every process, sent by its owner (``local`` holds it there)."""
        if self.size == 1:
            return local[i]
        owner = self._owner_rank(i)
        state = {}
        for k, like in template.items():
            t = local[i][k] if self.rank == owner else torch.empty_like(like)
            t = t.to(self.device)
            t = (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()
            dist.broadcast(t, src=owner)
            state[k] = t.to(like.device, like.dtype)
        return state

    def object_from_owner(self, local: dict[int, object], i: int):
        """Replica ``i``'s picklable ``local[i]`` (e.g. its pruning step) on every process, sent by its owner."""
        if self.size == 1:
            return local[i]
        box = [local.get(i) if self.rank == self._owner_rank(i) else None]
        dist.broadcast_object_list(box, src=self._owner_rank(i))
        return box[0]

    @torch.no_grad()
    def sum_tensors(self, local: dict[int, torch.Tensor], shape, dtype=torch.float64) -> torch.Tensor:
        """Sum of per-replica tensors (e.g. predicted probabilities for the ensemble) across processes."""
        total = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.is_group_main:
            for t in local.values():
                total += t.to(self.device, dtype)
        if self.size > 1:
            dist.all_reduce(total)
        return total.cpu()

    @torch.no_grad()
    def pairwise_l2(self, local: dict[int, torch.nn.Module], n: int, like: torch.nn.Module) -> list[float]:
        """L2 distance between every pair of the ``n`` replicas (models shaped like ``like``), i < j order; one
        piece of at most ``BUCKET`` elements at a time (float64 copies of a piece, never of a whole model or
        tensor)."""
        shapes = dict(like.named_parameters())
        params = {i: dict(m.named_parameters()) for i, m in local.items()}
        sq = {(i, j): 0.0 for j in range(n) for i in params if i < j}
        for piece in pieces(shapes, list(shapes)):
            flats = {
                i: torch.cat([ps[k].detach().reshape(-1)[lo:hi].double() for k, lo, hi in piece])
                for i, ps in params.items()
            }
            size = sum(hi - lo for _, lo, hi in piece)
            for j in range(n):  # the owner of j shares it; every group measures its own replicas against it
                ref = self._from_owner(flats.get(j), j, size)
                for i in flats:
                    if i < j:
                        sq[i, j] += float((flats[i] - ref.to(flats[i].device)).square_().sum())
        dists = self.gather({key: v**0.5 for key, v in sq.items()})
        return [dists[(i, j)] for i in range(n) for j in range(i + 1, n)]

    def _from_owner(self, tensor: torch.Tensor | None, replica: int, numel: int) -> torch.Tensor:
        if self.size == 1:
            return tensor
        owner = self._owner_rank(replica)
        buf = (
            tensor.to(self.device)
            if self.rank == owner
            else torch.empty(numel, dtype=torch.float64, device=self.device)
        )
        dist.broadcast(buf, src=owner)
        return buf
