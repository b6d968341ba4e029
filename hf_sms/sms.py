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

from .baselines import BASELINES
from .batchnorm import forward_batch, has_batchnorm, recalibrate_batchnorm
from .checkpoint import load_sparse, save_sparse
from .checkpoint.constants import FINAL_SOUP, RESULTS_FILE, SPARSITY_NAME
from .checks import check_inputs
from .config import SparseSoupConfig
from .data import split_validation
from .diagnostics import diversity, log_diversity
from .distributed import ReplicaWorld
from .evaluation import MetricFn, theoretical_speedup
from .evaluators import measure, metric_name, named_tests
from .hub import card_metrics
from .merge import MERGE_METHODS, check_same_masks
from .prunable import accepts_labels
from .pruning import PruningStep, phase_sparsities, prune, sparsity_report
from .pruning_methods import PRUNING_METHODS, empty_step
from .results import save_results
from .run_directory import RunDirectory, config_fingerprint, data_hash, model_hash
from .runtime.speed import describe_input, measure_speedup
from .trainer import SparseSoupTrainer

logger = logging.getLogger("hf_sms")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


class SparseModelSoup:
    """Runs SMS and the baselines asked for in ``args.baselines`` from one pretrained model.

    Under ``torchrun`` / ``accelerate launch`` the replicas of a phase train in parallel (see
    :mod:`hf_sms.distributed`); on one process they train in turn. Both give the same soup.

    Args:
        model: the pretrained (dense or already sparse) model; it is copied, never modified.
        args: the run's :class:`SparseSoupConfig`.
        train_dataset: retraining data; ``args.validation_fraction`` of it is split off for validation
            (fixed seed) unless ``eval_dataset`` is given.
        metric_fn: ``metric_fn(model, dataset) -> float``, higher is better (accuracy, BLEU, mIoU). If it
            also has ``predict(model, dataset)`` and ``score(predictions, dataset)`` (as
            :class:`hf_sms.evaluation.ClassificationAccuracy` does), the replicas' prediction ensemble is
            reported too: it tells whether a soup can gain at all.
        test_dataset: reported only, never used for selection: a dataset (scored with ``metric_fn``), or named
            test sets ``{name: dataset or (dataset, metric)}`` (see :func:`hf_sms.evaluators.named_tests`),
            e.g. the clean test set, corrupted copies (:class:`hf_sms.evaluators.MeanOverSets`) and subgroups.
            Every row of results.json carries each of them, and so does the dense starting model.
        data_collator, compute_loss_func, callbacks: passed to every replica's SparseSoupTrainer.
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
    ):
        if eval_dataset is None:
            train_dataset, eval_dataset = split_validation(train_dataset, args.validation_fraction, args.seed)
        check_inputs(args, train_dataset, eval_dataset, metric_fn)
        self.args = args
        self.tests = named_tests(test_dataset, metric_fn)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        # The ensemble diagnostic needs a test set scored with the selection metric.
        self.test_dataset = next((d for d, m in self.tests.values() if m is metric_fn), None)
        self.metric_fn, self.processing_class, self.model_card = metric_fn, processing_class, model_card or {}
        self.kwargs = {
            "data_collator": data_collator,
            "compute_loss_func": compute_loss_func,
            "callbacks": callbacks,
            "processing_class": processing_class,
        }  # what a nested run (BIMP's cycles) needs again
        self.trainer_kwargs = {"data_collator": data_collator, "callbacks": list(callbacks or [])}
        if compute_loss_func is not None:
            self.trainer_kwargs["compute_loss_func"] = compute_loss_func
        self.collate = data_collator or default_data_collator
        self.results: dict = {"phases": phase_sparsities(args.target_sparsity, args.n_phases), "rows": {}, "sms": []}
        self.world = ReplicaWorld(args.num_replicas, cpu=args.use_cpu)
        model = self.pretrained = self.world.broadcast_model(model)  # every replica starts from rank 0's model
        splits = {"train": train_dataset, "eval": eval_dataset, **{f"test:{n}": d for n, (d, _) in self.tests.items()}}
        fingerprint = {
            "config": config_fingerprint(args),
            "model": model_hash(model),
            "data": {name: data_hash(d) for name, d in splits.items()},
        }
        self.run_dir = RunDirectory(args.output_dir, fingerprint, is_main=self.world.is_main)

    # -- Algorithm 1 -----------------------------------------------------------------------------
    def run(self) -> nn.Module:
        """Run SMS (one trajectory per soup method), then the baselines; returns the final soup of the first
        method. Results are in ``self.results``."""
        a = self.args
        self.run_dir.open()
        try:
            self.world.barrier()  # every rank waits until the main process has checked the directory
            self.results["dense"] = self.measure(self.pretrained)  # the paper's "unpruned" column
            if a.pruning_method != "imp":  # pruning during training: GMP, DPF, BIMP, each +SMS
                self.final_soup = PRUNING_METHODS[a.pruning_method](self)
            else:
                soups = {method: self.run_trajectory(method) for method in a.merge_methods}
                self.final_soup = soups[a.merge_methods[0]]
            for name in a.baselines:
                BASELINES[name](self)
            if self.world.is_main and a.measure_speedup:
                self.results["measured_speedup"] = self.measure_runtime(self.final_soup)
            self._save_results()
            if self.world.is_main:
                soup_dir = self.run_dir.path(FINAL_SOUP)
                metrics = self.final_metrics()
                save_sparse(
                    self.final_soup,
                    soup_dir,
                    recipe=self.recipe(),
                    metrics=metrics,
                    processing_class=self.processing_class,
                )
                if a.push_to_hub:
                    self.push(soup_dir)
        finally:
            self.run_dir.close()
        return self.final_soup

    def push(self, soup_dir: str) -> str:
        """Upload the final soup with a model card to ``hub_model_id`` (default: the output folder's name)."""
        from .hub import push_to_hub

        a = self.args
        repo = a.hub_model_id or os.path.basename(os.path.abspath(a.output_dir))
        url = push_to_hub(soup_dir, repo, token=a.hub_token, private=a.hub_private_repo, **self.model_card)
        logger.info("[hf-sms] pushed the soup to %s", url)
        return url

    def run_trajectory(self, method: str) -> nn.Module:
        """Algorithm 1 with ``method`` as Merge: every phase starts from the previous phase's ``method`` soup."""
        a = self.args
        model, masks = copy.deepcopy(self.pretrained), None
        for p, sparsity in enumerate(self.results["phases"]):
            self.phase_start = time.perf_counter()
            step = prune(model, sparsity, a.allocation, masks, self.world.broadcast_masks, self.example)  # Step 1
            masks = step.masks
            hparams = [dataclasses.replace(a, **h) for h in a.replica_overrides(p)]
            # Phase 1 starts from the same pruned model in every trajectory: its replicas are trained once.
            folder = f"sms/phase{p + 1}" if p == 0 or method == a.merge_methods[0] else f"sms-{method}/phase{p + 1}"
            candidates = {  # Step 2: retrain m copies with hyperparameters h_i, this process's share of them
                i: self.recalibrate(self.train_replica(model, step, hparams[i], f"{folder}/replica{i}"))
                for i in self.world.owned(len(hparams))
            }
            val = self.gather_metric(candidates, self.eval_dataset)
            model, kept = self.merge(method, model, candidates, val)  # Step 3: one model with the same mask
            self.record_sms(method, p, sparsity, candidates, val, model, kept)
        return model

    def recipe(self) -> dict:
        """What made the soup, for ``sparsity.json`` and the model card."""
        a = self.args
        n = range(a.n_phases)
        return {
            "phases": self.results["phases"],
            "m": [a.phase_replicas(p) for p in n],
            "replicas": [a.replica_overrides(p) for p in n],
            "merge_method": a.merge_methods[0],
            "retrain_schedule": a.retrain_schedule,
            "allocation": a.allocation,
            "num_train_epochs": a.num_train_epochs,
            "max_steps": a.max_steps,
        }

    def final_metrics(self) -> dict:
        """What the final soup's ``sparsity.json`` and model card report: every evaluation of the soup beside the
        dense model, each with its metric's name and split (see :func:`hf_sms.hub.card_metrics`)."""
        rows = self.results["rows"]
        row = rows.get(f"sms_{self.args.merge_methods[0]}", rows.get(self.args.pruning_method, [{}]))[-1]
        results = []
        for model, measured in (("soup", row), ("dense", self.results.get("dense", {}))):
            evaluations = [("validation", measured.get("val"), self.metric_fn)]
            evaluations += [(name, measured.get("tests", {}).get(name), m) for name, (_, m) in self.tests.items()]
            results += [
                {"model": model, "split": split, "metric": metric_name(metric), "value": value}
                for split, value, metric in evaluations
                if value is not None
            ]
        return card_metrics(results=results, speedup=row.get("speedup"), measured=self.results.get("measured_speedup"))

    def measure_runtime(self, model: nn.Module) -> dict:
        """``model`` timed dense vs the sparse runtime on one validation batch (see :func:`measure_speedup`)."""
        batch = {k: v for k, v in self.example.items()} if isinstance(self.example, dict) else self.example

        def forward(m):
            forward_batch(m, batch, keep_labels=accepts_labels(m))

        forward.description = describe_input(batch)
        return measure_speedup(model, forward)

    # -- units of work ---------------------------------------------------------------------------
    def train_replica(
        self, start: nn.Module, step: PruningStep, args: SparseSoupConfig, name: str, callbacks=(), **trainer_kwargs
    ) -> nn.Module:
        """Retrain a copy of ``start`` under ``step.masks`` into the checkpoint folder ``name`` (one that
        ``load_sparse`` and ``hf-sms merge`` read); a finished replica is loaded, not retrained.
        ``callbacks`` and ``trainer_kwargs`` go to its :class:`SparseSoupTrainer` (e.g. GMP's pruning)."""
        folder = self.run_dir.path(name)
        model = copy.deepcopy(start)
        if os.path.isfile(os.path.join(folder, SPARSITY_NAME)):  # written last: the replica is complete
            logger.info("[hf-sms] %s: finished earlier, loading %s", name, folder)
            try:
                load_sparse(folder, model)
            except Exception as e:  # truncated or foreign file: say which, and how to recover
                raise ValueError(
                    f"{folder} is not a readable checkpoint of this model ({e}); delete that folder to retrain the "
                    "replica, or use a fresh --output_dir"
                ) from e
            return model.train()
        kept = sum(int(m.sum()) for m in step.masks.values()) / max(sum(m.numel() for m in step.masks.values()), 1)
        logger.info(
            "[hf-sms] %s: retraining at sparsity %.4f (seed=%s, lr=%s, wd=%s, epochs=%s, rank %d/%d)",
            name,
            1 - kept,
            args.seed,
            args.learning_rate,
            args.weight_decay,
            args.num_train_epochs,
            self.world.rank,
            self.world.size,
        )
        args = dataclasses.replace(args, output_dir=folder, push_to_hub=False)  # only the final soup is pushed
        group = {"process_group": self.world.subgroup} if self.world.subgroup is not None else {}
        kwargs = {**self.trainer_kwargs, "callbacks": self.trainer_kwargs["callbacks"] + list(callbacks)}
        trainer = SparseSoupTrainer(
            model, args, masks=step, train_dataset=self.train_dataset, **group, **kwargs, **trainer_kwargs
        )
        trainer.train()
        if self.world.is_group_main:
            save_sparse(model, folder, processing_class=self.processing_class)  # atomic, sparsity.json last
        return model

    def train_single(self, start: nn.Module, args: SparseSoupConfig, name: str, callbacks=(), total_steps=None):
        """One run from ``start`` with no mask given and the original LR schedule (dense pretraining, or GMP/DPF
        pruning by callback), trained by replica 0's group and then held by every process."""
        model = {}
        if 0 in self.world.owned(1):
            model[0] = self.train_replica(
                start, empty_step(), args, name, callbacks, lr_schedule="original", total_steps=total_steps
            )
        return self.load(start, self.world.average(self.state_dicts(model), [1.0], start.state_dict()))

    def record(self, method: str, phase: int, model: nn.Module) -> None:
        """A row for ``model`` (sparsity, speedup, validation and every test set)."""
        self.record_row(method, phase, self.measure(model))

    def merge(self, method: str, template: nn.Module, candidates: dict[int, nn.Module], val: list[float]):
        """``(soup, kept indices)``: the soup of the m candidates, wherever they live, by the registered policy
        ``method``, BatchNorm recalibrated; trial soups are scored on validation only."""
        if candidates:  # across processes the mask is the same by broadcast
            check_same_masks(list(candidates.values()))
        local, ref = self.state_dicts(candidates), template.state_dict()

        def soup(weights: list[float]) -> nn.Module:
            return self.recalibrate(self.load(template, self.world.average(local, weights, ref)))

        weights = MERGE_METHODS[method](val, lambda w: self.evaluate(soup(w), self.eval_dataset), self.args)
        return soup(weights), [i for i, w in enumerate(weights) if w]

    def recalibrate(self, model: nn.Module) -> nn.Module:
        if self.args.recalibrate_bn and has_batchnorm(model):
            loader = DataLoader(self.train_dataset, self.args.per_device_train_batch_size, collate_fn=self.collate)
            with torch.random.fork_rng():  # augmentation inside the data set stays reproducible
                torch.manual_seed(self.args.seed)
                recalibrate_batchnorm(model, loader, self.args.bn_recalibration_batches)
        return model

    def evaluate(self, model: nn.Module, dataset) -> float | None:
        return None if dataset is None else float(self.metric_fn(model, dataset))

    # -- bookkeeping -----------------------------------------------------------------------------
    @staticmethod
    def load(template: nn.Module, state_dict: dict) -> nn.Module:
        model = copy.deepcopy(template)
        model.load_state_dict(state_dict)
        return model

    @staticmethod
    def state_dicts(models: dict[int, nn.Module]) -> dict[int, dict]:
        return {i: m.state_dict() for i, m in models.items()}

    def gather_metric(self, models: dict[int, nn.Module], dataset) -> list[float | None]:
        scores = self.world.gather({i: self.evaluate(m, dataset) for i, m in models.items()})
        return [scores[i] for i in range(len(scores))]

    @functools.cached_property
    def example(self):
        """One validation batch: orders layers by call for pruning (uniform+) and measures FLOPs."""
        return next(iter(DataLoader(self.eval_dataset, self.args.per_device_eval_batch_size, collate_fn=self.collate)))

    def measure(self, model: nn.Module) -> dict:
        return {
            "sparsity": sparsity_report(model)["sparsity"],
            "speedup": theoretical_speedup(model, self.example),
            "val": self.evaluate(model, self.eval_dataset),
            **self._test_scores(model),
        }

    def _test_scores(self, model: nn.Module) -> dict:
        """``test`` (the first test set), ``tests`` (every named one) and, where a metric gives them, ``details``."""
        measured = {name: measure(metric, model, dataset) for name, (dataset, metric) in self.tests.items()}
        out = {"test": next(iter(measured.values()))[0] if measured else None}
        out["tests"] = {name: value for name, (value, _) in measured.items()}
        details = {name: d for name, (_, d) in measured.items() if d is not None}
        return {**out, "details": details} if details else out

    def record_row(self, method: str, phase: int, measured: dict, **extra) -> None:
        row = {"phase": phase + 1, **measured, **extra}
        self.results["rows"].setdefault(method, []).append(row)
        if self.world.is_main:
            logger.info(
                "[hf-sms] phase %d %s: sparsity %.4f val %s test %s",
                phase + 1,
                method,
                row["sparsity"],
                _fmt(row["val"]),
                _fmt(row["test"]),
            )

    def record_sms(self, method: str, p: int, sparsity: float, cands: dict, val: list, soup, kept: list) -> None:
        scores = self.world.gather({i: self._test_scores(c)["tests"] for i, c in cands.items()})
        tests = {name: [scores[i][name] for i in range(len(val))] for name in self.tests}
        test = next(iter(tests.values()), [None] * len(val))
        self.record_row(f"sms_{method}", p, self.measure(soup), kept=kept)
        primary = method == self.args.merge_methods[0]
        if primary:  # the candidates of the trajectory reported as the final soup
            best = max(range(len(val)), key=lambda i: val[i])  # chosen on validation, never on test
            same = {k: self.results["rows"][f"sms_{method}"][-1][k] for k in ("sparsity", "speedup")}  # same mask
            picked = {"val": val[best], "test": test[best], "tests": {n: v[best] for n, v in tests.items()}}
            self.record_row("best_candidate", p, {**same, **picked}, index=best)
            mean = {"val": _mean(val), "test": _mean(test), "tests": {n: _mean(v) for n, v in tests.items()}}
            self.record_row("mean_candidate", p, {**same, **mean})
        numel = sum(t.numel() for t in soup.parameters())
        diag = {
            "phase": p + 1,
            "trajectory": method,
            "target_sparsity": sparsity,
            "candidates_val": val,
            "candidates_test": test,
            "pairwise_l2": self.world.pairwise_l2(cands, len(val), numel),
            **diversity(self.metric_fn, self.world, cands, val, self.eval_dataset, self.test_dataset),
            "seconds": round(time.perf_counter() - self.phase_start, 3),
        }
        self.results["sms"].append(diag)
        if self.world.is_main and primary:
            log_diversity(diag)
        self._save_results()

    def _save_results(self) -> None:
        if self.world.is_main:
            save_results(self.results, self.run_dir.path(RESULTS_FILE))


def _mean(values: list) -> float | None:
    return None if None in values else sum(values) / len(values)


def run_sms(model: nn.Module, args: SparseSoupConfig, train_dataset, metric_fn: MetricFn, **kwargs):
    """Functional entry point: ``(final_soup, results)``; see :class:`SparseModelSoup` for the arguments."""
    runner = SparseModelSoup(model, args, train_dataset, metric_fn, **kwargs)
    soup = runner.run()
    return soup, runner.results
