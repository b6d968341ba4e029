"""SparseSoupTrainer on tiny T5 / timm ResNet / plain CNN: it learns, masks stay exact, checkpoints resume."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
from conftest import make_cnn, make_resnet, make_t5, training_args
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TrainerCallback, TrainingArguments

from hf_sms import PruningStep, SparseSoupConfig, SparseSoupTrainer, compute_masks, prunable_tensors, prune
from hf_sms.checkpoint.constants import MASKS_NAME
from hf_sms.checkpoint.trainer_masks import load_masks, save_masks
from hf_sms.seeding import derive_seed

MODELS = {"t5": make_t5, "resnet": make_resnet, "cnn": make_cnn}


def dataset_for(kind, t5_dataset, image_dataset):
    return t5_dataset if kind == "t5" else image_dataset


def inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper


def assert_masked(model, masks, optimizer=None) -> None:
    tensors = {t.name: t.param for t in prunable_tensors(model)}
    for name, mask in masks.items():
        p = tensors[name]
        assert (p.detach()[~mask.to(p.device)] == 0.0).all(), f"{name}: a pruned weight revived"
        if optimizer is not None:
            for key, v in inner(optimizer).state.get(p, {}).items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    assert (v[~mask] == 0).all(), f"{name}: optimizer state {key!r} nonzero on pruned entries"


class MaskChecker(TrainerCallback):
    """Checks the masks after every optimizer step, after every other callback's on_optimizer_step ran."""

    def __init__(self):
        self.masks = None
        self.steps = 0

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        assert_masked(model, self.masks, optimizer)
        self.steps += 1


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# -- learning under masks ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "optim", "lr", "allocation"),
    [("t5", "adamw_torch", 1e-1, "uniform"), ("resnet", "adamw_torch", 1e-2, "global"), ("cnn", "sgd", 5e-2, "lamp")],
)
def test_trains_under_masks(kind, optim, lr, allocation, make_args, t5_dataset, image_dataset):
    model = MODELS[kind]()
    checker = MaskChecker()
    args = make_args(
        SparseSoupConfig,
        max_steps=40,
        learning_rate=lr,
        optim=optim,
        optim_args="momentum=0.9" if optim == "sgd" else None,
        target_sparsity=0.5,
        allocation=allocation,  # uniform for T5: global would prune its tiny q matrices away entirely
        per_device_train_batch_size=8,
    )
    trainer = SparseSoupTrainer(
        model, args, train_dataset=dataset_for(kind, t5_dataset, image_dataset), callbacks=[checker]
    )
    masks = trainer.masks
    checker.masks = masks
    n_pruned = sum(int((~m).sum()) for m in masks.values())
    assert n_pruned == round(0.5 * sum(m.numel() for m in masks.values()))
    before = {t.name: t.param.detach().clone() for t in prunable_tensors(model)}
    assert_masked(model, masks)  # pruned on construction

    trainer.train()

    assert checker.steps == 40
    loss = losses(trainer)
    assert sum(loss[-5:]) / 5 < 0.8 * sum(loss[:5]) / 5, f"loss did not go down: {loss[:5]} -> {loss[-5:]}"
    for t in prunable_tensors(model):
        m = masks[t.name]
        assert (t.param.detach()[~m] == 0).all()
        if m.any():
            assert not torch.equal(t.param.detach()[m], before[t.name][m]), f"{t.name} did not train"
    logged = [h["weight_sparsity"] for h in trainer.state.log_history if "weight_sparsity" in h]
    assert len(logged) >= 40 and all(s == pytest.approx(0.5, abs=1e-5) for s in logged)


OPTIMS = {
    "sgd": dict(optim="sgd", optim_args="momentum=0.9"),
    "sgd_nesterov": dict(optim="sgd", optim_args="momentum=0.9,nesterov=true"),
    "adamw": dict(optim="adamw_torch"),
    "adafactor": dict(optim="adafactor"),
}


