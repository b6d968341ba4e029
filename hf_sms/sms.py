"""The Sparse Model Soups loop (Algorithm 1 of the paper) and its baselines (METHOD.md §1, §4-§6)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import os
import time

import torch
from safetensors.torch import load_model, save_model
from torch import nn
from torch.utils.data import DataLoader
from transformers import default_data_collator

from .batchnorm import has_batchnorm, recalibrate_batchnorm
from .config import SparseSoupConfig
from .data import split_validation
from .distributed import ReplicaWorld
from .evaluation import MetricFn, theoretical_speedup
from .merge import check_same_masks, greedy_select
from .pruning import PruningStep, phase_sparsities, prune, sparsity_report
from .results import save_results
from .seeding import derive_seed
from .sparse_format import save_sparse
from .trainer import SparseSoupTrainer

logger = logging.getLogger("hf_sms")
# Config fields a finished replica depends on: a resumed run must match them.
_RUN_KEYS = (
    "target_sparsity n_phases allocation retrain_schedule pretrain_learning_rate pretrain_min_learning_rate "
    "pretrain_schedule pretrain_epochs num_replicas replicas_per_phase replica_seeds replica_weight_decays "
    "replica_learning_rates "
    "replica_epochs seed learning_rate weight_decay num_train_epochs max_steps per_device_train_batch_size "
    "gradient_accumulation_steps optim optim_args max_grad_norm decay_all_parameters retrain_warmup_fraction "
    "warmup_steps merge_methods"
).split()
# Below this mean pairwise disagreement (% of validation examples) replicas are near copies (METHOD §9).
MIN_DISAGREEMENT = 0.5
MODEL_FILE = "model.safetensors"


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
        test_dataset: reported only, never used for selection.
        data_collator, compute_loss_func, callbacks: passed to every replica's SparseSoupTrainer.
        processing_class: tokenizer or image processor, saved with the final soup.
    """

    def __init__(self, model: nn.Module, args: SparseSoupConfig, train_dataset, metric_fn: MetricFn,
                 eval_dataset=None, test_dataset=None, data_collator=None, compute_loss_func=None,
                 callbacks=None, processing_class=None):  # fmt: skip
        if eval_dataset is None:
            train_dataset, eval_dataset = split_validation(train_dataset, args.validation_fraction, args.seed)
        self.pretrained, self.args = model, args
        self.train_dataset, self.eval_dataset, self.test_dataset = train_dataset, eval_dataset, test_dataset
        self.metric_fn, self.processing_class = metric_fn, processing_class
        self.trainer_kwargs = {"data_collator": data_collator, "callbacks": callbacks}
        if compute_loss_func is not None:
            self.trainer_kwargs["compute_loss_func"] = compute_loss_func
        self.collate = data_collator or default_data_collator
        self.results: dict = {"phases": phase_sparsities(args.target_sparsity, args.n_phases), "rows": {}, "sms": []}
        self.world = ReplicaWorld(args.num_replicas, cpu=args.use_cpu)

    # -- Algorithm 1 -----------------------------------------------------------------------------
    def run(self) -> nn.Module:
        """Run SMS (one trajectory per soup method), then the baselines; returns the final soup of the first
        method. Results are in ``self.results``."""
        a = self.args
        self._check_output_dir()
        soups = {method: self.run_trajectory(method) for method in a.merge_methods}
        self.final_soup = model = soups[a.merge_methods[0]]
        if "imp_mx" in a.baselines:
            self.run_imp("imp_mx", a, n_tracks=1, times_m=True)
        if "imp" in a.baselines or "imp_reprune" in a.baselines:
            self.run_imp("imp", a, n_tracks=a.num_replicas if "imp_reprune" in a.baselines else 1)
        self._save_results()
        if self.world.is_main:
            soup_dir = os.path.join(a.output_dir, "final_soup")
            save_sparse(model, soup_dir, recipe=self.recipe(), metrics=self.final_metrics(),
                        processing_class=self.processing_class)  # fmt: skip
        return model

    def run_trajectory(self, method: str) -> nn.Module:
        """Algorithm 1 with ``method`` as Merge: every phase starts from the previous phase's ``method`` soup."""
        a = self.args
        model, masks = copy.deepcopy(self.pretrained), None
        for p, sparsity in enumerate(self.results["phases"]):
            self._phase_start = time.perf_counter()
            step = prune(model, sparsity, a.allocation, masks, self.world.broadcast_masks, self.example)  # Step 1
            masks = step.masks
            hparams = [dataclasses.replace(a, **h) for h in a.replica_overrides(p)]
            # Phase 1 starts from the same pruned model in every trajectory: its replicas are trained once.
            folder = f"sms/phase{p + 1}" if p == 0 or method == a.merge_methods[0] else f"sms-{method}/phase{p + 1}"
            candidates = {  # Step 2: retrain m copies with hyperparameters h_i, this process's share of them
                i: self.recalibrate(self.train_replica(model, step, hparams[i], f"{folder}/replica{i}"))
                for i in self.world.owned(len(hparams))
            }
            val = self._gather_metric(candidates, self.eval_dataset)
            model, kept = self.merge(method, model, candidates, val)  # Step 3: one model with the same mask
            self._record_sms(method, p, sparsity, candidates, val, model, kept)
        return model

    def recipe(self) -> dict:
        """What made the soup, for ``sparsity.json`` and the model card."""
        a = self.args
        n = range(a.n_phases)
        return {"phases": self.results["phases"], "m": [a.phase_replicas(p) for p in n],
                "replicas": [a.replica_overrides(p) for p in n],
                "merge_method": a.merge_methods[0], "retrain_schedule": a.retrain_schedule, "allocation": a.allocation,
                "num_train_epochs": a.num_train_epochs, "max_steps": a.max_steps}  # fmt: skip

    def final_metrics(self) -> dict:
        row = self.results["rows"][f"sms_{self.args.merge_methods[0]}"][-1]
        return {k: row[k] for k in ("val", "test", "speedup") if row.get(k) is not None}

    def run_imp(self, name: str, args: SparseSoupConfig, n_tracks: int, times_m: bool = False) -> None:
        """IMP (m=1) trajectories, each with its own random stream, in lockstep and parallel like replicas; with
        several tracks also IMP-RePrune: their average, re-pruned to the phase's sparsity (their masks diverge)."""
        tracks = {i: copy.deepcopy(self.pretrained) for i in self.world.owned(n_tracks)}
        masks = dict.fromkeys(tracks)
        for p, sparsity in enumerate(self.results["phases"]):
            for i in tracks:  # no mask broadcast: IMP runs are independent
                step = prune(tracks[i], sparsity, args.allocation, masks[i], example_inputs=self.example)
                masks[i] = step.masks
                h = dataclasses.replace(args, seed=derive_seed(args.seed, name, p, i))
                if times_m:  # IMP_mx: the compute SMS spends in this phase, in one replica
                    h = dataclasses.replace(h, **args.phase_budget(p))
                tracks[i] = self.recalibrate(self.train_replica(tracks[i], step, h, f"{name}/phase{p + 1}/track{i}"))
            self._record(name, p, self.world.gather({0: self._measure(tracks[0])} if 0 in tracks else {})[0])
            if n_tracks > 1:
                template = next(iter(tracks.values()))
                average = self.world.average(self._state_dicts(tracks), range(n_tracks), template.state_dict())
                reprune = self._load(template, average)
                prune(reprune, sparsity, args.allocation, None, self.world.broadcast_masks, self.example)
                self._record("imp_reprune", p, self._measure(self.recalibrate(reprune)))

    # -- units of work ---------------------------------------------------------------------------
    def train_replica(self, start: nn.Module, step: PruningStep, args: SparseSoupConfig, name: str) -> nn.Module:
        """Retrain a copy of ``start`` under ``step.masks``; a finished replica is loaded, not retrained."""
        out_dir = os.path.join(self.args.output_dir, name)
        path = os.path.join(out_dir, MODEL_FILE)
        model = copy.deepcopy(start)
        if os.path.isfile(path):
            logger.info("[hf-sms] %s: finished earlier, loading %s", name, path)
            try:
                load_model(model, path)
            except Exception as e:  # truncated or foreign file: say which, and how to recover
                raise ValueError(f"{path} is not a readable checkpoint of this model ({e}); delete it to retrain "
                                 "that replica, or use a fresh --output_dir") from e  # fmt: skip
            return model
        logger.info("[hf-sms] %s: retraining at sparsity %.4f (seed=%s, lr=%s, wd=%s, epochs=%s, rank %d/%d)", name,
                    1 - sum(int(m.sum()) for m in step.masks.values()) / sum(m.numel() for m in step.masks.values()),
                    args.seed, args.learning_rate, args.weight_decay, args.num_train_epochs, self.world.rank,
                    self.world.size)  # fmt: skip
        args = dataclasses.replace(args, output_dir=out_dir, push_to_hub=False)  # only the final soup is pushed
        group = {"process_group": self.world.subgroup} if self.world.subgroup is not None else {}
        trainer = SparseSoupTrainer(
            model, args, masks=step, train_dataset=self.train_dataset, **group, **self.trainer_kwargs
        )
        trainer.train()
        if self.world.is_group_main:
            os.makedirs(out_dir, exist_ok=True)
            save_model(model, path + ".tmp")
            os.replace(path + ".tmp", path)  # a half-written replica is never taken as finished
        return model

    def merge(self, method: str, template: nn.Module, candidates: dict[int, nn.Module], val: list[float]):
        """``(soup, kept indices)``: the ``method`` soup of the m candidates, wherever they live, BatchNorm
        recalibrated. Uniform keeps all; greedy adds candidates best-first while validation improves."""
        if candidates:  # across processes the mask is the same by broadcast
            check_same_masks(list(candidates.values()))
        local, ref = self._state_dicts(candidates), template.state_dict()

        def soup(indices) -> nn.Module:
            return self.recalibrate(self._load(template, self.world.average(local, sorted(indices), ref)))

        kept = list(range(len(val)))
        if method == "greedy":
            kept, _ = greedy_select(
                val, lambda idx: self.evaluate(soup(idx), self.eval_dataset), self.args.greedy_keep_ties
            )
        return soup(kept), sorted(kept)

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
    def _load(template: nn.Module, state_dict: dict) -> nn.Module:
        model = copy.deepcopy(template)
        model.load_state_dict(state_dict)
        return model

    @staticmethod
    def _state_dicts(models: dict[int, nn.Module]) -> dict[int, dict]:
        return {i: m.state_dict() for i, m in models.items()}

    def _gather_metric(self, models: dict[int, nn.Module], dataset) -> list[float | None]:
        scores = self.world.gather({i: self.evaluate(m, dataset) for i, m in models.items()})
        return [scores[i] for i in range(len(scores))]

    @functools.cached_property
    def example(self):
        """One validation batch: orders layers by call for pruning (uniform+) and measures FLOPs."""
        return next(iter(DataLoader(self.eval_dataset, self.args.per_device_eval_batch_size, collate_fn=self.collate)))

    def _measure(self, model: nn.Module) -> dict:
        return {
            "sparsity": sparsity_report(model)["sparsity"],
            "speedup": theoretical_speedup(model, self.example),
            "val": self.evaluate(model, self.eval_dataset),
            "test": self.evaluate(model, self.test_dataset),
        }

    def _record(self, method: str, phase: int, measured: dict, **extra) -> None:
        row = {"phase": phase + 1, **measured, **extra}
        self.results["rows"].setdefault(method, []).append(row)
        if self.world.is_main:
            logger.info("[hf-sms] phase %d %s: sparsity %.4f val %s test %s", phase + 1, method, row["sparsity"],
                        _fmt(row["val"]), _fmt(row["test"]))  # fmt: skip

    def _record_sms(self, method: str, p: int, sparsity: float, cands: dict, val: list, soup, kept: list) -> None:
        test = self._gather_metric(cands, self.test_dataset)
        self._record(f"sms_{method}", p, self._measure(soup), kept=kept)
        primary = method == self.args.merge_methods[0]
        if primary:  # the candidates of the trajectory reported as the final soup
            best = max(range(len(val)), key=lambda i: val[i])  # chosen on validation, never on test
            same = {k: self.results["rows"][f"sms_{method}"][-1][k] for k in ("sparsity", "speedup")}  # same mask
            self._record("best_candidate", p, {**same, "val": val[best], "test": test[best]}, index=best)
            mean = {k: sum(v) / len(v) if None not in v else None for k, v in (("val", val), ("test", test))}
            self._record("mean_candidate", p, {**same, **mean})
        numel = sum(t.numel() for t in soup.parameters())
        diag = {
            "phase": p + 1,
            "trajectory": method,
            "target_sparsity": sparsity,
            "candidates_val": val,
            "candidates_test": test,
            "pairwise_l2": self.world.pairwise_l2(cands, len(val), numel),
            **self._diversity(cands, val),
            "seconds": round(time.perf_counter() - self._phase_start, 3),
        }
        self.results["sms"].append(diag)
        if self.world.is_main and primary:
            self._log_diversity(diag)
        self._save_results()

    def _diversity(self, cands: dict[int, nn.Module], val: list) -> dict:
        """The prediction ensemble per split and, on validation, how often the replicas disagree (METHOD §8-9).

        Needs a metric with ``predict``/``score`` (as :class:`ClassificationAccuracy`); otherwise ``{}``.
        """
        if not (hasattr(self.metric_fn, "predict") and hasattr(self.metric_fn, "score")):
            return {}
        out = {}
        for split, dataset in (("val", self.eval_dataset), ("test", self.test_dataset)):
            if dataset is None:
                continue
            preds = {i: self.metric_fn.predict(c, dataset) for i, c in cands.items()}
            labels = self.world.gather({i: t.argmax(-1) for i, t in preds.items()})
            shape = tuple(next(iter(labels.values())).shape) + (next(iter(preds.values())).shape[-1],)
            mean_preds = self.world.sum_tensors(preds, shape) / len(val)
            out[f"ensemble_{split}"] = float(self.metric_fn.score(mean_preds, dataset))
            if split == "val":
                pairs = [(i, j) for i in range(len(val)) for j in range(i + 1, len(val))]
                rates = [100.0 * float((labels[i] != labels[j]).float().mean()) for i, j in pairs]
                out["disagreement_val"] = sum(rates) / len(rates) if rates else 0.0
                out["ensemble_minus_best_val"] = out["ensemble_val"] - max(val)
        return out

    @staticmethod
    def _log_diversity(diag: dict) -> None:
        l2 = diag["pairwise_l2"]
        logger.info(
            "[hf-sms] phase %d replicas: disagreement %s%% of val, ensemble - best %s, mean pairwise L2 %s",
            diag["phase"],
            _fmt(diag.get("disagreement_val")),
            _fmt(diag.get("ensemble_minus_best_val")),
            _fmt(sum(l2) / len(l2) if l2 else None),
        )
        if len(diag["candidates_val"]) > 1 and diag.get("disagreement_val", MIN_DISAGREEMENT) < MIN_DISAGREEMENT:
            logger.warning(
                "[hf-sms] phase %d: the replicas disagree on only %.2f%% of validation examples, so a soup cannot gain "
                "over its candidates. Make them differ more: independent seeds with data augmentation, different "
                "weight decays (replica_weight_decays) or learning rates (replica_learning_rates), or longer "
                "retraining (num_train_epochs)",
                diag["phase"],
                diag["disagreement_val"],
            )

    def _save_results(self) -> None:
        if self.world.is_main:
            save_results(self.results, os.path.join(self.args.output_dir, "results.json"))

    def _check_output_dir(self) -> None:
        """Refuse to resume into a directory written by a different run configuration."""
        fingerprint = {k: getattr(self.args, k) for k in _RUN_KEYS}
        fingerprint["hash"] = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        path = os.path.join(self.args.output_dir, "run.json")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    old = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} is corrupt ({e}); delete it or choose another --output_dir") from e
            if old.get("hash") != fingerprint["hash"]:
                changed = sorted(k for k in _RUN_KEYS if old.get(k) != fingerprint[k])
                raise ValueError(
                    f"{self.args.output_dir} holds a run with a different configuration (changed: {changed}); "
                    "use a fresh --output_dir, or delete the old run to start over"
                )
        elif os.path.isdir(self.args.output_dir) and any(os.scandir(self.args.output_dir)):
            raise ValueError(
                f"{self.args.output_dir} is not empty and holds no hf-sms run.json; use a fresh --output_dir"
            )
        self.world.barrier()  # every rank has read the directory before the main process writes to it
        if self.world.is_main and not os.path.isfile(path):
            os.makedirs(self.args.output_dir, exist_ok=True)
            save_results(fingerprint, path)
        self.world.barrier()


def run_sms(model: nn.Module, args: SparseSoupConfig, train_dataset, metric_fn: MetricFn, **kwargs):
    """Functional entry point: ``(final_soup, results)``; see :class:`SparseModelSoup` for the arguments."""
    runner = SparseModelSoup(model, args, train_dataset, metric_fn, **kwargs)
    soup = runner.run()
    return soup, runner.results
