"""Replica parallelism on 2 CPU processes (torchrun, gloo): same soup as one process, shared masks, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import TOP1_METRIC_SCRIPT, finished, launch, untimed
from safetensors.torch import load_file

SCRIPTS = Path(__file__).parent / "scripts"
REPO = str(Path(__file__).parent.parent)  # this checkout's hf_sms, whichever one pip installed
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO}


def _cmd(nproc: int, script: str, *args) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return (launcher if nproc > 1 else [sys.executable]) + [str(SCRIPTS / script), *map(str, args)]


def _run(cmd, timeout=300) -> str:
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _soup(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "soup.safetensors")


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    out = tmp_path_factory.mktemp("seq") / "run"
    launch(SCRIPTS / "sms_digits.py", out, "--baselines", "imp", "imp_reprune", "imp_phases", "imp_swa",
              "swamp", "imp_reprune_cia", "imp_reprune_caa", nproc=1)  # fmt: skip
    return out


@pytest.mark.parametrize("mode", ["replicas", "group"])
def test_world_collectives_on_two_processes(mode, tmp_path):
    out = launch(SCRIPTS / "world_checks.py", mode, tmp_path, nproc=2)
    assert out.count("OK") == 2


def test_two_processes_give_the_sequential_soup(sequential, tmp_path):
    out = tmp_path / "run"
    launch(SCRIPTS / "sms_digits.py", out, "--baselines", "imp", "imp_reprune", "imp_phases", "imp_swa",
              "swamp", "imp_reprune_cia", "imp_reprune_caa", nproc=2)  # fmt: skip
    assert _max_diff(_soup(out), _soup(sequential)) <= 1e-6
    for rank in (0, 1):  # code after run_sms sees the launcher's variables again (they were deleted for good)
        assert (out / f"env-rank{rank}.txt").read_text() == f"RANK={rank} WORLD_SIZE=2 LOCAL_RANK={rank}"
    par, seq = (json.loads((d / "results.json").read_text()) for d in (out, sequential))
    assert untimed(par["rows"]) == untimed(seq["rows"]) and par["dense"] == seq["dense"]
    assert set(par["rows"]["sms_greedy"][-1]["tests"]) == {"test", "ood", "groups"}  # named test sets in parallel
    for name in ("imp_phases", "imp_swa", "swamp", "imp_reprune_cia", "imp_reprune_caa"):  # the appendix baselines
        assert [r["sparsity"] for r in par["rows"][name]] == [r["sparsity"] for r in par["rows"]["imp"]]
    assert (out / "imp_phases" / "phase4" / "track0").is_dir()  # m = 2 phases per SMS phase, beside the replicas
    for p, s in zip(par["sms"], seq["sms"]):
        assert p["candidates_val"] == s["candidates_val"] and p["ensemble_test"] == s["ensemble_test"]
        assert p["pairwise_l2"] == pytest.approx(s["pairwise_l2"], rel=1e-9)
        assert p["pairwise_l2"][0] > 0  # the replicas really differ before the merge


@pytest.mark.parametrize("kind", ["mask_lora", pytest.param("bias_norm", marks=pytest.mark.slow)])
def test_two_processes_give_the_sequential_soup_of_subset_replicas(tmp_path, kind):
    """Replicas that train adapters (or biases and norms) exchange only those between processes: the soups of 1
    and 2 processes are bit-identical, and so are the IMP baseline (same subset) and every row. Two trajectories:
    on 2 processes their first phases share one round and its replicas, trained from the first trajectory's start,
    into which its soup is written only once the second's candidates are scored."""
    runs = {n: tmp_path / f"p{n}" for n in (1, 2)}
    for n, out in runs.items():
        launch(SCRIPTS / "sms_digits.py", out, "--replica-params", kind, "--baselines", "imp", "--pairwise",
                  "--merge-methods", "uniform", "greedy", nproc=n)  # fmt: skip
    assert _max_diff(_soup(runs[1]), _soup(runs[2])) == 0.0
    seq, par = (json.loads((d / "results.json").read_text()) for d in runs.values())
    assert untimed(par["rows"]) == untimed(seq["rows"]) and par["replica_params"] == kind
    for key in ("pairwise_l2", "pair_soups"):  # the pair soups of subset replicas too
        assert [d[key] for d in par["sms"]] == [d[key] for d in seq["sms"]]
    assert [len(d["pair_soups"]) for d in par["sms"]] == [1, 1, 1, 1]


