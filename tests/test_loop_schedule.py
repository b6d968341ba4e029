"""Every process busy (issue 29): a run's SMS trajectories and IMP baselines scheduled as one pool over the process
groups give one process's numbers; the schedule is recorded, drawn, and survives a kill -9."""

import json
import subprocess
import sys

import pytest
from conftest import finished, launch, untimed
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop_parallel import ENV, SCRIPTS, _cmd, _kill_when, _max_diff, _run, _soup

from hf_sms.loop.schedule import assign, place

POOL = ("--baselines", "imp_mx", "imp_reprune", "--merge-methods", "greedy", "uniform")


# -- the placement (pure) ------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 5), st.booleans())
def test_every_job_is_placed_within_the_list_scheduling_bound(costs, n, share):
    groups, starts = place([float(c) for c in costs], n, share)
    load = [0.0] * n
    for c, gs, t in sorted(zip(costs, groups, starts), key=lambda x: x[2]):  # in the order they start
        assert gs and len(set(gs)) == len(gs) and all(0 <= g < n for g in gs)
        assert share or len(gs) == 1
        for g in gs:
            assert load[g] <= t + 1e-6  # a group starts a job only when it is free
            load[g] = t + c / len(gs)
    assert max(load) <= sum(costs) / n + max(costs) + 1e-6  # Graham's bound for list scheduling
    assert sorted(map(len, groups)) == [1] * len(costs) or share


def test_equal_jobs_spread_as_round_robin_and_long_jobs_go_first():
    assert assign([6.0] * 5, 2) == [0, 1, 0, 1, 0]
    # m = 2 replicas, IMP and IMP_mx (twice as long) on two groups: IMP_mx beside both replicas, IMP last
    assert assign([6.0, 6.0, 6.0, 12.0], 2) == [1, 1, 0, 0]
    groups, starts = place([6.0, 6.0, 6.0, 12.0], 2, share=True)
    assert groups == [[1], [1], [0, 1], [0]] and starts[2] == 12.0  # the lone last job takes both free groups


# -- runs ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pooled_one(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    launch(SCRIPTS / "sms_digits.py", out, *POOL, nproc=1)
    return out


def _same_run(a, b) -> None:
    one, other = (json.loads((d / "results.json").read_text()) for d in (a, b))
    assert untimed(one["rows"]) == untimed(other["rows"]) and one["dense"] == other["dense"]
    assert {"imp", "imp_mx", "imp_reprune", "sms_greedy", "sms_uniform", "mean_candidate_uniform"} <= set(one["rows"])
    same = ("trajectory", "phase", "candidates_val", "candidates_test", "pairwise_l2", "ensemble_val", "kept")
    assert [{k: d.get(k) for k in same} for d in one["sms"]] == [{k: d.get(k) for k in same} for d in other["sms"]]
    assert _max_diff(_soup(a), _soup(b)) <= 1e-6