def run_with(make_args, dataset, kind, optim, accum, clip, bf16, weight_decay, sparsity=0.7, steps=6):
    checker = MaskChecker()
    args = make_args(
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accum,
        max_grad_norm=clip,
        bf16=bf16,
        weight_decay=weight_decay,
        **OPTIMS[optim],
    )  # plain TrainingArguments: the trainer converts them
    model = MODELS[kind]()
    masks = compute_masks(model, sparsity)
    trainer = SparseSoupTrainer(model, args, masks=masks, train_dataset=dataset, callbacks=[checker])
    checker.masks = masks
    trainer.train()
    assert checker.steps == steps
    assert_masked(model, masks, trainer.optimizer)
    return trainer


@pytest.mark.parametrize("optim", sorted(OPTIMS))
def test_every_optimizer_with_accumulation_clipping_bf16_and_decay(optim, make_args, image_dataset):
    trainer = run_with(make_args, image_dataset, "cnn", optim, accum=2, clip=0.5, bf16=True, weight_decay=0.1)
    assert isinstance(trainer.args, SparseSoupConfig)
    assert trainer.args.bf16 and trainer.args.gradient_accumulation_steps == 2
    if optim != "adafactor":  # Adafactor factors its second moment; SGD/AdamW keep parameter-shaped state
        p = trainer.model.fc1.weight
        assert any(v.shape == p.shape and v.abs().sum() > 0 for v in inner(trainer.optimizer).state[p].values())


@settings(max_examples=6, deadline=None)
@given(
    kind=st.sampled_from(["cnn", "t5"]),
    optim=st.sampled_from(sorted(OPTIMS)),
    accum=st.sampled_from([1, 2]),
    clip=st.sampled_from([0.0, 0.3, 1.0]),
    bf16=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.05]),
    sparsity=st.floats(0.2, 0.95),
)
def test_masks_exact_under_any_training_arguments(
    kind, optim, accum, clip, bf16, weight_decay, sparsity, t5_dataset, image_dataset
):
    with tempfile.TemporaryDirectory() as out:  # a fresh directory per example
        make = functools.partial(training_args, out)
        run_with(
            make, dataset_for(kind, t5_dataset, image_dataset), kind, optim, accum, clip, bf16, weight_decay, sparsity
        )


def test_masks_can_be_a_pruning_step_and_plain_args_get_labels(make_args, image_dataset):
    model = make_cnn()
    step = prune(model, 0.6, "erk")
    trainer = SparseSoupTrainer(model, make_args(max_steps=2), masks=step, train_dataset=image_dataset)
    assert trainer.pruning_step is step and trainer.args.label_names == ["labels"]
    trainer.train()
    assert_masked(model, step.masks, trainer.optimizer)


# -- checkpoints -------------------------------------------------------------------------------------
def test_resume_restores_the_saved_masks(make_args, image_dataset, out_dir):
    args = make_args(SparseSoupConfig, max_steps=6, save_strategy="steps", save_steps=3, optim="adamw_torch")
    model = make_resnet(seed=0)
    saved = compute_masks(model, 0.6)
    SparseSoupTrainer(model, args, masks=saved, train_dataset=image_dataset).train()
    ckpt = os.path.join(out_dir, "checkpoint-3")
    assert os.path.isfile(os.path.join(ckpt, MASKS_NAME))
    on_disk = load_masks(ckpt)
    assert set(on_disk) == set(saved) and all(torch.equal(on_disk[n], saved[n]) for n in saved)

    # A fresh model, pruned differently (30%, uniform): resuming must bring back the checkpoint's 60% mask.
    fresh = make_resnet(seed=1)
    args = make_args(SparseSoupConfig, max_steps=6, optim="adamw_torch", target_sparsity=0.3, allocation="uniform")
    checker = MaskChecker()
    trainer = SparseSoupTrainer(fresh, args, train_dataset=image_dataset, callbacks=[checker])
    other = trainer.masks
    assert any(not torch.equal(other[n], saved[n]) for n in saved)
    checker.masks = saved
    trainer.train(resume_from_checkpoint=ckpt)

    assert checker.steps == 3  # steps 4..6
    assert all(torch.equal(trainer.masks[n].cpu(), saved[n]) for n in saved)
    assert_masked(fresh, saved, trainer.optimizer)
    alive_here_only = {n: saved[n] & ~other[n] for n in saved}  # pruned by the fresh trainer, alive in the checkpoint
    assert any((t.param.detach()[alive_here_only[t.name]] != 0).any() for t in prunable_tensors(fresh))
    logged = [h["weight_sparsity"] for h in trainer.state.log_history if "weight_sparsity" in h]
    n = sum(m.numel() for m in saved.values())
    assert logged[-1] == pytest.approx(sum(int((~m).sum()) for m in saved.values()) / n, abs=1e-6)
    # The final save carries the masks too.
    assert all(torch.equal(load_masks(os.path.join(out_dir, "checkpoint-6"))[k], saved[k]) for k in saved)


