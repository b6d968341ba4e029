"""Bad inputs fail before any training with a message that says how to fix them, and a run folder can only
ever hold one run (issue: redesign along the seams)."""

import json
from unittest import mock

import pytest
import torch
from conftest import fake_hub, sms_config

from hf_sms import SparseModelSoup, SparseSoupConfig, SparseSoupTrainer, run_sms
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.registry import SOUPS
from hf_sms.soup import SoupMethod, indicator_weights


def _args(tmp_path, **kw):
    return sms_config(tmp_path, **{**dict(target_sparsity=0.5, n_phases=1, max_steps=2), **kw})


def _net(seed=0):
    torch.manual_seed(seed)
    return DigitsResNet(width=4)


@pytest.fixture(scope="module")
def digits():
    train, val, test = load_digits_splits(seed=0)
    return TensorDictDataset(train.x[:96], train.labels[:96]), val, test


@pytest.fixture
def no_training():
    with mock.patch.object(SparseSoupTrainer, "train", side_effect=AssertionError("training started")) as train:
        yield train


# -- the run directory ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "changed"),
    [
        ({"model": 1}, "model"),
        ({"data": 1}, "data.train"),
        ({"validation_fraction": 0.2}, "config.validation_fraction"),
        ({"adam_beta2": 0.99}, "config.adam_beta2"),
        ({"label_smoothing_factor": 0.1}, "config.label_smoothing_factor"),
    ],
)
def test_a_rerun_made_from_anything_else_is_refused(tmp_path, digits, change, changed, no_training):
    train, val, _ = digits
    first = SparseModelSoup(_net(), _args(tmp_path), train, ClassificationAccuracy(), eval_dataset=val)
    first.run_dir.open()
    first.run_dir.close()
    model = _net(seed=change.get("model", 0))
    data = TensorDictDataset(train.x.flip(0), train.labels.flip(0)) if "data" in change else train
    config = {k: v for k, v in change.items() if k not in ("model", "data")}
    runner = SparseModelSoup(model, _args(tmp_path, **config), data, ClassificationAccuracy(), eval_dataset=val)
    with pytest.raises(ValueError, match=rf"made from something else \(changed: \[.*'{changed}'"):
        runner.run()


def test_fields_that_cannot_change_results_do_not_block_a_resume(tmp_path, digits):
    train, val, _ = digits
    a = SparseModelSoup(_net(), _args(tmp_path), train, ClassificationAccuracy(), eval_dataset=val).run_dir
    b = SparseModelSoup(
        _net(), _args(tmp_path, logging_steps=7, disable_tqdm=False), train, ClassificationAccuracy(), eval_dataset=val
    ).run_dir
    assert a.fingerprint == b.fingerprint


def test_a_second_process_on_the_same_folder_is_refused_at_once(tmp_path, digits):
    train, val, _ = digits
    first = SparseModelSoup(_net(), _args(tmp_path), train, ClassificationAccuracy(), eval_dataset=val)
    second = SparseModelSoup(_net(), _args(tmp_path), train, ClassificationAccuracy(), eval_dataset=val)
    first.run_dir.open()
    try:
        with pytest.raises(RuntimeError, match="another hf-sms process is running in .*wait for it"):
            second.run()
    finally:
        first.run_dir.close()
    second.run_dir.open()  # released: the next run may go on
    second.run_dir.close()


# -- errors before work --------------------------------------------------------------------------------
def test_empty_or_missing_inputs_fail_before_training(tmp_path, digits, no_training):
    train, val, _ = digits
    accuracy = ClassificationAccuracy()
    with pytest.raises(ValueError, match="the validation set is empty"):
        SparseModelSoup(_net(), _args(tmp_path, merge_methods=["greedy"]), train, accuracy, eval_dataset=[])
    with pytest.raises(ValueError, match="metric_fn must be a callable"):
        SparseModelSoup(_net(), _args(tmp_path), train, None, eval_dataset=val)
    with pytest.raises(ValueError, match="the training set is empty.*lower validation_fraction"):
        SparseModelSoup(_net(), _args(tmp_path), TensorDictDataset(train.x[:1], train.labels[:1]), accuracy)
    unlabelled = [{"x": x} for x in train.x[:8]]
    with pytest.raises(ValueError, match=r"no \['labels'\].*rename_column"):
        SparseModelSoup(_net(), _args(tmp_path), unlabelled, accuracy, eval_dataset=val)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"baselines": ["imp_reprune"], "num_replicas": 1}, "needs num_replicas >= 2"),
        ({"pretrain_epochs": -3}, "pretrain_epochs .* must be > 0"),
        ({"num_replicas": "2"}, "num_replicas must be an integer"),
        ({"merge_methods": []}, "must name each soup method once"),
        ({"replica_sharding": "ddp"}, "replica_sharding='ddp' is unknown; choose 'none' or 'fsdp'"),
        ({"replica_sharding": "fsdp", "replica_params": "mask_lora"}, "use replica_params='all'"),
    ],
)
def test_bad_config_fails_at_construction(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **fields)


