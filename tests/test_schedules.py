"""Retraining LR schedules (docs/method.md §3), checked against formulas written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_cnn
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TrainerCallback

from hf_sms import SparseSoupConfig, SparseSoupTrainer
from hf_sms.plan import prune
from hf_sms.training.schedules import RETRAIN_SCHEDULES, ScheduleContext, allr_start_lr, make_lr_scheduler

FAST = settings(max_examples=25, deadline=None)
steps_st = st.integers(1, 400)
rates_st = st.tuples(st.floats(1e-4, 1.0), st.floats(0.0, 0.99)).map(lambda t: (t[0], t[0] * t[1]))  # hi, lo<hi


def warmup(k: int, R: int, start: float) -> float:
    w = math.ceil(0.1 * R)
    return start * 0.5 * (1 - math.cos(math.pi * k / w))


def after_warmup(k: int, R: int) -> float:
    w = math.ceil(0.1 * R)
    return min((k - w) / max(R - w, 1), 1.0)


def original_linear(t: float, T: float, hi: float, lo: float) -> float:
    return hi + (lo - hi) * t / T


def lrs(name: str, ctx: ScheduleContext) -> list[float]:
    return [RETRAIN_SCHEDULES[name](k, ctx) for k in range(ctx.total_steps)]


@FAST
@given(R=steps_st, rates=rates_st)
def test_ft_is_constant_eta_min(R, rates):
    hi, lo = rates
    assert lrs("ft", ScheduleContext(R, hi, lo)) == [lo] * R


@FAST
@given(R=st.integers(1, 200), T_over_R=st.integers(1, 20), rates=rates_st)
def test_lrw_is_the_last_R_rates_of_the_original_schedule(R, T_over_R, rates):
    hi, lo = rates
    T = R * T_over_R
    ctx = ScheduleContext(R, hi, lo, pretrain_shape="linear", length_ratio=R / T)
    expected = [original_linear(T - R + k, T, hi, lo) for k in range(R)]
    assert lrs("lrw", ctx) == pytest.approx(expected, rel=1e-9, abs=1e-12)  # no warm-up


def test_lrw_on_a_step_schedule():
    # Original: 100 iterations at 0.1 until 50, 0.01 until 75, 0.001 after; LRW with R = 40 replays 60..99.
    ctx = ScheduleContext(40, 0.1, 0.001, pretrain_shape="step", length_ratio=0.4)
    assert lrs("lrw", ctx) == pytest.approx([0.01] * 15 + [0.001] * 25)


def test_warmup_is_ceil_tenth_of_R_from_zero():
    for name in ("slr", "clr", "llr", "allr"):
        for R in (1, 7, 10, 25, 101):
            ctx = ScheduleContext(R, 0.1, 0.01, length_ratio=0.5, start_lr=0.05)
            start = 0.05 if name == "allr" else 0.1
            w = math.ceil(0.1 * R)
            rates = [RETRAIN_SCHEDULES[name](k, ctx) for k in range(R + 1)]
            assert rates[0] == 0.0, name
            assert all(a < b for a, b in zip(rates[:w], rates[1 : w + 1])), f"{name} warm-up not rising"
            assert rates[w] == pytest.approx(start), f"{name} peak after {w} steps"
            assert max(rates) == pytest.approx(start)
            assert rates[:w] == pytest.approx([warmup(k, R, start) for k in range(w)])
    for name in ("ft", "lrw"):
        assert RETRAIN_SCHEDULES[name](0, ScheduleContext(10, 0.1, 0.01, length_ratio=0.5)) > 0, name


@FAST
@given(R=steps_st, rates=rates_st)
def test_slr_is_the_original_schedule_compressed(R, rates):
    hi, lo = rates
    w = math.ceil(0.1 * R)
    for shape, fn in {
        "linear": lambda u: hi + (lo - hi) * u,
        "cosine": lambda u: lo + (hi - lo) * (1 + math.cos(math.pi * u)) / 2,
    }.items():
        ctx = ScheduleContext(R, hi, lo, pretrain_shape=shape, length_ratio=0.3)
        rates_ = lrs("slr", ctx)
        assert rates_[w:] == pytest.approx([fn(after_warmup(k, R)) for k in range(w, R)], rel=1e-9, abs=1e-12)
        if w < R:
            assert rates_[w] == pytest.approx(hi)  # restarts at eta_max


@pytest.mark.parametrize(("shape", "warmup", "first_bound"), [
    ("step_maxvit", 20 / 200, 60 / 200), ("step_pspnet", 20 / 300, 100 / 300), ("step_t5", 1 / 5, 2 / 5),
])  # fmt: skip
def test_slr_on_a_schedule_that_warms_up_runs_at_the_peak_over_its_warm_up(shape, warmup, first_bound):
    """The paper's code replaces the original warm-up with the peak: SLR warms up once, then never falls back to 0
    (it went 0.195 -> 0.0 -> 0.022 before), and follows the original's steps after."""
    R, hi = 200, 0.2
    rates = lrs("slr", ScheduleContext(R, hi, pretrain_shape=shape))
    w = math.ceil(0.1 * R)
    assert rates[:w] == sorted(rates[:w]) and rates[w - 1] < hi  # SLR's own warm-up
    on_peak = [r for k, r in enumerate(rates[w:], w) if after_warmup(k, R) < first_bound]
    assert on_peak and all(r == pytest.approx(hi) for r in on_peak)  # the original's warm-up part included
    after = [(k, r) for k, r in enumerate(rates[w:], w) if after_warmup(k, R) >= warmup]
    ctx = ScheduleContext(R, hi, pretrain_shape=shape)
    assert [r for _, r in after] == pytest.approx([ctx.original(after_warmup(k, R)) for k, _ in after])
    assert min(rates[w:]) > 0


