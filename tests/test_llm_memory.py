"""An LLM phase at its memory floor (issue 50): pruning that never holds a model's masks or float32 weights at once,
masks of frozen weights read off their zeros, soups and distances a block of rows at a time, bf16 bases, no copy of
a model only one trajectory needs, and what a causal LM prunes by default."""

from __future__ import annotations

import copy
import types
from unittest import mock

import pytest
import torch
from conftest import make_cnn, make_resnet
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_sms import SparseSoupConfig, compute_masks, prune, run_sms
from hf_sms.adapters import lora
from hf_sms.adapters.merge import plain_name
from hf_sms.adapters.replica import layer_update, lora_layers, make_replica, replica_distances, soup_of_states
from hf_sms.evaluation.metrics import NegativePerplexity
from hf_sms.pruning.criteria.wanda import input_norms
from hf_sms.pruning.masks import WeightZeros, apply_masks
from hf_sms.pruning.prunable import prunable_tensors

FAST = settings(max_examples=12, deadline=None)


def llama(seed=0, dtype=torch.float32, layers=2):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


def reference_global(model, sparsity, previous=None, names=None):
    """Global magnitude as one sorted list: |w| descending, ties by position with the tensors in order (the
    definition the radix select keeps), pruned entries last."""
    tensors = [t for t in prunable_tensors(model) if names is None or t.name in names]
    scores = []
    for t in tensors:
        s = t.param.detach().float().abs().reshape(-1).double()
        if previous is not None:
            s = s.masked_fill(~previous[t.name].reshape(-1), -1.0)
        scores.append(s)
    flat = torch.cat(scores)
    alive = int((flat >= 0).sum())
    keep = min(flat.numel() - round(sparsity * flat.numel()), alive)
    order = torch.sort(flat, descending=True, stable=True).indices
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    kept[order[:keep]] = True
    out, i = {}, 0
    for t in tensors:
        out[t.name] = kept[i : i + t.param.numel()].view(t.param.shape)
        i += t.param.numel()
    return out


@FAST
@given(
    model=st.sampled_from(["cnn", "resnet", "llama"]),
    sparsity=st.floats(0.05, 0.95),
    second=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_global_magnitude_keeps_the_reference_set_ties_included(model, sparsity, second, seed):
    """Masks found one tensor at a time equal the sorted-list definition, with weights rounded so that many tie,
    over two phases (the second with the first's masks)."""
    net = {"cnn": make_cnn, "resnet": make_resnet, "llama": llama}[model](seed % 7)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 4).round() / 4)  # many ties
    names = [t.name for t in prunable_tensors(net)] if model != "llama" else None
    first = compute_masks(net, sparsity)
    expected = reference_global(net, sparsity, names=names or list(first))
    assert set(first) == set(expected) and all(torch.equal(first[n], expected[n]) for n in first)
    then = min(sparsity + second, 0.97)
    again = compute_masks(net, then, masks=first)
    expected = reference_global(net, then, previous=first, names=list(first))
    assert all(torch.equal(again[n], expected[n]) for n in again)


def test_a_bf16_model_gets_the_masks_of_its_float32_copy_and_wanda_is_read_per_layer():
    model = llama(1, torch.bfloat16)
    copy32 = copy.deepcopy(model).float()
    for criterion, allocation in (("magnitude", "global"), ("magnitude", "uniform"), ("wanda", "uniform")):
        batch = {"input_ids": torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(0))}
        a = compute_masks(model, 0.6, allocation, criterion=criterion, example_inputs=batch)
        b = compute_masks(copy32, 0.6, allocation, criterion=criterion, example_inputs=batch)
        if criterion == "wanda":  # activations differ in bf16; the selection itself: the eager definition
            norms = input_norms(model, batch)
            for t in prunable_tensors(model):
                if t.name in a:
                    s = t.param.detach().float().abs() * norms[id(t.param)][None, :]
                    k = t.param.numel() - round(0.6 * t.param.numel())
                    assert int(a[t.name].sum()) == k and s[a[t.name]].min() >= s[~a[t.name]].max()
        else:
            assert all(torch.equal(a[n], b[n]) for n in a), criterion