def test_all_false_masks_are_refused():
    model = _net()
    masks = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in model.named_parameters() if p.dim() > 1}
    with pytest.raises(ValueError, match="prune every weight"):
        SparseSoupTrainer(model, SparseSoupConfig(output_dir="unused", use_cpu=True), masks=masks)


def test_the_token_never_shows_in_the_config_repr():
    args = SparseSoupConfig(output_dir="x", hub_token="hf_very_secret")
    assert "hf_very_secret" not in repr(args) and "hf_very_secret" not in str(args)


def test_push_to_hub_is_checked_before_training_and_then_really_pushes(tmp_path, digits, monkeypatch):
    train, val, _ = digits
    accuracy = ClassificationAccuracy()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with mock.patch.object(SparseSoupTrainer, "train", side_effect=AssertionError("training started")):
        with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
            SparseModelSoup(_net(), _args(tmp_path, push_to_hub=True), train, accuracy, eval_dataset=val)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with mock.patch("huggingface_hub.HfApi.whoami", side_effect=OSError("no network")):
        with pytest.raises(ValueError, match="does not accept these credentials.*hf auth login"):
            SparseModelSoup(_net(), _args(tmp_path, push_to_hub=True), train, accuracy, eval_dataset=val)
    args = _args(tmp_path, push_to_hub=True, hub_model_id="me/soup", hub_token="hf_secret")
    with (
        mock.patch("huggingface_hub.HfApi.whoami", return_value={"name": "me"}),
        fake_hub("me/soup") as sent,
    ):
        run_sms(_net(), args, train, accuracy, eval_dataset=val, model_card={"datasets": ["digits"]})
    assert sent["create"].call_args.args[0] == "me/soup"
    assert {"README.md", "model.safetensors", "sparsity.json"} <= set(sent["files"])
    assert b"datasets:\n- digits" in sent["files"]["README.md"]


# -- merge methods are policies the loop dispatches ------------------------------------------------------
def test_a_registered_merge_method_runs_end_to_end(tmp_path, digits):
    train, val, test = digits

    def best_only(scores, trial, config):
        return indicator_weights([max(range(len(scores)), key=scores.__getitem__)], len(scores))

    SOUPS.add("best_only", SoupMethod(best_only, needs_validation=True))
    try:
        args = _args(tmp_path, merge_methods=["best_only"], num_replicas=3)
        soup, results = run_sms(_net(), args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=test)
        row, diag = results["rows"]["sms_best_only"][0], results["sms"][0]
        assert len(row["kept"]) == 1
        assert row["val"] == pytest.approx(max(diag["candidates_val"]))
    finally:
        SOUPS.remove("best_only")


# -- replicas are real checkpoints ------------------------------------------------------------------------
def test_the_readme_merge_command_works_on_the_folders_a_run_writes(tmp_path, digits, monkeypatch, capsys):
    from pathlib import Path

    from hf_sms import load_sparse
    from hf_sms.cli import main
    from hf_sms.soup import average_state_dicts

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    command = "hf-sms merge run/sms/phase3/replica0 run/sms/phase3/replica1 --method uniform --output soup"
    assert command in readme
    train, val, _ = digits
    monkeypatch.chdir(tmp_path)
    run_sms(_net(), _args(tmp_path, n_phases=3), train, ClassificationAccuracy(), eval_dataset=val)
    assert main(command.split()[1:]) == 0
    assert main(["inspect", "soup"]) == 0 and "sparsity" in capsys.readouterr().out
    replicas = [load_sparse(f"run/sms/phase3/replica{i}", _net()) for i in range(2)]
    expected = average_state_dicts([r.state_dict() for r in replicas])
    soup = load_sparse("soup", _net())
    assert all(torch.equal(soup.state_dict()[k], v) for k, v in expected.items())
    convert = "hf-sms convert soup --output soup-dense --format dense"
    assert convert in readme and main(convert.split()[1:]) == 0
    dense = load_sparse("soup-dense", _net())
    assert all(torch.equal(dense.state_dict()[k], v) for k, v in soup.state_dict().items())
    assert json.loads(Path("soup-dense/sparsity.json").read_text())["format"] == "dense"


