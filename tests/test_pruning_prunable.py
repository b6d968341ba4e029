"""Pruning and FLOP counting see every weight: attention projections, GPT-2's Conv1D, tied heads, call order."""

from __future__ import annotations

import pytest
import torch
from conftest import make_t5
from torch import nn

from hf_sms import apply_masks, compute_masks, prune, sparsity_report
from hf_sms.evaluation import theoretical_speedup
from hf_sms.pruning.prunable import prunable_tensors


def density(w: torch.Tensor) -> float:
    return float((w != 0).sum()) / w.numel()


def speedup_by_hand(layers: list[tuple[float, torch.Tensor]]) -> float:
    """``sum(flops) / sum(flops * density)`` over ``(flops, weight)`` pairs."""
    return sum(f for f, _ in layers) / sum(f * density(w) for f, w in layers)


# -- (f) attention weights are prunable ----------------------------------------------------------------------
class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def test_transformer_encoder_reaches_the_target_over_all_its_weight_matrices():
    torch.manual_seed(0)
    model = EncoderClassifier()
    masks = compute_masks(model, 0.9)
    assert {"encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.1.self_attn.in_proj_weight"} <= set(masks)
    apply_masks(model, masks)
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    zeros = sum(int((p == 0).sum()) for p in matrices)
    measured = zeros / sum(p.numel() for p in matrices)
    assert measured == pytest.approx(0.9, abs=1e-3)
    assert sparsity_report(model)["sparsity"] == pytest.approx(measured)  # the report is the truth


def test_mha_with_other_key_and_value_sizes_prunes_its_three_projections():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, kdim=8, vdim=12, batch_first=True)
    assert mha.in_proj_weight is None
    tensors = prunable_tensors(mha)
    assert [t.name for t in tensors] == ["q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"]
    assert {t.kind for t in tensors} == {"linear"}
    masks = compute_masks(mha, 0.5, "uniform")
    assert all(int((~m).sum()) == m.numel() // 2 for m in masks.values())
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, 5, 8), torch.randn(2, 5, 12)
    apply_masks(mha, masks)
    assert mha(q, k, v)[0].shape == (2, 3, 16)


def test_decoder_layer_weights_and_no_bias_or_norm():
    names = {t.name for t in prunable_tensors(nn.TransformerDecoderLayer(16, 2, dim_feedforward=32))}
    assert names == {
        "self_attn.in_proj_weight",
        "self_attn.out_proj.weight",
        "multihead_attn.in_proj_weight",
        "multihead_attn.out_proj.weight",
        "linear1.weight",
        "linear2.weight",
    }


# -- (g) theoretical speedup counts every weight matmul ----------------------------------------------------
def test_gpt2_speedup_matches_a_hand_count():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
    assert model.lm_head.weight is model.transformer.wte.weight
    apply_masks(model, compute_masks(model, 0.9))
    tokens = 2 * 8
    block = model.transformer.h[0]
    # Conv1D weights are (in, out); the tied lm_head is a (vocab, embd) Linear weight.
    convs = [block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj]
    layers = [(2 * tokens * c.weight.numel(), c.weight) for c in convs]
    layers.append((2 * tokens * model.lm_head.weight.numel(), model.lm_head.weight))
    expected = speedup_by_hand(layers)
    batch = {"input_ids": torch.randint(0, 64, (2, 8))}
    assert theoretical_speedup(model, batch) == pytest.approx(expected, rel=1e-9)


class SelfAttentionClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_mha_in_proj_is_counted():
    torch.manual_seed(0)
    model = SelfAttentionClassifier()
    masks = compute_masks(model, 0.75, "uniform")
    apply_masks(model, {"attn.in_proj_weight": masks["attn.in_proj_weight"]})  # only the packed q/k/v
    tokens = 2 * 5
    in_proj, out_proj, head = model.attn.in_proj_weight, model.attn.out_proj.weight, model.head.weight
    expected = speedup_by_hand(
        [(2 * tokens * 16 * 48, in_proj), (2 * tokens * 16 * 16, out_proj), (2 * 2 * 16 * 4, head)]
    )
    assert theoretical_speedup(model, torch.randn(2, 5, 16)) == pytest.approx(expected, rel=1e-9)
    assert torch.backends.mha.get_fastpath_enabled()  # turned off for counting only


