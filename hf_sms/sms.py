"""The Sparse Model Soups loop (Algorithm 1 of the paper) and its baselines (METHOD.md §1, §4-§6)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable

import torch
from safetensors.torch import load_model, save_model
from torch import nn
from torch.utils.data import DataLoader
from transformers import default_data_collator

from .batchnorm import has_batchnorm, recalibrate_batchnorm
from .config import SparseSoupConfig
from .data import split_validation
from .evaluation import MetricFn, pairwise_l2
from .merge import greedy_soup, uniform_soup
from .pruning import PruningStep, phase_sparsities, prune, sparsity_report
from .results import save_results
from .trainer import SparseSoupTrainer

logger = logging.getLogger("hf_sms")
# Config fields a finished replica depends on: a resumed run must match them.
_RUN_KEYS = (
    "target_sparsity n_phases allocation retrain_schedule pretrain_learning_rate pretrain_min_learning_rate "
    "pretrain_schedule pretrain_epochs num_replicas replica_seeds replica_weight_decays replica_learning_rates "
    "replica_epochs seed learning_rate weight_decay num_train_epochs max_steps per_device_train_batch_size "
    "gradient_accumulation_steps optim max_grad_norm"
).split()


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


class SparseModelSoup:
    """Runs SMS and the baselines asked for in ``args.baselines`` from one pretrained model.

    Args:
        model: the pretrained (dense or already sparse) model; it is copied, never modified.
        args: the run's :class:`SparseSoupConfig`.
        train_dataset: retraining data; ``args.validation_fraction`` of it is split off for validation
            (fixed seed) unless ``eval_dataset`` is given.
        metric_fn: ``metric_fn(model, dataset) -> float``, higher is better (accuracy, BLEU, mIoU).
        test_dataset: reported only, never used for selection.
        ensemble_fn: ``ensemble_fn(models, dataset) -> float``, the metric of the replicas' prediction
            ensemble (tells whether a soup can gain at all); optional.
        data_collator, compute_loss_func, callbacks: passed to every replica's SparseSoupTrainer.
    """

    def __init__(self, model: nn.Module, args: SparseSoupConfig, train_dataset, metric_fn: MetricFn,
                 eval_dataset=None, test_dataset=None, ensemble_fn: Callable | None = None, data_collator=None,
                 compute_loss_func=None, callbacks=None):  # fmt: skip
        if eval_dataset is None:
            train_dataset, eval_dataset = split_validation(train_dataset, args.validation_fraction, args.seed)
        self.pretrained, self.args = model, args
        self.train_dataset, self.eval_dataset, self.test_dataset = train_dataset, eval_dataset, test_dataset
        self.metric_fn, self.ensemble_fn = metric_fn, ensemble_fn
        self.trainer_kwargs = {"data_collator": data_collator, "callbacks": callbacks}
        if compute_loss_func is not None:
            self.trainer_kwargs["compute_loss_func"] = compute_loss_func
        self.collate = data_collator or default_data_collator
        self.results: dict = {"phases": phase_sparsities(args.target_sparsity, args.n_phases), "rows": {}, "sms": []}

    # -- Algorithm 1 -----------------------------------------------------------------------------
    def run(self) -> nn.Module:
        """Run SMS, then the baselines; returns the final soup. Results are in ``self.results``."""
        self._check_output_dir()
        a = self.args
        model, masks = copy.deepcopy(self.pretrained), None
        for p, sparsity in enumerate(self.results["phases"]):
            step = prune(model, sparsity, a.allocation, masks)  # Step 1: prune the soup to s_p
            masks = step.masks
            candidates = [  # Step 2: retrain m copies with hyperparameters h_i (fully parallel)
                self.recalibrate(
                    self.train_replica(model, step, dataclasses.replace(a, **h), f"sms/phase{p}/replica{i}")
                )
                for i, h in enumerate(a.replica_overrides())
            ]
            val = [self.evaluate(c, self.eval_dataset) for c in candidates]
            soups = self.merge(candidates, val)  # Step 3: average into one model with the same mask
            model = soups[a.merge_method]
            self._record_sms(p, sparsity, candidates, val, soups)
        self.final_soup = model
        if "imp_mx" in a.baselines:
            m = a.num_replicas  # same total compute as SMS: one replica, m times as long
            scale = {
                "num_train_epochs": a.num_train_epochs * m,
                "max_steps": a.max_steps * m if a.max_steps > 0 else -1,
            }
            self.run_imp("imp_mx", dataclasses.replace(a, **scale), n_tracks=1)
        if "imp" in a.baselines or "imp_reprune" in a.baselines:
            self.run_imp("imp", a, n_tracks=a.num_replicas if "imp_reprune" in a.baselines else 1)
        save_results(self.results, os.path.join(a.output_dir, "results.json"))
        return model

    def run_imp(self, name: str, args: SparseSoupConfig, n_tracks: int) -> None:
        """IMP (m=1) trajectories in lockstep; with several tracks (seeds) also IMP-RePrune per phase."""
        models, masks = [copy.deepcopy(self.pretrained) for _ in range(n_tracks)], [None] * n_tracks
        for p, sparsity in enumerate(self.results["phases"]):
            for i in range(n_tracks):
                step = prune(models[i], sparsity, args.allocation, masks[i])
                masks[i] = step.masks
                h = dataclasses.replace(args, seed=args.seed + i)
                models[i] = self.recalibrate(self.train_replica(models[i], step, h, f"{name}/phase{p + 1}/track{i}"))
            self._record(name, p, models[0])
            if n_tracks > 1:
                self._record("imp_reprune", p, self.recalibrate(uniform_soup(models, reprune_sparsity=sparsity)))

    # -- units of work ---------------------------------------------------------------------------
    def train_replica(self, start: nn.Module, step: PruningStep, args: SparseSoupConfig, name: str) -> nn.Module:
        """Retrain a copy of ``start`` under ``step.masks``; a finished replica is loaded, not retrained."""
        out_dir = os.path.join(self.args.output_dir, name)
        path = os.path.join(out_dir, "model.safetensors")
        model = copy.deepcopy(start)
        if os.path.isfile(path):
            logger.info("[hf-sms] %s: finished earlier, loading %s", name, path)
            load_model(model, path)
            return model
        logger.info("[hf-sms] %s: retraining at sparsity %.4f (seed=%s, lr=%s, wd=%s, epochs=%s)", name,
                    1 - sum(int(m.sum()) for m in step.masks.values()) / sum(m.numel() for m in step.masks.values()),
                    args.seed, args.learning_rate, args.weight_decay, args.num_train_epochs)  # fmt: skip
        args = dataclasses.replace(args, output_dir=out_dir)
        trainer = SparseSoupTrainer(model, args, masks=step, train_dataset=self.train_dataset, **self.trainer_kwargs)
        trainer.train()
        os.makedirs(out_dir, exist_ok=True)
        save_model(model, path + ".tmp")
        os.replace(path + ".tmp", path)  # a half-written replica is never taken as finished
        return model

    def merge(self, candidates: list[nn.Module], val: list[float]) -> dict[str, nn.Module]:
        """Uniform and greedy soups of ``candidates`` (BatchNorm recalibrated; ``val``: their metrics)."""
        if len(candidates) == 1:
            return {"uniform": candidates[0], "greedy": candidates[0]}
        greedy = greedy_soup(
            candidates,
            evaluate=lambda m: self.evaluate(m, self.eval_dataset),
            recalibrate=self.recalibrate,
            scores=val,
            keep_ties=self.args.greedy_keep_ties,
        )
        return {"uniform": self.recalibrate(uniform_soup(candidates)), "greedy": self.recalibrate(greedy)}

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
    def _record(self, method: str, phase: int, model: nn.Module, **extra) -> dict:
        row = {
            "phase": phase + 1,
            "sparsity": sparsity_report(model)["sparsity"],
            "val": self.evaluate(model, self.eval_dataset),
            "test": self.evaluate(model, self.test_dataset),
            **extra,
        }
        self.results["rows"].setdefault(method, []).append(row)
        logger.info("[hf-sms] phase %d %s: sparsity %.4f val %s test %s", phase + 1, method, row["sparsity"],
                    _fmt(row["val"]), _fmt(row["test"]))  # fmt: skip
        return row

    def _record_sms(self, p: int, sparsity: float, cands: list[nn.Module], val: list[float], soups: dict) -> None:
        test = [self.evaluate(c, self.test_dataset) for c in cands]
        best = max(range(len(cands)), key=lambda i: val[i])  # chosen on validation, never on test
        self._record("sms_uniform", p, soups["uniform"])
        self._record("sms_greedy", p, soups["greedy"], kept=getattr(soups["greedy"], "greedy_info", {}).get("kept"))
        self._record("best_candidate", p, cands[best], index=best)
        mean = {k: sum(v) / len(v) if None not in v else None for k, v in (("val", val), ("test", test))}
        sparsity_now = self.results["rows"]["best_candidate"][-1]["sparsity"]
        self.results["rows"].setdefault("mean_candidate", []).append({"phase": p + 1, "sparsity": sparsity_now, **mean})
        diag = {"phase": p + 1, "target_sparsity": sparsity, "candidates_val": val, "candidates_test": test,
                "pairwise_l2": pairwise_l2(cands), "continued_with": self.args.merge_method}  # fmt: skip
        if self.ensemble_fn is not None:
            diag["ensemble_val"] = float(self.ensemble_fn(cands, self.eval_dataset))
            if self.test_dataset is not None:
                diag["ensemble_test"] = float(self.ensemble_fn(cands, self.test_dataset))
        self.results["sms"].append(diag)
        save_results(self.results, os.path.join(self.args.output_dir, "results.json"))

    def _check_output_dir(self) -> None:
        """Refuse to resume into a directory written by a different run configuration."""
        os.makedirs(self.args.output_dir, exist_ok=True)
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
        elif any(os.scandir(self.args.output_dir)):
            raise ValueError(
                f"{self.args.output_dir} is not empty and holds no hf-sms run.json; use a fresh --output_dir"
            )
        else:
            save_results(fingerprint, path)


def run_sms(model: nn.Module, args: SparseSoupConfig, train_dataset, metric_fn: MetricFn, **kwargs):
    """Functional entry point: ``(final_soup, results)``; see :class:`SparseModelSoup` for the arguments."""
    runner = SparseModelSoup(model, args, train_dataset, metric_fn, **kwargs)
    soup = runner.run()
    return soup, runner.results