def test_two_processes_run_every_track_side_by_side_with_one_process_numbers(pooled_one, tmp_path):
    out = tmp_path / "run"
    launch(SCRIPTS / "sms_digits.py", out, *POOL, nproc=2)
    _same_run(pooled_one, out)
    world = json.loads((out / "results.json").read_text())["world"]
    assert world["processes"] == 2 and world["groups"] == 2 and world["seconds"] > 0
    train = [j for j in world["jobs"] if j["kind"] == "train"]
    # every job once (the trajectories share their first phase), on one group, both groups busy in every round
    # imp_reprune's two tracks phase by phase; the lone IMP_mx track is one job of all its phases, beside the rounds
    expected = {f"imp/phase{p}/track{i}" for p in (1, 2) for i in range(2)} | {"imp_mx"}
    expected |= {f"sms/phase{p}/replica{i}" for p in (1, 2) for i in range(2)}
    expected |= {f"sms-uniform/phase2/replica{i}" for i in range(2)}
    assert sorted(j["job"] for j in train) == sorted(expected)
    assert {j["rank"] for j in train if "phase1" in j["job"] or j["job"] == "imp_mx"} == {0, 1}  # both busy
    assert {j["rank"] for j in train if "phase2" in j["job"]} == {0, 1}
    assert all(j["end"] >= j["start"] for j in world["jobs"])
    # the timeline reads it: a row per process and a picture beside results.json
    proc = subprocess.run([sys.executable, "-m", "hf_sms.cli", "timeline", str(out)], env=ENV, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("2 process(es) in 2 group(s)") and (out / "timeline.png").is_file()


@pytest.mark.slow  # 60 s: three processes on this 2-core machine
def test_three_processes_run_every_track_with_one_process_numbers(tmp_path):
    outs = {n: tmp_path / f"run{n}" for n in (1, 3)}
    for n, out in outs.items():
        launch(SCRIPTS / "sms_digits.py", out, "--replicas", "3", "--steps", "4", *POOL, nproc=n, timeout=600)
    _same_run(outs[1], outs[3])
    jobs = json.loads((outs[3] / "results.json").read_text())["world"]["jobs"]
    assert {j["rank"] for j in jobs if j["kind"] == "train"} == {0, 1, 2}


def test_one_process_runs_the_tracks_in_turn(pooled_one):
    jobs = [j["job"] for j in json.loads((pooled_one / "results.json").read_text())["world"]["jobs"] if "job" in j]
    trajectories = [j.split("/")[0] for j in jobs]
    # Algorithm 1 for each soup method, then each baseline: the one-process order of before
    first = {t: trajectories.index(t) for t in dict.fromkeys(trajectories)}
    assert list(first) == ["sms", "sms-uniform", "imp_mx", "imp"]  # baselines imp_mx, imp_reprune (tracks "imp")
    assert first["imp_mx"] > max(i for i, t in enumerate(trajectories) if t.startswith("sms"))


def test_timeline_refuses_a_run_without_a_schedule(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"rows": {}, "phases": [0.5]}))
    proc = subprocess.run([sys.executable, "-m", "hf_sms.cli", "timeline", str(tmp_path)], env=ENV,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "records no schedule" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # 62 s; a 2-process kill -9 and resume through the rounds runs in CI (test_loop_parallel.py)
def test_a_run_killed_mid_round_resumes_without_retraining_to_the_same_numbers(pooled_one, tmp_path):
    """Jobs of skewed lengths (IMP_mx trains twice as long) on two processes, kill -9 as soon as the first job
    of phase 2 is saved: the rerun loads every finished job and gives one process's numbers."""
    out = tmp_path / "run"
    cmd = _cmd(2, "sms_digits.py", out, *POOL)
    _kill_when(cmd, out / "sms" / "phase2" / "replica0" / "sparsity.json")
    done = [str(p.parent.relative_to(out)) for p in finished(out)]  # not a temporary folder the kill left
    mtimes = {p: (out / p / "sparsity.json").stat().st_mtime_ns for p in done}
    _run(cmd)
    assert all((out / p / "sparsity.json").stat().st_mtime_ns == t for p, t in mtimes.items()), "a job retrained"
    assert not list(out.rglob(".hf_sms-*")), "a temporary folder was left behind"
    jobs = json.loads((out / "results.json").read_text())["world"]["jobs"]
    # every finished phase job is loaded (IMP_mx's phases are one job, their folders' mtimes checked above)
    assert {j["job"] for j in jobs if j.get("resumed")} == {f for f in done if not f.startswith("imp_mx/")}
    _same_run(pooled_one, out)


def test_shared_idle_groups_train_the_last_job_data_parallel(tmp_path):
    """share_idle_groups: with m = 3 on two groups the third replica of each phase finds both groups free and trains
    data-parallel over them; the masks stay exact and the rows are complete."""
    out = tmp_path / "run"
    launch(SCRIPTS / "sms_digits.py", out, "--replicas", "3", "--share", nproc=2)
    results = json.loads((out / "results.json").read_text())
    train = [j for j in results["world"]["jobs"] if j["kind"] == "train"]
    assert {j["job"]: tuple(j["groups"]) for j in train if j["rank"] == 0 and j["job"].endswith("replica2")} == {
        "sms/phase1/replica2": (0, 1), "sms/phase2/replica2": (0, 1)}  # fmt: skip
    assert {tuple(j["groups"]) for j in train if not j["job"].endswith("replica2")} == {(0,), (1,)}
    for row, sparsity in zip(results["rows"]["sms_greedy"], results["phases"], strict=True):  # masks exact
        assert row["sparsity"] == pytest.approx(sparsity, abs=0.01)
    assert [len(d["candidates_val"]) for d in results["sms"]] == [3, 3]


def test_imp_with_m_phases_splits_each_sms_phase_evenly():
    """imp_phases: with one m the schedule of n x m phases; with m per phase, every SMS sparsity on the way and the
    same fraction of the weights left removed in each sub-phase."""
    from hf_sms.baselines.imp import sub_phases
    from hf_sms.pruning.masks import phase_sparsities

    phases, report = sub_phases(phase_sparsities(0.9, 3), [2, 2, 2])
    assert phases == pytest.approx(phase_sparsities(0.9, 6), abs=1e-12) and report == {1: 0, 3: 1, 5: 2}
    phases, report = sub_phases([0.5, 0.8], [3, 1])
    assert [phases[i] for i in report] == [0.5, 0.8] and len(phases) == 4
    kept = [1.0] + [1 - s for s in phases[:3]]
    assert len({round(kept[i + 1] / kept[i], 12) for i in range(3)}) == 1  # each removes the same fraction
    assert sub_phases([0.5, 0.8], [3, 1], split=False) == ([0.5, 0.8], {0: 0, 1: 1})
