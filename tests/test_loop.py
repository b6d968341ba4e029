"""The SMS loop end to end on tiny models: rows, masks, resume, output-directory checks."""

import json
from unittest import mock

import pytest
import torch
from conftest import copy_task_rows, make_t5, neg_loss, sms_config, untimed

from hf_sms import SparseModelSoup, phase_sparsities, run_sms, sparsity_report
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.pruning.masks import masks_from_model


def _args(tmp_path, **kw):
    return sms_config(tmp_path, **kw)


def _net():
    torch.manual_seed(0)  # the same pretrained model each time: a resumed run must match it
    return DigitsResNet(width=4)


@pytest.fixture(scope="module")
def digits():
    train, val, test = load_digits_splits(seed=0)
    small = TensorDictDataset(train.x[:256], train.labels[:256], train.augment)
    return small, val, test


def test_run_sms_end_to_end_with_all_baselines(tmp_path, digits):
    train, val, test = digits
    accuracy = ClassificationAccuracy()
    args = _args(
        tmp_path,
        baselines=["imp", "imp_mx", "imp_reprune"],
        retrain_schedule="allr",
        pretrain_epochs=10,
        merge_methods=["uniform", "greedy"],
    )
    pretrained = DigitsResNet(width=4)
    before = {k: v.clone() for k, v in pretrained.state_dict().items()}
    soup, results = run_sms(pretrained, args, train, accuracy, eval_dataset=val, test_dataset=test)

    assert all(torch.equal(before[k], v) for k, v in pretrained.state_dict().items()), "input model was modified"
    candidates = {f"{row}{suffix}" for row in ("best_candidate", "best_candidate_by_test", "mean_candidate")
                  for suffix in ("", "_greedy")}  # fmt: skip
    expected = {"sms_uniform", "sms_greedy", "imp", "imp_mx", "imp_reprune", *candidates}
    assert set(results["rows"]) == expected
    for suffix in ("", "_greedy"):  # chosen on validation, and the paper's pick on test, from the same candidates
        for by_val, by_test, diag in zip(
            results["rows"]["best_candidate" + suffix], results["rows"]["best_candidate_by_test" + suffix],
            [d for d in results["sms"] if d["trajectory"] == ("greedy" if suffix else "uniform")],
        ):  # fmt: skip
            assert by_val["val"] == max(diag["candidates_val"]) and by_test["test"] == max(diag["candidates_test"])
    targets = phase_sparsities(0.8, 2)
    for method, rows in results["rows"].items():
        assert [r["phase"] for r in rows] == [1, 2]
        for row, target in zip(rows, targets):
            assert row["sparsity"] == pytest.approx(target, abs=1e-3), method
            assert 0.0 <= row["test"] <= 100.0 and 0.0 <= row["val"] <= 100.0
    assert sparsity_report(soup)["sparsity"] == pytest.approx(0.8, abs=1e-3)
    for diag in results["sms"]:
        assert len(diag["pairwise_l2"]) == 1 and diag["pairwise_l2"][0] > 0  # replicas really differ
        assert "ensemble_val" in diag and "ensemble_test" in diag
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk["rows"].keys() == results["rows"].keys()


def test_masks_only_grow_across_phases(tmp_path, digits):
    train, val, _ = digits
    accuracy = ClassificationAccuracy()
    runner = SparseModelSoup(DigitsResNet(width=4), _args(tmp_path, n_phases=2), train, accuracy, eval_dataset=val)
    seen = []
    original = runner.run_phase

    def spy(spec):
        result = original(spec)
        candidates = result.candidates
        seen.append(masks_from_model(candidates[0]))
        for c in candidates.values():  # every replica of a phase shares the mask exactly
            assert all(torch.equal(seen[-1][n], m) for n, m in masks_from_model(c).items())
        return result

    runner.run_phase = spy
    runner.run()
    assert all(bool((~seen[0][n] & seen[1][n]).sum() == 0) for n in seen[0])  # pruned in 1 stays pruned in 2


def test_resume_does_not_retrain_finished_replicas(tmp_path, digits):
    train, val, test = digits
    accuracy = ClassificationAccuracy()
    args = _args(tmp_path, baselines=["imp"])
    soup, results = run_sms(_net(), args, train, accuracy, eval_dataset=val, test_dataset=test)
    with mock.patch(
        "hf_sms.loop.sms.SparseSoupTrainer.train", side_effect=AssertionError("retrained a finished replica")
    ):
        soup2, results2 = run_sms(_net(), args, train, accuracy, eval_dataset=val, test_dataset=test)
    assert untimed(results2["rows"]) == untimed(results["rows"])
    assert all(torch.equal(a, b) for a, b in zip(soup.state_dict().values(), soup2.state_dict().values()))


def test_foreign_or_changed_output_dir_is_refused(tmp_path, digits):
    train, val, _ = digits
    accuracy = ClassificationAccuracy()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no hf-sms run.json"):
        run_sms(_net(), _args(tmp_path), train, accuracy, eval_dataset=val)
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    (tmp_path / "run" / "notes.txt").unlink()
    run_dir = SparseModelSoup(_net(), _args(tmp_path), train, accuracy, eval_dataset=val).run_dir
    run_dir.open()  # writes run.json
    run_dir.close()
    with pytest.raises(ValueError, match=r"made from something else \(changed: \['config.num_replicas'\]\)"):
        run_sms(_net(), _args(tmp_path, num_replicas=3), train, accuracy, eval_dataset=val)