def test_resume_true_picks_the_last_checkpoint(make_args, image_dataset, out_dir):
    args = make_args(SparseSoupConfig, max_steps=4, save_strategy="steps", save_steps=2)
    model = make_cnn()
    saved = compute_masks(model, 0.5)
    SparseSoupTrainer(model, args, masks=saved, train_dataset=image_dataset).train()
    args = make_args(SparseSoupConfig, max_steps=6, target_sparsity=0.8)
    trainer = SparseSoupTrainer(make_cnn(seed=3), args, train_dataset=image_dataset)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 6
    assert all(torch.equal(trainer.masks[n], saved[n]) for n in saved)
    assert_masked(trainer.model, saved, trainer.optimizer)


def test_save_model_writes_masks(make_args, image_dataset, out_dir, tmp_path):
    trainer = SparseSoupTrainer(make_cnn(), make_args(SparseSoupConfig, max_steps=1), train_dataset=image_dataset)
    trainer.save_model(str(tmp_path / "final"))
    masks = load_masks(str(tmp_path / "final"))
    assert all(torch.equal(masks[n], trainer.masks[n]) for n in trainer.masks)
    assert load_masks(str(tmp_path)) is None
    save_masks({"a": torch.tensor([True, False])}, str(tmp_path / "x"))
    assert load_masks(str(tmp_path / "x"))["a"].tolist() == [True, False]


def test_resume_from_a_foreign_checkpoint_is_explained(make_args, image_dataset, tmp_path):
    trainer = SparseSoupTrainer(make_cnn(), make_args(max_steps=1), train_dataset=image_dataset)
    with pytest.raises(ValueError, match="holds no sparse_masks.safetensors: it was not saved by SparseSoupTrainer"):
        trainer.train(resume_from_checkpoint=str(tmp_path))