@FAST
@given(R=steps_st, rates=rates_st)
def test_clr_is_cosine_from_eta_max_to_eta_min(R, rates):
    hi, lo = rates
    w = math.ceil(0.1 * R)
    rates_ = lrs("clr", ScheduleContext(R, hi, lo))
    expected = [lo + (hi - lo) * (1 + math.cos(math.pi * after_warmup(k, R))) / 2 for k in range(w, R)]
    assert rates_[w:] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if R > 1:  # R = 1 is all warm-up
        assert RETRAIN_SCHEDULES["clr"](R, ScheduleContext(R, hi, lo)) == pytest.approx(lo)


@FAST
@given(R=steps_st, rates=rates_st)
def test_llr_is_linear_from_eta_max_to_zero(R, rates):
    hi, lo = rates
    w = math.ceil(0.1 * R)
    rates_ = lrs("llr", ScheduleContext(R, hi, lo))
    assert rates_[w:] == pytest.approx([hi * (1 - after_warmup(k, R)) for k in range(w, R)], rel=1e-9, abs=1e-12)
    if R > 1:  # R = 1 is all warm-up
        assert RETRAIN_SCHEDULES["llr"](R, ScheduleContext(R, hi, lo)) == 0.0


def test_llr_hand_computed():
    # R = 10: one warm-up step (rate 0), then 0.1 * (1 - j/9) for j = 0..8.
    assert lrs("llr", ScheduleContext(10, 0.1)) == pytest.approx([0.0] + [0.1 * (1 - j / 9) for j in range(9)])


# -- ALLR --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("d", "q", "ratio", "expected"),
    [
        (0.3, 0.25, 0.2, 0.06),  # 0.3 / 0.5 * 0.1, inside [0.02, 0.1]
        (0.05, 0.25, 0.2, 0.02),  # 0.01 clipped up to min(R/T, 1) * eta_max
        (0.9, 0.25, 0.2, 0.1),  # 0.18 clipped down to eta_max
        (0.3, 0.25, 1.5, 0.1),  # R > T: the lower bound is eta_max itself
        (0.2, 0.0, 0.2, 0.1),  # nothing pruned this phase: plain LLR
    ],
)
def test_allr_start_lr_hand_computed(d, q, ratio, expected):
    assert allr_start_lr(d, q, 0.1, ratio) == pytest.approx(expected)


def test_allr_is_llr_from_its_start_rate():
    ctx = ScheduleContext(20, 0.1, start_lr=0.04)
    assert lrs("allr", ctx) == pytest.approx(
        [warmup(k, 20, 0.04) for k in range(2)] + [0.04 * (1 - j / 18) for j in range(18)]
    )
    with pytest.raises(ValueError, match="allr_start_lr"):
        RETRAIN_SCHEDULES["allr"](0, ScheduleContext(20, 0.1))