def test_validation_is_split_off_train_with_a_fixed_seed(tmp_path, digits):
    train, _, _ = digits
    accuracy = ClassificationAccuracy()
    a = SparseModelSoup(DigitsResNet(width=4), _args(tmp_path), train, accuracy)
    b = SparseModelSoup(DigitsResNet(width=4), _args(tmp_path), train, accuracy)
    assert len(a.eval_dataset) == round(0.1 * len(train))
    assert a.eval_dataset.indices == b.eval_dataset.indices
    assert not set(a.eval_dataset.indices) & set(a.train_dataset.indices)


def test_run_sms_on_a_tiny_t5(tmp_path):
    model, rows = make_t5(), copy_task_rows()

    args = _args(
        tmp_path, n_phases=1, target_sparsity=0.5, learning_rate=1e-3, optim="adamw_torch", merge_methods=["greedy"]
    )
    soup, results = run_sms(model, args, rows[:32], neg_loss, eval_dataset=rows[32:])
    assert soup.lm_head.weight is soup.shared.weight  # the tie survives merging
    assert results["rows"]["sms_greedy"][0]["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert results["rows"]["sms_greedy"][0]["val"] >= max(results["sms"][0]["candidates_val"])


def test_corrupt_run_json_or_replica_gives_a_clear_error(tmp_path, digits):
    train, val, _ = digits
    accuracy = ClassificationAccuracy()
    args = _args(tmp_path, n_phases=1)
    run_sms(_net(), args, train, accuracy, eval_dataset=val)
    replica = tmp_path / "run" / "sms" / "phase1" / "replica0" / "model.safetensors"
    replica.write_bytes(replica.read_bytes()[:100])  # truncated, e.g. by a full disk
    with pytest.raises(ValueError, match="replica0 is not a readable checkpoint.*delete that folder"):
        run_sms(_net(), args, train, accuracy, eval_dataset=val)
    (tmp_path / "run" / "run.json").write_text("{not json")
    with pytest.raises(ValueError, match="run.json is corrupt"):
        run_sms(_net(), args, train, accuracy, eval_dataset=val)


def test_m_may_differ_per_phase(tmp_path, digits):
    train, val, _ = digits
    decays = [0.0, 1e-4, 1e-3]
    args = _args(
        tmp_path,
        n_phases=2,
        num_replicas=3,
        replicas_per_phase=[3, 2],
        replica_weight_decays=decays,
        baselines=["imp_mx"],
    )
    runner = SparseModelSoup(DigitsResNet(width=4), args, train, ClassificationAccuracy(), eval_dataset=val)
    runner.run()
    assert [len(d["candidates_val"]) for d in runner.results["sms"]] == [3, 2]
    assert [len(d["pairwise_l2"]) for d in runner.results["sms"]] == [3, 1]
    assert runner.recipe()["m"] == [3, 2] and runner.recipe()["replicas"][1][1]["weight_decay"] == 1e-4
    assert not (tmp_path / "run" / "sms" / "phase2" / "replica2").exists()
    with pytest.raises(ValueError, match="replicas_per_phase=.*one m per phase"):
        _args(tmp_path, n_phases=2, num_replicas=2, replicas_per_phase=[3, 2])


def test_pairwise_soups_score_every_pair_as_its_own_uniform_soup(tmp_path, digits):
    """pairwise_soups=True: every pair of a phase's 3 replicas gets its uniform soup, recalibrated and scored; each
    equals the soup made in memory from the two saved replicas (BatchNorm averaged, recalibration off: the soup's own
    path), and results.png gets the scatter."""
    from hf_sms import load_sparse, uniform_soup
    from hf_sms.records.results import pair_points, plot_results

    train, val, test = digits
    accuracy = ClassificationAccuracy()
    args = _args(tmp_path, num_replicas=3, n_phases=1, pairwise_soups=True, recalibrate_bn=False)
    _, results = run_sms(_net(), args, train, accuracy, eval_dataset=val, test_dataset=test)
    (diag,) = results["sms"]
    assert [p["pair"] for p in diag["pair_soups"]] == [[0, 1], [0, 2], [1, 2]]
    replicas = [load_sparse(str(tmp_path / "run" / "sms" / "phase1" / f"replica{i}"), _net()) for i in range(3)]
    for pair in diag["pair_soups"]:
        made = uniform_soup([replicas[i] for i in pair["pair"]])
        assert pair["val"] == accuracy(made, val) and pair["test"] == accuracy(made, test)
        assert pair["tests"] == {name: pair["test"] for name in diag["candidates_tests"]}  # every test set, by name
    # the paper's axes: the pair's soup against the better of its two ingredients, on any named test set
    better = {tuple(p["pair"]): max(diag["candidates_test"][i] for i in p["pair"]) for p in diag["pair_soups"]}
    want = sorted((better[tuple(p["pair"])], p["test"]) for p in diag["pair_soups"])
    assert sorted(pair_points([results])[1]) == want
    (name,) = diag["candidates_tests"]
    assert pair_points([results], test_set=name) == pair_points([results])
    plot_results([results], str(tmp_path / "results.png"))
    assert (tmp_path / "results.png").stat().st_size > 0