# -- bad input -------------------------------------------------------------------------------------
def test_masks_for_another_model_are_explained(make_args, image_dataset):
    masks = compute_masks(make_t5(), 0.5)
    with pytest.raises(ValueError, match="'shared.weight', which is not a prunable weight.*compute_masks"):
        SparseSoupTrainer(make_cnn(), make_args(), masks=masks, train_dataset=image_dataset)
    wrong = {"fc1.weight": torch.ones(8, 16, dtype=torch.bool)}
    with pytest.raises(ValueError, match=r"shape \(8, 16\) but the weight has shape \(16, 8\)"):
        SparseSoupTrainer(make_cnn(), make_args(), masks=wrong, train_dataset=image_dataset)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (dict(target_sparsity=1.0), r"sparsity must be a fraction in \[0, 1\)"),
        (dict(target_sparsity=-0.2), r"sparsity must be a fraction in \[0, 1\)"),
        (dict(n_phases=0), "n_phases must be a positive integer"),
        (
            dict(allocation="random"),
            r"allocation='random': unknown allocation 'random'; choose one of \['erk', 'filter_l1', 'filter_l2', 'glob",
        ),
        (
            dict(retrain_schedule="cosine"),
            r"retrain_schedule='cosine': unknown retraining schedule 'cosine'; choose one of",
        ),
        (dict(merge_methods=["swamp"]), r"merge_methods='swamp': unknown soup method 'swamp'; choose one of"),
        (dict(num_replicas=0), "num_replicas must be an integer >= 1"),
        (dict(replica_seeds=[1, 2]), "replica_seeds has 2 entries but num_replicas=3; give one per replica"),
        (dict(replica_weight_decays=[0.1]), "replica_weight_decays has 1 entries.*give one per replica"),
        (dict(replica_learning_rates=[0.1] * 4), "replica_learning_rates has 4 entries.*give one per replica"),
        (dict(replica_epochs=[1.0, 2.0]), "replica_epochs has 2 entries.*give one per replica"),
        (dict(baselines=["imp", "lth"]), r"baselines='lth': unknown baseline 'lth'; choose one of"),
        (dict(validation_fraction=1.0), r"validation_fraction must be in \(0, 1\)"),
        (dict(retrain_schedule="allr"), "set pretrain_epochs"),
        (dict(bn_recalibration_batches=0), "bn_recalibration_batches=0 must be a positive number of batches"),
    ],
)
def test_bad_config_is_explained(overrides, fragment, out_dir):
    with pytest.raises(ValueError, match=fragment):
        SparseSoupConfig(output_dir=out_dir, **overrides)


def test_plain_training_arguments_are_validated_on_conversion(out_dir, make_args, image_dataset):
    args = TrainingArguments(output_dir=out_dir, report_to="none", use_cpu=True, max_steps=1)
    trainer = SparseSoupTrainer(make_cnn(), args, train_dataset=image_dataset)
    assert isinstance(trainer.args, SparseSoupConfig) and trainer.args.max_steps == 1
    assert trainer.args.target_sparsity == 0.9  # the default applies when pruning in one shot
    n = sum(m.numel() for m in trainer.masks.values())
    assert sum(int((~m).sum()) for m in trainer.masks.values()) == round(0.9 * n)


def test_replica_overrides(out_dir):
    cfg = SparseSoupConfig(
        output_dir=out_dir, num_replicas=2, seed=7, replica_weight_decays=[0.0, 0.1], replica_learning_rates=[0.1, 0.2]
    )
    seeds = [derive_seed(7, "sms", 0, i) for i in range(2)]
    assert cfg.replica_overrides() == [
        {
            "seed": seeds[0],
            "weight_decay": 0.0,
            "learning_rate": 0.1,
            "pretrain_learning_rate": 0.1,
            "retrain_schedule": "llr",
        },
        {
            "seed": seeds[1],
            "weight_decay": 0.1,
            "learning_rate": 0.2,
            "pretrain_learning_rate": 0.2,
            "retrain_schedule": "llr",
        },
    ]


def test_pruning_step_masks_applied_on_construction(make_args, image_dataset):
    model = make_cnn()
    masks = compute_masks(model, 0.4)
    step = PruningStep.measure(model, masks)
    assert step.phase_fraction == pytest.approx(0.4, abs=1e-2) and step.norm_fraction > 0
    trainer = SparseSoupTrainer(model, make_args(), masks=masks, train_dataset=image_dataset)
    assert_masked(model, masks)
    assert trainer.pruning_step.phase_fraction == pytest.approx(step.phase_fraction)