def test_a_causal_lm_prunes_its_decoder_linears_and_named_modules_stay_dense():
    model = llama()
    masks = compute_masks(model, 0.5)
    assert "model.embed_tokens.weight" not in masks and "lm_head.weight" not in masks
    assert set(masks) == {n for n, p in model.named_parameters() if "layers" in n and p.dim() == 2}
    assert sum(int((~m).sum()) for m in masks.values()) == round(0.5 * sum(m.numel() for m in masks.values()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = prune(model, 0.5, skip_modules=["down_proj"])
    assert not any("down_proj" in n for n in step.masks)
    after = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(after[name], before[name])  # as they were
    everything = compute_masks(llama(), 0.5, prune_modules=".*")  # a regular expression: every prunable module
    assert "lm_head.weight" in everything and "model.embed_tokens.weight" in everything
    with pytest.raises(ValueError, match=r"\['q_prj'\] names no prunable module.*target_modules"):
        compute_masks(llama(), 0.5, skip_modules=["q_prj"])
    with pytest.raises(ValueError, match="leave no weight"):
        compute_masks(llama(), 0.5, prune_modules=["q_proj"], skip_modules=["q_proj"])


@pytest.mark.parametrize("family", ["timm", "smp", "torch"])
def test_modules_named_to_skip_stay_dense_in_every_family(family):
    if family == "timm":
        model, skip = make_resnet(), ["fc", "conv1"]
    elif family == "smp":
        import segmentation_models_pytorch as smp

        torch.manual_seed(0)
        model, skip = smp.PSPNet("resnet18", encoder_weights=None, classes=3, encoder_depth=3), ["segmentation_head.0"]
    else:
        model, skip = make_cnn(), ["fc2"]
    masks = compute_masks(model, 0.5, skip_modules=skip)
    left = [t.name for t in prunable_tensors(model) if any(t.name.rsplit(".", 1)[0].endswith(s) for s in skip)]
    assert left and not set(left) & set(masks) and masks
    apply_masks(model, masks)
    assert all(bool((t.param != 0).all()) for t in prunable_tensors(model) if t.name in left)


def test_weight_zeros_are_the_masks_of_a_pruned_model():
    model = llama()
    masks = compute_masks(model, 0.7)
    apply_masks(model, masks)
    zeros = WeightZeros(model, masks)
    assert list(zeros) == list(masks) and all(torch.equal(zeros[n], masks[n]) for n in masks)


def _states(model, args, n):
    out = []
    for i in range(n):
        replica = make_replica(model, args)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in replica.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        out.append({k: v.detach().clone() for k, v in replica.named_parameters() if v.requires_grad})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_soup_written_block_by_block_is_the_whole_layer_update_rounded_once(dtype):
    model = llama(2, dtype)
    apply_masks(model, compute_masks(model, 0.6))
    args = types.SimpleNamespace(replica_params="mask_lora", lora_rank=4, lora_alpha=8.0, lora_dropout=0.0,
                                 lora_target_modules=None)  # fmt: skip
    states, weights = _states(model, args, 3), [0.5, 0.25, 0.25]
    template = make_replica(model, args)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = {}
    for prefix, layer in lora_layers(template):
        name = plain_name(prefix) + ".weight"
        whole = layer_update(layer, states, weights, prefix)  # one block: the whole layer
        w = before[name]
        expected[name] = (w.float() + whole * (w != 0)).to(dtype)  # rounded once into the base's dtype
    with mock.patch.object(lora, "BLOCK", 48 * 5):  # five rows of a 48-wide layer at a time
        soup = soup_of_states(model, states, weights, args, template, in_place=True)
        blocked = replica_distances(model, states, args, template)
    whole = replica_distances(model, states, args, template)
    assert blocked == pytest.approx(whole, rel=1e-6)
    for name, want in expected.items():
        got = dict(soup.named_parameters())[name]
        assert got.dtype == dtype and torch.equal(got == 0, before[name] == 0)  # the zeros exactly
        torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-7)


def test_a_lone_bf16_trajectory_prunes_the_model_in_place_and_keeps_its_dtype(tmp_path):
    """One soup method, no baselines: the model given is the trajectory's start (no second model); a bf16 base
    trains float32 adapters and ends a bf16 soup with exact zeros; embeddings and lm_head stay dense."""
    model = llama(3, torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (x := torch.randint(1, 64, (8,), generator=g)), "labels": x.clone()} for _ in range(24)]
    args = SparseSoupConfig(output_dir=str(tmp_path), target_sparsity=0.5, n_phases=2, num_replicas=2, max_steps=2,
                            per_device_train_batch_size=4, learning_rate=1e-3, report_to="none", use_cpu=True,
                            replica_params="mask_lora", measure_speedup=False, disable_tqdm=True)  # fmt: skip
    dtypes = []
    with mock.patch("hf_sms.loop.replica_training.release_memory", lambda: None):
        real = make_replica

        def spy(start, a):
            replica = real(start, a)
            dtypes.extend(p.dtype for p in replica.parameters() if p.requires_grad)
            return replica

        with mock.patch("hf_sms.loop.replica_training.make_replica", spy):
            soup, results = run_sms(model, args, rows[:16], NegativePerplexity(), eval_dataset=rows[16:20],
                                    test_dataset=rows[20:])  # fmt: skip
    assert soup is model and set(dtypes) == {torch.float32}
    assert {p.dtype for p in soup.parameters()} == {torch.bfloat16}
    assert any("decoder's linear layers" in n for n in results["notes"])
    params = dict(soup.named_parameters())
    assert torch.equal(params["lm_head.weight"], before["lm_head.weight"])  # dense, and frozen
    assert torch.equal(params["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    pruned = [p for n, p in params.items() if "layers" in n and p.dim() == 2]
    zeros = sum(int((p == 0).sum()) for p in pruned) / sum(p.numel() for p in pruned)
    assert zeros == pytest.approx(0.5, abs=1e-3)
    assert results["rows"]["sms_uniform"][-1]["sparsity"] == pytest.approx(zeros)


def test_a_run_with_baselines_leaves_the_model_as_it_was(tmp_path):
    model = make_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from conftest import make_image_dataset

    data = make_image_dataset(24)
    from hf_sms.evaluation import ClassificationAccuracy

    args = SparseSoupConfig(output_dir=str(tmp_path), target_sparsity=0.5, n_phases=1, num_replicas=2, max_steps=1,
                            per_device_train_batch_size=8, report_to="none", use_cpu=True, baselines=["imp"],
                            measure_speedup=False, disable_tqdm=True)  # fmt: skip
    soup, _ = run_sms(model, args, data[:16], ClassificationAccuracy(), eval_dataset=data[16:])
    assert soup is not model and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert isinstance(model, nn.Module)


def test_lora_replicas_train_the_norms_too_when_asked(tmp_path):
    """PERP's combinations (replica_params="mask_lora_norms"): each replica trains its adapters and its own copy of
    the norm weights; the soup averages the norms and adds the mean update under the mask."""
    model = llama(4)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (x := torch.randint(1, 64, (8,), generator=g)), "labels": x.clone()} for _ in range(24)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = SparseSoupConfig(output_dir=str(tmp_path), target_sparsity=0.5, n_phases=1, num_replicas=2, max_steps=3,
                            per_device_train_batch_size=4, learning_rate=1e-2, report_to="none", use_cpu=True,
                            replica_params="mask_lora_norms", measure_speedup=False, disable_tqdm=True)  # fmt: skip
    replica = make_replica(model, args)
    trained = {n for n, p in replica.named_parameters() if p.requires_grad}
    assert "model.norm.weight" in trained and any(".lora_A." in n for n in trained)
    assert not any(n.endswith("proj.base_layer.weight") for n in trained)
    soup, results = run_sms(model, args, rows[:16], NegativePerplexity(), eval_dataset=rows[16:20],
                            test_dataset=rows[20:])  # fmt: skip
    after = soup.state_dict()
    assert not torch.equal(after["model.norm.weight"], before["model.norm.weight"])  # the norms trained
    for name, value in after.items():
        if name in before and "layers" in name and name.endswith("proj.weight"):
            assert torch.equal(value != 0, (before[name] != 0) & (value != 0))  # no pruned weight revived
    assert results["rows"]["sms_uniform"][-1]["sparsity"] == pytest.approx(0.5, abs=1e-3)