@pytest.mark.parametrize("method", ["gmp", pytest.param("dpf", marks=pytest.mark.slow)])  # 25 s each; GMP in CI
def test_pruning_during_training_with_sms_on_two_processes(tmp_path, method):
    # the plain run before the copies is trained by one process and shared; the copies train in parallel
    outs = {n: tmp_path / f"run{n}" for n in (1, 2)}
    for n, out in outs.items():
        launch(SCRIPTS / "sms_digits.py", out, "--pruning-method", method, "--steps", "12", nproc=n)
    assert _max_diff(_soup(outs[2]), _soup(outs[1])) <= 1e-6
    par, seq = (json.loads((d / "results.json").read_text()) for d in outs.values())
    soup_rows = par["rows"]["sms_uniform" if method == "dpf" else "sms_greedy"]  # DPF: the re-pruned uniform mean
    assert untimed(par["rows"]) == untimed(seq["rows"]) and len(soup_rows) == 2  # one row per SMS phase


def test_a_process_may_sit_out_a_phase_with_fewer_replicas(tmp_path):
    # m = 2 then 1 on 2 processes: the second process owns no replica in phase 2 but joins every collective; the
    # soups that see the phase's start (DARE's seeded drop, Model Stock's angle) gather every candidate
    outs = {n: tmp_path / f"run{n}" for n in (1, 2)}
    for n, out in outs.items():
        launch(SCRIPTS / "sms_digits.py", out, "--per-phase", "2", "1", "--merge-methods", "dare", "model_stock",
                  "learned", "--pairwise", "--learned-steps", "50", nproc=n)  # fmt: skip
    # every rank closes the group accelerate opened: left open, gloo's threads can abort the exit (SIGABRT)
    assert [(outs[2] / f"exit-rank{r}.txt").read_text() for r in (0, 1)] == ["closed", "closed"]
    assert _max_diff(_soup(outs[2]), _soup(outs[1])) <= 1e-6
    par, seq = (json.loads((d / "results.json").read_text()) for d in outs.values())
    assert untimed(par["rows"]) == untimed(seq["rows"]) and [len(d["candidates_val"]) for d in par["sms"]] == [2, 1] * 3
    assert {"sms_dare", "sms_model_stock", "sms_learned"} <= set(par["rows"])  # learned: fitted by rank 0, shared
    assert [d["pair_soups"] for d in par["sms"]] == [d["pair_soups"] for d in seq["sms"]]  # every process scores
    assert [len(d["pair_soups"]) for d in par["sms"]] == [1, 0] * 3  # m = 2, then 1: no pair


# With -m slow: smp (32 s), whose 2-process run is also the PSPNet smoke run's (tests/test_smoke.py), and the
# unstructured t5 and timm runs (28 s each), whose families' 2-process runs are their structured ones here and the
# t5_wmt16 and cifar smoke runs on two processes, in CI
@pytest.mark.parametrize(
    ("family", "structure"),
    [pytest.param("t5", "unstructured", marks=pytest.mark.slow),
     pytest.param("timm", "unstructured", marks=pytest.mark.slow), ("t5", "neurons+heads"), ("timm", "filters"),
     pytest.param("smp", "unstructured", marks=pytest.mark.slow),
     pytest.param("smp", "filters", marks=pytest.mark.slow)],
)  # fmt: skip
def test_two_processes_give_the_sequential_soup_for_every_family(tmp_path, family, structure):
    # each process saves the replicas it owns in the family's own format (transformers, timm, smp)
    outs = {n: tmp_path / f"run{n}" for n in (1, 2)}
    for n, out in outs.items():
        launch(SCRIPTS / "sms_families.py", family, out, "--structure", structure, nproc=n)
    assert _max_diff(_soup(outs[2]), _soup(outs[1])) <= 1e-6
    par, seq = (json.loads((d / "results.json").read_text()) for d in outs.values())
    assert untimed(par["rows"]) == untimed(seq["rows"]) and par["dense"] == seq["dense"]
    assert (outs[2] / "sms" / "phase2" / "replica1" / "sparsity.json").is_file()  # written by rank 1
    if structure != "unstructured":  # units: the final soup is the smaller model, the same on 1 and 2 processes
        info = [json.loads((d / "final_soup" / "sparsity.json").read_text()) for d in outs.values()]
        shrunk = [i["recipe"]["shrunk"] for i in info]
        assert shrunk[0]["saved"] == "smaller" and shrunk[0] == shrunk[1]


def _kill_when(cmd, marker: Path, timeout=240) -> None:
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    # the launcher and every worker, mid-run (torchrun starts its workers in sessions of their own)
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for worker in workers:
        worker.kill()
    psutil.wait_procs(workers, timeout=30)
    proc.wait()
    assert marker.exists(), "the run ended or timed out before the kill point"
    assert not (marker.parent.parent.parent.parent / "soup.safetensors").exists(), "killed too late"