# -- the LambdaLR wrapper ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(RETRAIN_SCHEDULES))
def test_lambda_lr_follows_the_schedule(name):
    ctx = ScheduleContext(30, 0.2, 0.002, pretrain_shape="cosine", length_ratio=0.25, start_lr=0.07)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)  # any base rate: the schedule is absolute
    sched = make_lr_scheduler(opt, name, ctx)
    seen = []
    for _ in range(30):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(lrs(name, ctx), rel=1e-12, abs=1e-15)


def test_make_lr_scheduler_bad_input():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"unknown retraining schedule 'cosine'; choose one of \['allr', 'clr'"):
        make_lr_scheduler(opt, "cosine", ScheduleContext(10, 0.1))
    opt.param_groups[0]["lr"] = 0.0
    with pytest.raises(ValueError, match="must be > 0"):
        make_lr_scheduler(opt, "llr", ScheduleContext(10, 0.1))


# -- config validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["lrw", "slr", "allr"])
def test_schedules_that_need_the_original_length_say_so(schedule, out_dir):
    with pytest.raises(ValueError, match=f"retrain_schedule='{schedule}' needs.*set pretrain_epochs"):
        SparseSoupConfig(output_dir=out_dir, retrain_schedule=schedule)
    assert SparseSoupConfig(output_dir=out_dir, retrain_schedule=schedule, pretrain_epochs=90).pretrain_epochs == 90


def test_unknown_schedules_and_ft_without_eta_min_are_explained(out_dir):
    with pytest.raises(
        ValueError, match=r"retrain_schedule='onecycle': unknown retraining schedule 'onecycle'; choose one of \['allr'"
    ):
        SparseSoupConfig(output_dir=out_dir, retrain_schedule="onecycle")
    with pytest.raises(
        ValueError, match=r"pretrain_schedule='poly': unknown original LR schedule shape 'poly'; choose one of"
    ):
        SparseSoupConfig(output_dir=out_dir, pretrain_schedule="poly")
    with pytest.raises(ValueError, match="set pretrain_min_learning_rate"):
        SparseSoupConfig(output_dir=out_dir, retrain_schedule="ft")
    cfg = SparseSoupConfig(output_dir=out_dir, retrain_schedule="ft", pretrain_min_learning_rate=1e-4)
    assert cfg.eta_min == 1e-4 and cfg.eta_max == cfg.learning_rate


def test_eta_min_defaults_to_the_end_of_the_original_schedule(out_dir):
    cfg = SparseSoupConfig(output_dir=out_dir, learning_rate=0.1, pretrain_schedule="step")
    assert cfg.eta_min == pytest.approx(0.001)
    cfg = SparseSoupConfig(
        output_dir=out_dir, learning_rate=0.1, pretrain_learning_rate=0.4, pretrain_schedule="constant"
    )
    assert cfg.eta_max == 0.4 and cfg.eta_min == 0.4


# -- the trainer really uses these rates ----------------------------------------------------------
class LRRecorder(TrainerCallback):
    """The rate each optimizer step actually used."""

    def __init__(self):
        self.lrs: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


R = 12  # 32 samples / batch 8 = 4 steps per epoch, so R is 3 epochs


def run_trainer(make_args, image_dataset, schedule, masks=None, **overrides):
    recorder = LRRecorder()
    args = make_args(
        SparseSoupConfig,
        retrain_schedule=schedule,
        max_steps=R,
        learning_rate=0.05,
        target_sparsity=0.5,
        **overrides,
    )
    trainer = SparseSoupTrainer(make_cnn(), args, masks=masks, train_dataset=image_dataset, callbacks=[recorder])
    trainer.train()
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert logged == pytest.approx(recorder.lrs)
    assert len(recorder.lrs) == R
    return recorder.lrs


def test_trainer_runs_llr(make_args, image_dataset):
    w = 2  # ceil(1.2)
    expected = [warmup(k, R, 0.05) for k in range(w)] + [0.05 * (1 - j / (R - w)) for j in range(R - w)]
    assert run_trainer(make_args, image_dataset, "llr") == pytest.approx(expected)


