"""What a run records: one row per method and phase (sparsity, FLOP speedup, validation and every test set), the
per-phase diversity diagnostics of SMS, the dense model, and the final soup's record for ``sparsity.json`` and the
model card. It writes ``results.json`` (main process) after every phase, so an interrupted run keeps its rows."""

from __future__ import annotations

import logging
import time

from torch import nn

from ..evaluation.diagnostics import diversity, log_diversity
from ..evaluation.flops import theoretical_speedup
from ..evaluation.named import measure, metric_name
from ..evaluation.sharded import evaluate
from ..pruning.masks import sparsity_report
from ..records.hub import card_metrics
from ..records.results import save_results

logger = logging.getLogger("hf_sms")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mean(values: list) -> float | None:
    return None if None in values else sum(values) / len(values)


class Recorder:
    """The rows of a run.

    Args:
        results: the run's results dict (``phases``, ``rows``, ``sms``; filled here).
        world: the :class:`~hf_sms.loop.distributed.ReplicaWorld` (who writes, how scores are gathered).
        tests: named test sets ``{name: (dataset, metric)}``.
        metric_fn, eval_dataset, test_dataset: the selection metric, validation data and the test set scored with
            the selection metric (for the prediction ensemble).
        example: ``fn() -> one batch``, for the FLOP count.
        path: where ``results.json`` goes.
        timer: ``fn(model) -> record`` timing a model dense vs the sparse runtime (main process only), or None:
            rows then say "not measured".
        achieved: ``fn(model) -> {kind: fraction removed}``, the units the run prunes (its plan's); every row gives
            them (``"units"``, beside the weight ``"sparsity"``) where there are any.
    """

    def __init__(
        self, results, world, tests, metric_fn, eval_dataset, test_dataset, example, path, timer=None, plan=None
    ):
        self.results, self.world, self.tests = results, world, tests
        self.metric_fn, self.eval_dataset, self.test_dataset = metric_fn, eval_dataset, test_dataset
        self.example, self.path, self.timer = example, path, timer
        self.eval_seconds = 0.0
        self.plan = plan  # the units it removed, the weights it prunes

    def achieved(self, model: nn.Module) -> dict:
        return self.plan.achieved(model, self.example()) if self.plan is not None else {}

    def evaluate(self, model: nn.Module, dataset, shared=False) -> float | None:
        """The selection metric on ``dataset``; ``shared=True``: every process calls this with the same model, and
        they share the work (hf_sms.evaluation.sharded); a world (a replica's group): its processes share it; else
        this process alone evaluates."""
        return None if dataset is None else evaluate(self.metric_fn, model, dataset, self._world(shared))

    def _world(self, shared):
        return self.world if shared is True else (shared or None)

    def measure(self, model: nn.Module, val: float | None = None, timed: bool = False, shared=False) -> dict:
        """Sparsity, FLOP speedup, the measured one (``timed``: a model that can be the run's result; else None,
        "not measured"), validation (``val`` if the phase step scored it already) and every test set; ``shared``:
        as in :meth:`evaluate`."""
        units = self.achieved(model)
        start = time.perf_counter()
        scores = {
            "val": val if val is not None else self.evaluate(model, self.eval_dataset, shared),
            **self.test_scores(model, shared),
        }
        self.eval_seconds = time.perf_counter() - start  # the phase record's evaluation time (replica_scaling.py)
        return {
            "sparsity": sparsity_report(model, tensors=self.plan and self.plan.tensors(model))["sparsity"],
            **({"units": units} if units else {}),
            "speedup": theoretical_speedup(model, self.example()),
            "measured_speedup": self.speed(model) if timed and self.timer and self.world.is_main else None,
            **scores,
        }

    def test_scores(self, model: nn.Module, shared=False) -> dict:
        """``test`` (the first test set), ``tests`` (every named one) and, where a metric gives them, ``details``."""
        world = self._world(shared)
        measured = {name: measure(metric, model, dataset, world) for name, (dataset, metric) in self.tests.items()}
        out = {"test": next(iter(measured.values()))[0] if measured else None}
        out["tests"] = {name: value for name, (value, _) in measured.items()}
        details = {name: d for name, (_, d) in measured.items() if d is not None}
        return {**out, "details": details} if details else out

    def speed(self, model: nn.Module) -> dict:
        """The timer's record; a timing that fails is reported, never the end of a run that has trained."""
        try:
            return self.timer(model)
        except Exception as e:  # noqa: BLE001 - any failure of the sparse runtime on this model
            logger.warning("[hf-sms] the measured speedup failed, reported as not measured: %r", e)
            return {"speedup": None, "error": repr(e)}

    def row(self, method: str, phase: int, measured: dict, **extra) -> None:
        """Add ``method``'s row for ``phase`` (0-based): the phase's target sparsity beside the achieved figures
        (``sparsity``: pruned weights; ``units``: the fraction of each unit kind removed)."""
        phases = self.results.get("phases") or []
        target = {"target_sparsity": phases[phase]} if phase < len(phases) else {}
        row = {"phase": phase + 1, **target, **measured, **extra}
        self.results["rows"].setdefault(method, []).append(row)
        if self.world.is_main:
            units = "".join(f", {k} {100 * v:.1f}%" for k, v in (row.get("units") or {}).items())
            logger.info(
                "[hf-sms] phase %d %s: target %s, weights pruned %.2f%%%s; val %s test %s",
                phase + 1,
                method,
                f"{100 * target['target_sparsity']:.2f}%" if target else "-",
                100 * row["sparsity"],
                units,
                _fmt(row["val"]),
                _fmt(row["test"]),
            )

    def sms(self, method: str, p: int, sparsity: float, result, primary: bool = True, candidates: bool = True):
        """The rows of an SMS phase and its diagnostics (candidates' scores, pairwise distances, disagreement,
        ensemble). Rows: the soup; with ``candidates`` (copies scored as the soup is), the candidate with the best
        validation score ("best candidate", what a user can pick), the one with the best test score ("best candidate
        by test", the paper's row) and their mean, each trajectory's under its soup method's name unless
        ``primary`` (the trajectory reported as the final soup)."""
        cands, val, soup = result.candidates, result.val, result.soup
        scored = result.scored or self.candidate_scores(cands, val)
        scores = scored["tests"]
        tests = {name: [scores[i][name] for i in range(len(val))] for name in self.tests}
        test = next(iter(tests.values()), [None] * len(val))
        self.row(f"sms_{method}", p, self.measure(soup, timed=True, shared=True), kept=result.kept)
        if candidates:
            suffix = "" if primary else f"_{method}"
            soup_row = self.results["rows"][f"sms_{method}"][-1]
            same = {k: soup_row[k] for k in ("sparsity", "speedup", "measured_speedup", "units") if k in soup_row}
            picks = {"best_candidate": max(range(len(val)), key=lambda i: val[i])}  # on validation, never on test
            if None not in test:
                picks["best_candidate_by_test"] = max(range(len(val)), key=lambda i: test[i])
            for name, i in picks.items():
                picked = {"val": val[i], "test": test[i], "tests": {n: v[i] for n, v in tests.items()}}
                self.row(name + suffix, p, {**same, **picked}, index=i)
            mean = {"val": _mean(val), "test": _mean(test), "tests": {n: _mean(v) for n, v in tests.items()}}
            self.row("mean_candidate" + suffix, p, {**same, **mean})
        diag = {
            "phase": p + 1,
            "trajectory": method,
            "target_sparsity": sparsity,
            "candidates_val": val,
            "candidates_test": test,
            "candidates_tests": tests,  # every named test set (the pair soups' scatter on any of them)
            "pairwise_l2": result.pairwise_l2
            if result.pairwise_l2 is not None
            else self.world.pairwise_l2(cands, len(val), soup),
            **scored["diversity"],
            "seconds": round(result.seconds, 3),
            "eval_seconds": round(self.eval_seconds, 3),  # the soup's validation and test sets
        }
        if result.pair_soups is not None:  # pairwise_soups: each pair's soup beside its two ingredients
            diag["pair_soups"] = result.pair_soups
        self.results["sms"].append(diag)
        # in trajectory order, then phase: trajectories that run side by side record the same list as in turn
        order = {t: k for k, t in enumerate(dict.fromkeys(d["trajectory"] for d in self.results["sms"]))}
        self.results["sms"].sort(key=lambda d: (order[d["trajectory"]], d["phase"]))
        if self.world.is_main and primary:
            log_diversity(diag)
        self.save()

    def candidate_scores(self, candidates: dict, val: list) -> dict:
        """Every candidate's test scores (``{i: {test name: score}}``, gathered) and the phase's diversity
        diagnostics, from this process's ``candidates`` and every candidate's validation scores ``val``."""
        tests = {i: self.test_scores(c, self.world.group)["tests"] for i, c in candidates.items()}
        return {
            "tests": self.world.gather(tests),
            "diversity": diversity(self.metric_fn, self.world, candidates, val, self.eval_dataset, self.test_dataset),
        }

    def jobs(self, records: list[dict]) -> None:
        """Every process's records of a round (its training jobs, its wait for the other groups): results.json's
        ``world.jobs``, what ``hf-sms timeline`` draws. Every process calls it."""
        self.results["world"]["jobs"] += [r for part in self.world.all_gather(records) for r in part]

    def final_row(self, merge_method: str, pruning_method: str) -> str:
        """The row of the final soup: the SMS trajectory of ``merge_method``, else the pruning method's own."""
        name = f"sms_{merge_method}"
        return name if name in self.results["rows"] else pruning_method

    def final_metrics(self) -> dict:
        """What the final soup's ``sparsity.json`` and model card report: every evaluation of the soup beside the
        dense model, each with its metric's name and split (see :func:`hf_sms.records.hub.card_metrics`), the FLOP
        speedup and the measured one."""
        row = self.results["rows"].get(self.results["final_row"], [{}])[-1]
        results = []
        for model, measured in (("soup", row), ("dense", self.results.get("dense", {}))):
            evaluations = [("validation", measured.get("val"), self.metric_fn)]
            evaluations += [(name, measured.get("tests", {}).get(name), m) for name, (_, m) in self.tests.items()]
            results += [
                {"model": model, "split": split, "metric": metric_name(metric), "value": value}
                for split, value, metric in evaluations
                if value is not None
            ]
        return card_metrics(results=results, speedup=row.get("speedup"), measured=row.get("measured_speedup"))

    def save(self) -> None:
        if self.world.is_main:
            save_results(self.results, self.path)