@pytest.mark.parametrize(
    ("nproc", "marker"),
    [
        (2, "sms/phase1/replica0/sparsity.json"),
        pytest.param(1, "sms/phase2/replica0/sparsity.json", marks=pytest.mark.slow),
    ],
)
def test_killed_run_resumes_to_the_same_soup(sequential, tmp_path, nproc, marker):
    out = tmp_path / "run"
    cmd = _cmd(nproc, "sms_digits.py", out, "--baselines", "imp", "imp_reprune")
    _kill_when(cmd, out / marker)
    mtimes = {p: p.stat().st_mtime_ns for p in finished(out)}  # not a temporary folder the kill left mid-write
    _run(cmd)
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items()), "a finished replica was retrained"
    assert not list(out.rglob("*.tmp")) and not list(out.rglob(".hf_sms-*")), "a temporary file was left behind"
    assert _max_diff(_soup(out), _soup(sequential)) <= 1e-6


def test_evaluation_is_shared_by_two_and_three_processes_with_identical_values(tmp_path):
    """Accuracy, subgroup recall, the mean over corrupted sets, mean IoU, BLEU (generate), an evaluate module and
    BatchNorm statistics over augmented data, also behind dropout with loader workers: each process reads its share
    of the batches, nothing twice, and every process gets the one-process value to the last digit."""
    (tmp_path / "top1.py").write_text(TOP1_METRIC_SCRIPT)
    runs = {}
    for n in (1, 2, 3):
        out = tmp_path / f"n{n}"
        out.mkdir()
        launch(SCRIPTS / "eval_shards.py", out, tmp_path / "top1.py", nproc=n)
        runs[n] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    (one,) = runs[1]
    assert one["values"]["plain"] == 144.0  # the digits validation split's size, computed by the main process
    assert 20 < one["values"]["bleu"] < 90 and 0 < one["values"]["miou"] < 100
    stats = one["values"]["batchnorm"]
    assert {v for k, v in stats.items() if "batches" in k} == {11}  # every BatchNorm saw the 11 batches
    assert all(any(x != 0 for x in v) for k, v in stats.items() if "running_mean" in k)
    for n in (2, 3):
        assert all(r["values"] == one["values"] for r in runs[n]), (n, [r["values"] for r in runs[n]])
        reads = [r["reads"] for r in runs[n]]
        assert sum(reads) == one["reads"]  # no example read twice
        assert max(reads) <= one["reads"] / n + 3 * 32 + 16 + 4 + 4 + 16  # a batch over a fair share, per set


@pytest.mark.slow  # 36 s; the metrics and BatchNorm passes on 3 processes run in CI (the test above)
def test_three_processes_give_every_row_and_diagnostic_of_one(tmp_path):
    """m = 3 on 3 processes: every row (soups, candidates, IMP, dense), every diagnostic and the soup (its BatchNorm
    statistics recalibrated by the three together) equal one process's."""
    outs = {n: tmp_path / f"run{n}" for n in (1, 3)}
    for n, out in outs.items():
        launch(SCRIPTS / "sms_digits.py", out, "--replicas", "3", "--steps", "4", "--baselines", "imp", nproc=n)
    one, three = (json.loads((outs[n] / "results.json").read_text()) for n in (1, 3))
    assert untimed(one["rows"]) == untimed(three["rows"]) and one["dense"] == three["dense"]
    for a, b in zip(one["sms"], three["sms"], strict=True):
        same = ("candidates_val", "candidates_test", "ensemble_val", "ensemble_test", "disagreement_val")
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
    soups = [_soup(outs[n]) for n in (1, 3)]
    assert all(torch.equal(soups[0][k], soups[1][k]) for k in soups[0] if "running" in k)
    assert _max_diff(*soups) <= 1e-6


@pytest.mark.slow  # 26 s; the LLaMA smoke run on 2 processes shards its replicas in CI (tests/test_sharding.py)
def test_a_replica_sharded_over_its_group_trains_as_the_data_parallel_group(tmp_path):
    """replica_sharding="fsdp", m = 1 on 2 processes: the replica (and IMP's) trains with each process holding
    half of every parameter (FSDP2), and the run gives the soup and rows of the same group training data-parallel."""
    outs = {mode: tmp_path / mode for mode in ("none", "fsdp")}
    for mode, out in outs.items():
        launch(SCRIPTS / "sms_digits.py", out, "--replicas", "1", "--phases", "1", "--steps", "4", "--baselines", "imp",
                  "--sharding", mode, nproc=2)  # fmt: skip
    assert _max_diff(_soup(outs["fsdp"]), _soup(outs["none"])) <= 1e-6
    par, seq = (json.loads((outs[m] / "results.json").read_text()) for m in ("fsdp", "none"))
    assert untimed(par["rows"]) == untimed(seq["rows"]) and set(par["rows"]) >= {"sms_greedy", "imp"}
    held = [
        [json.loads(line) for line in (outs["fsdp"] / f"held-rank{r}.json").read_text().splitlines()] for r in (0, 1)
    ]
    assert len(held[0]) == len(held[1]) == 4 * 2  # 4 steps of SMS and of IMP, on both processes
    for a, b in zip(*held):
        assert a["sharded"] and b["sharded"] and a["held"] + b["held"] == a["of"] == b["of"]
    assert not (outs["none"] / "held-rank0.json").exists()