class LRRecorder(TrainerCallback):
    def __init__(self):
        self.lrs: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def test_resume_keeps_the_allr_start_rate(make_args, image_dataset, out_dir):
    """ALLR's start rate depends on the pruning step; a resumed run must use the checkpoint's, not its own."""
    common = dict(retrain_schedule="allr", pretrain_epochs=30, learning_rate=0.05, max_steps=6)
    first = LRRecorder()
    model = make_cnn()
    step = prune(model, 0.6)
    args = make_args(SparseSoupConfig, save_strategy="steps", save_steps=3, **common)
    SparseSoupTrainer(model, args, masks=step, train_dataset=image_dataset, callbacks=[first]).train()

    resumed = LRRecorder()
    args = make_args(SparseSoupConfig, target_sparsity=0.2, **common)  # a much smaller norm drop
    trainer = SparseSoupTrainer(make_cnn(seed=1), args, train_dataset=image_dataset, callbacks=[resumed])
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-3"))
    assert resumed.lrs == pytest.approx(first.lrs[3:])
    assert trainer.pruning_step.norm_fraction == pytest.approx(step.norm_fraction)
    assert trainer.pruning_step.phase_fraction == pytest.approx(step.phase_fraction)


def test_the_card_survives_the_trainers_own_card_and_save_order(tmp_path, t5_dataset):
    """Issue 30: transformers' create_model_card overwrote hf-sms's card, so a folder in the sparse format said
    nothing of needing hf-sms. Now the folder holds hf-sms's card first, with the Trainer's part under it, whatever
    the order of save_model and create_model_card, and once however often they run."""
    from hf_sms.checkpoint.card import CARD_MARK
    from hf_sms.checkpoint.trainer_card import HEADING

    args = training_args(str(tmp_path), max_steps=2)
    trainer = SparseSoupTrainer(make_t5(), args, train_dataset=t5_dataset)
    trainer.train()
    trainer.create_model_card(model_name="tiny")  # before the soup is saved: the Trainer's card alone
    trainer.save_model()
    for _ in range(2):
        trainer.create_model_card(model_name="tiny")
        trainer.save_model()
    card = (tmp_path / "README.md").read_text()
    assert card.index(CARD_MARK) < card.index("Loading needs hf-sms") < card.index(HEADING)
    assert card.count(HEADING) == 1 and "generated automatically" in card.split(HEADING)[1]


def test_the_trainers_push_to_hub_uploads_hf_sms_card_first(tmp_path, t5_dataset):
    """save_model with push_to_hub pushed transformers' folder before hf-sms saved the soup into it; now the folder
    uploaded holds the sparse soup with hf-sms's card first."""
    from types import SimpleNamespace
    from unittest import mock

    from hf_sms import load_sparse
    from hf_sms.checkpoint.card import CARD_MARK

    uploaded = []

    def upload_folder(self, folder_path, **kwargs):  # what the Hub would get: the folder as it is now
        uploaded.append({f: open(os.path.join(folder_path, f), "rb").read() for f in os.listdir(folder_path)
                         if os.path.isfile(os.path.join(folder_path, f))})  # fmt: skip
        return SimpleNamespace(commit_url="https://huggingface.co/me/r/commit/abc", oid="abc")

    args = training_args(str(tmp_path), max_steps=2, push_to_hub=True, hub_model_id="me/r", hub_token="hf_x")
    with (
        mock.patch("huggingface_hub.HfApi.create_repo", return_value=SimpleNamespace(repo_id="me/r")),
        mock.patch("huggingface_hub.HfApi.upload_folder", upload_folder),
    ):
        trainer = SparseSoupTrainer(make_t5(), args, train_dataset=t5_dataset)
        trainer.train()
        trainer.save_model()
        trainer.push_to_hub()
    for files in uploaded[-2:]:  # save_model's push and push_to_hub's
        card = files["README.md"].decode()
        assert card.index(CARD_MARK) < card.index("Loading needs hf-sms"), card[:300]
        assert "sparsity.json" in files
    from hf_sms.checkpoint.reader import SparseCheckpoint

    assert SparseCheckpoint(str(tmp_path)).format == "bitmask"  # not the Trainer's dense weights under the card
    loaded = load_sparse(str(tmp_path))  # the folder uploaded last: consistent, sparse weights and all
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), trainer.model.state_dict().values()))