def test_trainer_runs_clr_ft_and_lrw(make_args, image_dataset):
    lo = 0.005
    clr = run_trainer(make_args, image_dataset, "clr", pretrain_min_learning_rate=lo)
    expected = [warmup(k, R, 0.05) for k in range(2)]
    expected += [lo + (0.05 - lo) * (1 + math.cos(math.pi * j / (R - 2))) / 2 for j in range(R - 2)]
    assert clr == pytest.approx(expected)
    assert run_trainer(make_args, image_dataset, "ft", pretrain_min_learning_rate=lo) == pytest.approx([lo] * R)
    # The original run was 30 epochs (T = 120 steps, linear 0.05 -> 0); LRW replays steps 108..119.
    lrw = run_trainer(make_args, image_dataset, "lrw", pretrain_epochs=30)
    assert lrw == pytest.approx([original_linear(108 + k, 120, 0.05, 0.0) for k in range(R)])


def test_trainer_runs_slr(make_args, image_dataset):
    slr = run_trainer(make_args, image_dataset, "slr", pretrain_epochs=30, pretrain_schedule="cosine")
    expected = [warmup(k, R, 0.05) for k in range(2)]
    expected += [0.05 * (1 + math.cos(math.pi * j / (R - 2))) / 2 for j in range(R - 2)]
    assert slr == pytest.approx(expected)


def test_trainer_runs_allr_from_the_measured_pruning_step(make_args, image_dataset):
    model = make_cnn()
    weights = [p.detach().clone() for p in model.parameters()]
    total = sum(float((w**2).sum()) for w in weights)
    step = prune(model, 0.5)
    removed = sum(float((w**2).sum()) - float((p.detach() ** 2).sum()) for w, p in zip(weights, model.parameters()))
    d, q = math.sqrt(removed / total), 0.5
    assert step.norm_fraction == pytest.approx(d, rel=1e-6)
    assert step.phase_fraction == pytest.approx(q, abs=1e-3)
    # R / T = 3 / 30 epochs, so the start rate is clipped from below at 0.1 * eta_max only if d/sqrt(q) < 0.1.
    start = min(max(d / math.sqrt(q), 0.1), 1.0) * 0.05
    assert 0.1 * 0.05 < start < 0.05  # a case where ALLR differs from LLR
    allr = run_trainer(make_args, image_dataset, "allr", masks=step, pretrain_epochs=30)
    expected = [warmup(k, R, start) for k in range(2)] + [start * (1 - j / (R - 2)) for j in range(R - 2)]
    assert allr == pytest.approx(expected, rel=1e-5)


def test_the_papers_pretraining_step_schedules():
    from hf_sms.registry import PRETRAIN_SHAPES

    def at(name, epoch, epochs, peak):
        return PRETRAIN_SHAPES[name](epoch / epochs, peak, 0.0)

    # MaxViT (200 epochs, peak 0.2): warm-up over 20, then 0.2, 0.02, 0.002, 0.0002 from 60, 120, 160
    assert at("step_maxvit", 10, 200, 0.2) == pytest.approx(0.1)
    assert [at("step_maxvit", t, 200, 0.2) for t in (30, 90, 140, 180)] == pytest.approx([0.2, 0.02, 0.002, 2e-4])
    # PSPNet (300 epochs, peak 0.1): warm-up over 20, then x0.1 at 100, 200, 270 and 290
    assert at("step_pspnet", 10, 300, 0.1) == pytest.approx(0.05)
    expected = [0.1, 0.01, 0.001, 1e-4, 1e-5]
    assert [at("step_pspnet", t, 300, 0.1) for t in (50, 150, 250, 280, 295)] == pytest.approx(expected)
    # T5 (5 epochs, peak 0.1): warm-up over the first, then 0.1, 0.01, 0.001, 0.0001
    assert at("step_t5", 0.5, 5, 0.1) == pytest.approx(0.05)
    assert [at("step_t5", t, 5, 0.1) for t in (1.5, 2.5, 3.5, 4.5)] == pytest.approx([0.1, 0.01, 0.001, 1e-4])
    # the ablations' WRN-20 (200 epochs, peak 0.1): x0.2 at 60, 120 and 160
    assert [at("step_ablation", t, 200, 0.1) for t in (0, 59, 60, 119, 120, 160, 199)] == pytest.approx(
        [0.1, 0.1, 0.02, 0.02, 0.004, 0.0008, 0.0008]
    )