class _WithUnusedStage(torch.nn.Module):
    """A stage that is built but never called (as smp's own encoders keep theirs at ``encoder_depth < 5``)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.used(x).mean((2, 3)))


def test_weights_that_no_forward_uses_are_warned_about_before_training(tmp_path, caplog):
    """They would be pruned and counted like the rest: a global allocation and every reported sparsity skewed."""
    import segmentation_models_pytorch as smp
    from conftest import make_pspnet, make_t5

    from hf_sms.loop.checks import warn_unused_weights

    images = {"x": torch.randn(2, 3, 32, 32)}
    native = smp.PSPNet(encoder_name="resnet18", encoder_weights=None, encoder_depth=3, classes=2)
    unused = warn_unused_weights(native, images)
    assert unused and all(n.startswith(("encoder.layer3.", "encoder.layer4.")) for n in unused)
    assert len(unused) == 10  # ResNet-18's last two stages: 4 convs each and a downsampling conv each
    ids = torch.randint(2, 384, (2, 6))
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)  # MHA reads out_proj without calling it
    for model, batch in (
        (make_pspnet(), images),
        (make_t5(), {"input_ids": ids, "labels": ids}),
        (layer, torch.randn(2, 3, 8)),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_sms.loop.checks"):
            assert warn_unused_weights(model, batch) == [], type(model).__name__
        assert "no gradient" not in caplog.text
    assert native.training and all(p.grad is None for p in native.parameters())  # the model is left as it was

    data = [{"x": torch.randn(3, 8, 8), "labels": torch.tensor(i % 4)} for i in range(8)]
    with caplog.at_level("WARNING", logger="hf_sms.loop.checks"):
        SparseModelSoup(_WithUnusedStage(), _args(tmp_path), data[:4], ClassificationAccuracy(), eval_dataset=data[4:])
    assert "144 prunable weights" in caplog.text and "unused.weight" in caplog.text, caplog.text


def test_sharded_replicas_need_groups_of_several_processes(tmp_path):
    """replica_sharding='fsdp' on groups of one (1 process, or N <= m) is refused before any work, saying what to
    launch; groups of k >= 2 pass."""
    from types import SimpleNamespace

    from hf_sms.loop.checks import check_world

    args = _args(tmp_path, replica_sharding="fsdp", num_replicas=2)
    with pytest.raises(ValueError, match=r"groups of one: launch k \* num_replicas processes with k >= 2"):
        check_world(args, SimpleNamespace(group_size=1, size=2))
    check_world(args, SimpleNamespace(group_size=2, size=4))


def test_the_unused_weight_check_forwards_one_example():
    """Which weights a forward uses does not depend on the batch size; the graph of a whole long-sequence batch was
    the peak of a subset replica's phase (benchmarks/replica_memory.py --seq 256). Dicts, tuples and tensors are cut
    to their first example; what is not a batch dimension stays."""
    from hf_sms.loop.checks import _first_example, warn_unused_weights

    class Seen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.unused, self.sizes = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2), []

        def forward(self, x):
            self.sizes.append(x.shape[0])
            return self.fc(x)

    model = Seen()
    assert warn_unused_weights(model, torch.randn(8, 4)) == ["unused.weight"] and model.sizes == [1]
    batch = {"input_ids": torch.ones(8, 5), "scale": torch.tensor(2.0), "name": "x", "pair": (torch.ones(8), [1, 2])}
    one = _first_example(batch)
    assert one["input_ids"].shape == (1, 5) and one["scale"].shape == () and one["name"] == "x"
    assert one["pair"][0].shape == (1,) and one["pair"][1] == [1, 2]
