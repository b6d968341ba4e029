"""The Sparse Model Soups loop (Algorithm 1 of the paper) and its baselines (docs/method.md §1, §4-§6)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import default_data_collator

from ..adapters.replica import kind_of
from ..batchnorm import has_batchnorm
from ..checkpoint import save_sparse
from ..checkpoint.constants import FINAL_SOUP, RESULTS_FILE, SPARSITY_NAME
from ..data import split_validation
from ..evaluation.metrics import MetricFn, as_metric
from ..evaluation.named import named_tests
from ..evaluation.sharded import recalibrate_shared
from ..methods.common import empty_step
from ..pruning.masks import PruningStep, phase_sparsities
from ..records.hub import push_to_hub
from ..records.logs import show_logs_by_default
from ..registry import BASELINES, PRUNING_METHODS
from ..seeding import derive_seed
from ..training.arguments import departures
from ..training.config import SparseSoupConfig
from ..training.phase import PhaseResult, PhaseSpec, phase_folder
from ..training.trainer import SparseSoupTrainer
from .checks import check_inputs, check_model, check_trainer_class, check_world
from .distributed import ReplicaWorld
from .final_soup import other_batches, save_final_soup
from .launcher import restore_launcher_env
from .recorder import Recorder
from .replica_training import fit, is_on, load_replica, train_subset
from .rounds import drive, run_round
from .run_directory import RunDirectory, run_fingerprint
from .soup_fit import split_fit_data

logger = logging.getLogger("hf_sms")


class SparseModelSoup:
    """Runs SMS and the baselines asked for in ``args.baselines`` from one pretrained model.

    Under ``torchrun`` / ``accelerate launch`` the replicas of a phase train in parallel (see
    :mod:`hf_sms.loop.distributed`); on one process they train in turn. Both give the same soup.

    Args:
        model: the pretrained (dense or already sparse) model. Pruned and souped in place where one trajectory is
            all that starts from it and it is where the run trains (:meth:`trajectory_start`: pass a copy to keep
            it); else copied, never modified or moved, the copies living on the device the run trains on.
        args: the run's :class:`SparseSoupConfig`.
        train_dataset: retraining data; ``args.validation_fraction`` of it is split off for validation
            (fixed seed) unless ``eval_dataset`` is given.
        metric_fn: ``metric_fn(model, dataset) -> float``, higher is better (accuracy, BLEU, mIoU). If it
            also has ``predict(model, dataset)`` and ``score(predictions, dataset)`` (as
            :class:`hf_sms.evaluation.metrics.ClassificationAccuracy` does), the replicas' prediction ensemble is
            reported too: it tells whether a soup can gain at all.
        test_dataset: reported only, never used for selection: a dataset (scored with ``metric_fn``), or named
            test sets ``{name: dataset or (dataset, metric)}`` (see :func:`hf_sms.evaluation.named.named_tests`),
            e.g. the clean test set, corrupted copies (:class:`hf_sms.evaluation.named.MeanOverSets`) and subgroups.
            Every row of results.json carries each of them, and so does the dense starting model.
        data_collator, compute_loss_func, callbacks: passed to every replica's trainer.
        trainer_class: the trainer of every replica, a :class:`~hf_sms.SparseSoupMixin` class (default
            :class:`~hf_sms.SparseSoupTrainer`; e.g. :class:`~hf_sms.SparseSoupSeq2SeqTrainer` with Seq2Seq arguments).
        processing_class: tokenizer or image processor, saved with the final soup.
        model_card: what the Hub model card names, e.g. ``{"base_model": "t5-small", "datasets": ["wmt16"]}``;
            with ``args.push_to_hub`` the final soup is pushed to ``args.hub_model_id`` (access is checked
            before any training).
    """

    def __init__(
        self,
        model: nn.Module,
        args: SparseSoupConfig,
        train_dataset,
        metric_fn: MetricFn,
        eval_dataset=None,
        test_dataset=None,
        data_collator=None,
        compute_loss_func=None,
        callbacks=None,
        processing_class=None,
        model_card: dict | None = None,
        trainer_class: type | None = None,
    ):
        show_logs_by_default()  # phase lines and warnings, as the Trainer shows its progress
        if eval_dataset is None:
            train_dataset, eval_dataset = split_validation(train_dataset, args.validation_fraction)  # fixed seed
        collate = data_collator or default_data_collator  # the learned soup's share of validation, split off:
        eval_dataset, self.fit_data = split_fit_data(args, eval_dataset, model, collate, compute_loss_func)
        metric_fn = as_metric(metric_fn)  # an evaluate module works as a metric too
        check_inputs(args, train_dataset, eval_dataset, metric_fn)
        self.args = args
        self.tests = named_tests(test_dataset, metric_fn)
        # the run's data-loader settings and evaluation batch size for every evaluation and recalibration, where a
        # metric left them open
        self.loader_kwargs = {"num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory}
        self.loader_kwargs["pin_memory"] &= torch.cuda.is_available() and not args.use_cpu
        for metric in [metric_fn, *(m for _, m in self.tests.values())]:
            metric = getattr(metric, "metric", metric)  # the metric inside a mean over sets
            if isinstance(getattr(metric, "loader_kwargs", None), dict) and not metric.loader_kwargs:
                metric.loader_kwargs.update(self.loader_kwargs)
            if getattr(metric, "batch_size_open", False):
                metric.batch_size, metric.batch_size_open = args.per_device_eval_batch_size, False
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        # The ensemble diagnostic needs a test set scored with the selection metric.
        self.test_dataset = next((d for d, m in self.tests.values() if m is metric_fn), None)
        notes = [*(model_card or {}).get("notes", ()), *departures(args, model)]  # said at the start, card, results
        self.metric_fn, self.processing_class = metric_fn, processing_class
        self.model_card = {**(model_card or {}), **({"notes": notes} if notes else {})}
        self.trainer_class = trainer_class = check_trainer_class(trainer_class or SparseSoupTrainer)
        self.kwargs = dict(  # what a nested run (BIMP's cycles) needs again
            data_collator=data_collator,
            compute_loss_func=compute_loss_func,
            callbacks=callbacks,
            processing_class=processing_class,
            trainer_class=trainer_class,
        )
        self.trainer_kwargs = {"data_collator": data_collator, "callbacks": list(callbacks or [])}
        if compute_loss_func is not None:
            self.trainer_kwargs["compute_loss_func"] = compute_loss_func
        self.collate = collate
        # what every replica and IMP baseline trained (replica_params): the rows compare like with like
        self.results: dict = {"rows": {}, "sms": [], "replica_params": args.replica_params, "notes": notes}
        self.pair_soups: dict[str, list] = {}  # pairwise_soups, by phase folder: made once where trajectories share
        self.set_phases(phase_sparsities(args.target_sparsity, args.n_phases))
        self.world = ReplicaWorld(args.num_replicas, cpu=args.use_cpu)
        check_world(args, self.world)
        model = self.pretrained = self.world.broadcast_model(model)  # every replica starts from rank 0's model
        check_model(args, model, lambda: self.example, warn=self.world.is_main)
        # What training depends on; test sets are measured after it, so adding one keeps the finished replicas.
        fingerprint, defaults = run_fingerprint(args, model, {"train": train_dataset, "eval": eval_dataset})
        self.run_dir = RunDirectory(
            args.output_dir, fingerprint, is_main=self.world.is_main, defaults=defaults, force=args.resume == "force"
        )
        plan, self.started = args.plan, time.time()
        data = (metric_fn, eval_dataset, self.test_dataset, lambda: self.example, self.run_dir.path(RESULTS_FILE))
        timer = (lambda m: plan.timed(self.on_device(m), self.example)) if args.measure_speedup else None
        self.recorder = Recorder(self.results, self.world, self.tests, *data, timer=timer, plan=plan)

    # -- Algorithm 1 -----------------------------------------------------------------------------
    def set_phases(self, sparsities: list[float]) -> None:
        """The plan: the sparsity after each phase (a method that prunes during training sets its own). The run
        reads ``self.phases``; results.json records it."""
        self.phases, self.results["phases"] = list(sparsities), list(sparsities)

    def run(self) -> nn.Module:
        """Run SMS (one trajectory per soup method) or a pruning-during-training method, then the baselines;
        returns the final soup of the first method. Results are in ``self.results``."""
        with self.world.launcher_env_hidden():
            return self._run()

    def _run(self) -> nn.Module:
        a = self.args
        # a method checks what needs the data (its schedule's steps) before run.json ("imp" has no entry: no-op)
        PRUNING_METHODS.meta(a.pruning_method).get("preflight", lambda ctx: None)(self)
        self.run_dir.open()
        for note in self.model_card.get("notes", ()) if self.world.is_main else ():
            logger.warning("[hf-sms] note: %s", note)  # what the card says of the starting model, said now too
        try:
            self.world.barrier()  # every rank waits until the main process has checked the directory
            self.started = time.time()
            self.results["world"] = {"processes": self.world.size, "groups": self.world.n_groups, "jobs": []}
            dense = self.on_device(self.pretrained)  # the paper's "unpruned", scored where the run trains
            self.results["dense"] = self.recorder.measure(dense, shared=True)
            del dense
            if a.pruning_method != "imp":  # pruning during training: GMP, DPF, BIMP, each +SMS
                self.final_soup = PRUNING_METHODS.get(a.pruning_method)(self)
            else:  # every trajectory and baseline is a track; tracks run beside each other on several groups
                tracks = {f"sms_{method}": self.trajectory(method) for method in a.merge_methods}
                tracks.update({name: self.baseline(name) for name in a.baselines})
                done = drive(self, tracks)
                self.final_soup = done[f"sms_{a.merge_methods[0]}"]
            self.results["final_row"] = self.recorder.final_row(a.merge_methods[0], a.pruning_method)
            if self.world.is_main and a.measure_speedup:  # the final row's model is the final soup, timed there
                final = self.results["rows"][self.results["final_row"]][-1].get("measured_speedup")
                self.results["measured_speedup"] = final or self.recorder.speed(self.final_soup)
            self.results["world"]["seconds"] = round(self.clock(), 3)
            self.recorder.save()
            if self.world.is_main:
                soup_dir, batch = self.run_dir.path(FINAL_SOUP), a.per_device_eval_batch_size
                # only a smaller model can take a branch the pruned one did not: check it on other batches
                checks = other_batches(self.eval_dataset, batch, self.collate) if a.plan.cuts_units else ()
                save_final_soup(
                    self.final_soup,
                    soup_dir,
                    dense=self.pretrained,
                    plan=a.plan,
                    example=self.example,
                    checks=checks,
                    recipe=self.recipe(),
                    metrics=self.recorder.final_metrics(),
                    processing_class=self.processing_class,
                )
                if a.push_to_hub:
                    self.push(soup_dir)
            self.world.barrier()  # every rank leaves together: none tears its transport down under another
        finally:
            self.run_dir.close()
        return self.final_soup

    def trajectory(self, method: str):
        """Algorithm 1 with ``method`` as Merge: every phase starts from the previous phase's ``method`` soup. A
        track (:mod:`hf_sms.loop.rounds`): it yields each phase and receives what the phase gave."""
        a = self.args
        model, masks = self.trajectory_start(), None
        for p, sparsity in enumerate(self.phases):
            # Phase 1 starts from the same pruned model in every trajectory: its replicas are trained once.
            folder = phase_folder("sms" if p == 0 or method == a.merge_methods[0] else f"sms-{method}", p)
            hparams = [dataclasses.replace(a, **h) for h in a.replica_overrides(p)]
            result = yield PhaseSpec(sparsity, model, masks, hparams, folder, soup=method)
            model, masks = result.soup, result.masks
            self.recorder.sms(method, p, sparsity, result, primary=method == a.merge_methods[0])
        return model

    def baseline(self, name: str):
        """A baseline as a track: one that returns a track (the IMP baselines) trains beside the others; a plain
        ``fn(ctx)`` runs when the track starts (on one process group: after the SMS trajectories)."""
        track = BASELINES.get(name)(self)
        if track is not None:
            yield from track

    def run_phase(self, spec: PhaseSpec) -> PhaseResult:
        """One phase (:mod:`hf_sms.training.phase`): prune (Step 1), retrain the replicas (Step 2), score them on
        validation, soup them (Step 3)."""
        return self.run_round([spec])[0]

    def run_round(self, specs: list[PhaseSpec]) -> list[PhaseResult]:
        """Phases of several tracks at once, their jobs spread over the process groups (:mod:`hf_sms.loop.rounds`)."""
        return run_round(self, specs)

    def clock(self) -> float:  # seconds since the run began (every process starts counting at the same barrier)
        return time.time() - self.started

    def nested(self, args: SparseSoupConfig, model: nn.Module) -> SparseModelSoup:
        """A loop over the same data and metrics with other settings (BIMP's cycles)."""
        return SparseModelSoup(
            model, args, self.train_dataset, self.metric_fn, self.eval_dataset, self.tests, **self.kwargs
        )

    def push(self, soup_dir: str) -> str:
        """Upload the final soup with a model card to ``hub_model_id`` (default: the output folder's name)."""
        a = self.args
        repo = a.hub_model_id or os.path.basename(os.path.abspath(a.output_dir))
        url = push_to_hub(soup_dir, repo, token=a.hub_token, private=a.hub_private_repo, **self.model_card)
        logger.info("[hf-sms] pushed the soup to %s", url)
        return url

    def recipe(self) -> dict:
        """What made the soup, for ``sparsity.json`` and the model card."""
        a = self.args
        n = range(a.n_phases)
        return {
            "phases": self.phases,
            "m": [a.phase_replicas(p) for p in n],
            "replicas": [a.replica_overrides(p) for p in n],
            "merge_method": a.merge_methods[0],
            "retrain_schedule": a.retrain_schedule,
            **a.plan.describe(),
            "num_train_epochs": a.num_train_epochs,
            "max_steps": a.max_steps,
            "replica_params": a.replica_params,  # what replicas and IMP baselines trained
            **({"lora": {"rank": a.lora_rank, "alpha": a.lora_alpha}} if "lora" in a.replica_params else {}),
            **({"notes": self.model_card["notes"]} if self.model_card.get("notes") else {}),  # the card shows them
        }

    # -- units of work ---------------------------------------------------------------------------
    def train_replica(
        self,
        start: nn.Module,
        step: PruningStep,
        args: SparseSoupConfig,
        name: str,
        callbacks=(),
        check_mask: bool = True,
        keep_adapters: bool = False,
        **trainer_kwargs,
    ) -> nn.Module:
        """Retrain a copy of ``start`` under ``step.masks`` into the checkpoint folder ``name`` (one that
        ``load_sparse`` and ``hf-sms merge`` read); a finished replica is loaded, not retrained.
        ``callbacks`` and ``trainer_kwargs`` go to its :class:`SparseSoupTrainer` (e.g. GMP's pruning). A subset
        replica (``args.replica_params``): :func:`~hf_sms.loop.replica_training.train_subset`."""
        folder = self.run_dir.path(name)
        if not kind_of(args).full:
            return train_subset(self, start, step, args, name, keep_adapters, callbacks, **trainer_kwargs)
        if os.path.isfile(os.path.join(folder, SPARSITY_NAME)):  # written last: the replica is complete
            logger.info("[hf-sms] %s: finished earlier, loading %s", name, folder)
            return load_replica(start, folder, step.masks if check_mask else None)
        model = fit(self, copy.deepcopy(start), step, args, folder, callbacks, like=start, **trainer_kwargs)
        if self.world.is_group_main:
            save_sparse(model, folder, processing_class=self.processing_class)  # atomic, sparsity.json last
        return model

    def train_single(
        self, start: nn.Module, args: SparseSoupConfig, name: str, callbacks=(), total_steps=None, **trainer_kwargs
    ):
        """One run from ``start`` with no mask given and the original LR schedule (dense pretraining, or GMP/DPF
        pruning by callback), trained by replica 0's group (with ``share_idle_groups``: by every process,
        data-parallel) and then held by every process."""
        world, model, start = self.world, {}, self.on_device(start)  # its soup is built, scored there too
        groups = (
            list(range(world.n_groups))
            if args.share_idle_groups and not args.per_device_train_batch_size % world.size
            else [0]
        )
        world.join([groups])
        if world.group_index in groups:
            with world.joined(groups):
                trained = self.train_replica(
                    start,
                    empty_step(),
                    args,
                    name,
                    callbacks,
                    lr_schedule="original",
                    total_steps=total_steps,
                    **trainer_kwargs,
                )
            model = {0: trained} if world.group_index == 0 else {}
        return self.load(start, world.average(self.state_dicts(model), [1.0], start.state_dict()))

    def recalibrate(self, model: nn.Module, world=None) -> nn.Module:
        """BatchNorm statistics of ``model`` over the training data (docs/method.md §5), the batches shared by
        ``world`` (default: every process, all holding ``model``; a replica: its group)."""
        a, world = self.args, world or self.world
        if not (a.recalibrate_bn and has_batchnorm(model)):
            return model
        return recalibrate_shared(
            model,
            self.train_dataset,
            a.per_device_train_batch_size,
            world,
            seed=derive_seed(a.seed, "batchnorm"),
            max_batches=a.bn_recalibration_batches,
            collate_fn=self.collate,
            loader_kwargs=self.loader_kwargs,
        )

    @property
    def device(self) -> torch.device:
        """The device the run trains on: this process's GPU under a launcher, else the arguments' device."""
        return torch.device(self.world.device if self.world.size > 1 else self.args.device)

    def copy_pretrained(self) -> nn.Module:
        """A copy of the pretrained model on the device the run trains on. Every trajectory and baseline starts from
        one, so its pruning, soups, BatchNorm recalibration and scoring run there too, not where the user's model
        was loaded (the CPU, typically: a GPU run would score its soups on the CPU)."""
        return copy.deepcopy(self.pretrained).to(self.device)

    def trajectory_start(self) -> nn.Module:
        """A copy of the pretrained model, or the model itself where nothing else starts from it (one soup method, no
        baselines, weight structures) and it is where the run trains: pruned and souped in place, as a Trainer
        trains the model it is given (a phase holds one model, not two)."""
        a, model = self.args, self.pretrained
        if len(a.merge_methods) > 1 or a.baselines or a.plan.cuts_units or not is_on(model, self.device):
            return self.copy_pretrained()
        logger.info("[hf-sms] the run prunes and soups the model it was given, in place: pass a copy to keep it")
        return model

    def on_device(self, model: nn.Module) -> nn.Module:
        """``model`` on the device the run trains on (its soups are timed there): itself, or a copy moved there."""
        return model if is_on(model, self.device) else copy.deepcopy(model).to(self.device)

    @staticmethod
    def load(template: nn.Module, state_dict: dict) -> nn.Module:
        model = copy.deepcopy(template)
        model.load_state_dict(state_dict)
        return model

    @staticmethod
    def state_dicts(models: dict[int, nn.Module]) -> dict[int, dict]:
        return {i: m.state_dict() for i, m in models.items()}

    def gather_metric(self, models: dict[int, nn.Module], dataset) -> list[float | None]:
        group = self.world.group  # the processes that hold a replica share its evaluation
        scores = self.world.gather({i: self.recorder.evaluate(m, dataset, shared=group) for i, m in models.items()})
        return [scores[i] for i in range(len(scores))]

    @functools.cached_property
    def example(self):
        """One validation batch: orders layers by call for pruning (uniform+) and measures FLOPs."""
        return next(iter(DataLoader(self.eval_dataset, self.args.per_device_eval_batch_size, collate_fn=self.collate)))


def run_sms(model: nn.Module, args: SparseSoupConfig, train_dataset, metric_fn: MetricFn, **kwargs):
    """Functional entry point: ``(final_soup, results)``; see :class:`SparseModelSoup` for the arguments. Under a
    launcher, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are as it set them again when this returns or raises."""
    try:
        runner = SparseModelSoup(model, args, train_dataset, metric_fn, **kwargs)
        soup = runner.run()
    finally:
        restore_launcher_env()
    return soup, runner.results