def test_cross_attention_counts_each_slice_of_in_proj_with_its_own_zeros():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight[16:32] = 0  # the key projection
    lq, lk = 3, 7

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x[:, :lq], x, x, need_weights=False)[0]

    mm = 2 * 16 * 16  # one projection of one token
    w = mha.in_proj_weight
    expected = speedup_by_hand(
        [(lq * mm, w[:16]), (lk * mm, w[16:32]), (lk * mm, w[32:]), (lq * mm, mha.out_proj.weight)]
    )
    assert theoretical_speedup(Cross(), torch.randn(1, lk, 16)) == pytest.approx(expected, rel=1e-9)


def test_conv_transpose_is_counted():
    torch.manual_seed(0)
    deconv = nn.ConvTranspose2d(4, 6, 3, groups=2)
    with torch.no_grad():
        deconv.weight[:1] = 0  # one of four input channels' filters
    assert theoretical_speedup(deconv, torch.randn(1, 4, 5, 5)) == pytest.approx(4 / 3)


def test_grouped_conv_and_linear_hand_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.Flatten(), nn.Linear(6 * 3 * 3, 5))
    with torch.no_grad():
        model[0].weight[:2] = 0
    apply_masks(model, {"2.weight": compute_masks(model, 0.5, "uniform")["2.weight"]})
    # 2 images x 6 channels x 3 x 3 outputs, each costing (c_in / groups) * k * k = 2 * 3 * 3 multiply-adds.
    conv = (2 * (2 * 6 * 3 * 3) * (2 * 3 * 3), model[0].weight)
    linear = (2 * 2 * 54 * 5, model[2].weight)
    assert theoretical_speedup(model, torch.randn(2, 4, 5, 5)) == pytest.approx(speedup_by_hand([conv, linear]))


@pytest.mark.parametrize("shape", [(4, 10), (2, 3, 10)])
def test_linear_model_is_exactly_four_at_75_percent(shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 10)).train()
    apply_masks(model, compute_masks(model, 0.75, "uniform"))
    assert theoretical_speedup(model, torch.randn(*shape)) == pytest.approx(4.0)
    assert model.training


# -- (h) uniform+ follows execution order and tied heads -------------------------------------------------
class Reordered(nn.Module):
    """Registered: aux conv (never called), head, second conv, first conv, fc. Called: first, second, fc, head."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Conv2d(3, 8, 1)
        self.head = nn.Linear(8, 4)
        self.conv_second = nn.Conv2d(8, 8, 3, padding=1)
        self.conv_first = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = self.conv_second(torch.relu(self.conv_first(x)))
        return self.head(torch.relu(self.fc(x.mean((2, 3)))))


def pruned(masks, name) -> int:
    return int((~masks[name]).sum())


def assert_uniform_plus(model, masks, dense: str, capped: str):
    for t in prunable_tensors(model):
        share = 0.0 if t.name == dense else 0.8 if t.name == capped else 0.9
        assert pruned(masks, t.name) == round(share * t.param.numel()), t.name


@pytest.mark.parametrize("example", [lambda x: {"x": x}, lambda x: x])
def test_uniform_plus_uses_call_order_with_example_inputs(example):
    torch.manual_seed(0)
    model = Reordered().train()
    masks = compute_masks(model, 0.9, "uniform_plus", example_inputs=example(torch.randn(2, 3, 8, 8)))
    assert_uniform_plus(model, masks, dense="conv_first.weight", capped="head.weight")
    assert model.training
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_uniform_plus_without_example_inputs_uses_module_order():
    model = Reordered()
    assert_uniform_plus(model, compute_masks(model, 0.9, "uniform_plus"), dense="aux.weight", capped="fc.weight")


def test_prune_passes_example_inputs_on():
    torch.manual_seed(0)
    model = Reordered()
    step = prune(model, 0.9, "uniform_plus", example_inputs={"x": torch.randn(2, 3, 8, 8)})
    assert_uniform_plus(model, step.masks, dense="conv_first.weight", capped="head.weight")
    assert float((model.conv_second.weight == 0).float().mean()) == pytest.approx(0.9, abs=0.01)


@pytest.mark.parametrize("with_example", [False, True])
def test_tied_t5_lm_head_is_the_last_linear(with_example):
    model = make_t5()
    ids = torch.randint(2, 300, (2, 6))
    example = {"input_ids": ids, "labels": ids} if with_example else None
    masks = compute_masks(model, 0.9, "uniform_plus", example_inputs=example)
    assert_uniform_plus(model, masks, dense="", capped="shared.weight")
