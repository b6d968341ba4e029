"""Replicas that train a few parameters (replica_params) and merges that keep a pruned model's zeros: MaskLoRA and
ScaleLoRA on peft's layers, biases and norms, merge_adapters for a user's own LoRA, the trainer on a PeftModel,
soups of subset replicas in the SMS loop (issue 35)."""

from __future__ import annotations

import copy
import json
import os
import types

import pytest
import torch
from conftest import sms_config
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_sms import (
    SparseSoupConfig,
    SparseSoupTrainer,
    apply_masks,
    compute_masks,
    load_sparse,
    run_sms,
    sparsity_report,
)
from hf_sms.adapters import lora, merge_adapters
from hf_sms.adapters.folders import load_adapter, save_adapter
from hf_sms.adapters.lora import _GatedLinear
from hf_sms.adapters.merge import plain_name
from hf_sms.adapters.replica import make_replica, merged_copy, replica_distances, soup_of_states, trained_state
from hf_sms.adapters.soup import adapter_soup, build_subset_soup
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import TensorDictDataset, load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.pruning.masks import masks_from_model


def lora_args(kind: str, rank: int = 4, targets=None):
    return types.SimpleNamespace(
        replica_params=kind, lora_rank=rank, lora_alpha=2.0 * rank, lora_dropout=0.0, lora_target_modules=targets
    )


def tiny_llama(seed: int = 0, sparsity: float = 0.5):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    masks = compute_masks(model, sparsity)
    apply_masks(model, masks)
    return model, masks


def revived(model, masks) -> int:
    """Weights the masks prune that are not exactly zero in ``model`` (plain names)."""
    now = masks_from_model(model)
    return sum(int((now[k] & ~m).sum()) for k, m in masks.items())


def train_steps(model, steps: int = 3, seed: int = 0, lr: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    for _ in range(steps):
        ids = torch.randint(1, 64, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def trained_states(model, args, n: int) -> list[dict]:
    """The trained states of ``n`` replicas of ``model`` (made with ``args``), each trained on its own batches."""
    replicas = [make_replica(model, args) for _ in range(n)]
    for s, r in enumerate(replicas):
        train_steps(r, seed=s)
    return [trained_state(r) for r in replicas]


# -- the layers --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [None, 5, 12])  # the whole product; one row, two rows at a time (CPU blocks)
@pytest.mark.parametrize("kind", ["mask", "scale"])
def test_gated_low_rank_gradients_are_exact(kind, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr(lora, "BLOCK", block)
        assert len(lora.row_blocks(torch.zeros(4, 5))) == 4 // (block // 5)
        assert len(lora.row_blocks(torch.zeros(4, 5, device="meta"))) == 1  # blocks on the CPU only
        assert len(lora.column_blocks(torch.zeros(4, 5))) == -(-5 // (block // 4))
    else:
        monkeypatch.setattr(lora, "row_blocks", lambda w: [slice(None)])
        monkeypatch.setattr(lora, "column_blocks", lambda w: [slice(None)])
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64) * (torch.rand(4, 5) > 0.5)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for with_base in (False, True):  # the update alone (peft's path), or the layer with its base (the fused one)

        def layer(x, a, b, bias, with_base=with_base):
            return _GatedLinear.apply(x, w, bias if with_base else None, a, b, 0.7, kind, with_base)

        assert torch.autograd.gradcheck(layer, (x, a, b, bias))
        gate = (w != 0).double() if kind == "mask" else w
        want = x @ ((w if with_base else 0) + gate * (0.7 * b @ a)).T + (bias if with_base else 0)
        torch.testing.assert_close(layer(x, a, b, bias), want, rtol=1e-12, atol=1e-12)  # the forward is the formula
        strided = w.T.contiguous().T  # as GPT-2's Conv1D hands it over: the blocks are strided views
        y = _GatedLinear.apply(x, strided, bias if with_base else None, a, b, 0.7, kind, with_base)
        got = torch.autograd.grad(y.sum(), (x, a, b))
        assert torch.equal(y, layer(x, a, b, bias))
        assert all(torch.equal(u, v) for u, v in zip(got, torch.autograd.grad(layer(x, a, b, bias).sum(), (x, a, b))))


@settings(max_examples=25, deadline=None)
@given(
    out_f=st.integers(1, 12),
    in_f=st.integers(1, 12),
    rank=st.integers(1, 4),
    sparsity=st.floats(0.0, 0.95),
    kind=st.sampled_from(["mask_lora", "scale_lora"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_masked_and_scaled_lora_keep_every_zero(out_f, in_f, rank, sparsity, kind, dtype, seed):
    """Trained, merged by peft's own merge, merged by merge_adapters and souped: the pruned entries stay exactly 0."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(in_f, out_f), nn.ReLU(), nn.Linear(out_f, 3)).to(dtype)
    masks = {n: torch.rand(p.shape) >= sparsity for n, p in model.named_parameters() if n.endswith("weight")}
    apply_masks(model, masks)
    replicas = []
    for s in range(2):
        replica = make_replica(model, lora_args(kind, rank, targets=["0", "2"]))
        params = [p for p in replica.parameters() if p.requires_grad]
        assert params and all(p.dtype == torch.float32 for p in params)  # adapters train in fp32
        opt = torch.optim.SGD(params, lr=0.5)
        for _ in range(2):
            x = torch.randn(4, in_f, generator=torch.Generator().manual_seed(s)).to(dtype)
            replica(x).float().square().mean().backward()
            with torch.no_grad():  # B starts at 0: move it, so the update is not trivially zero
                for p in params:
                    p.grad = p.grad + torch.randn_like(p) if p.grad is not None else torch.randn_like(p)
            opt.step()
            opt.zero_grad()
        replicas.append(replica)
    for p, q in zip(model.parameters(), replicas[0].parameters()):  # the base was never written
        assert p.data_ptr() in {q.data_ptr() for q in replicas[0].parameters()}
    assert revived(model, masks) == 0
    soup = soup_of_states(model, [trained_state(r) for r in replicas], [0.5, 0.5], lora_args(kind, rank, ["0", "2"]))
    assert revived(soup, masks) == 0 and soup.state_dict().keys() == model.state_dict().keys()
    for replica in replicas:
        merged = merged_copy(replica)
        assert revived(merged, masks) == 0
        with torch.no_grad():  # the merge computes what training saw
            x = torch.randn(5, in_f).to(dtype)
            want = replica(x).float()
            # bf16: the merged weights are rounded to bf16, the replica adds its fp32 update to the output; fp32: the
            # merge rounds W + update once, the replica rounds x W and x update apart (a few ulps of the output)
            scale = 1 + float(want.abs().max())
            tol = 1e-5 * scale if dtype == torch.float32 else 0.05 * scale
            torch.testing.assert_close(merged(x).float(), want, atol=tol, rtol=1e-4 if dtype == torch.float32 else 0.05)
        peft_merged = copy.deepcopy(replica)
        for layer in (m for m in peft_merged.modules() if hasattr(m, "lora_A")):
            layer.merge()  # peft's own merge goes through the variant
            assert (
                int((layer.get_base_layer().weight[~masks[f"{layer_name(peft_merged, layer)}.weight"]] != 0).sum()) == 0
            )


def layer_name(model, layer) -> str:
    return next(n for n, m in model.named_modules() if m is layer)


# -- merge_adapters: any LoRA ----------------------------------------------------------------------------------------
def test_merge_adapters_keeps_the_zeros_a_plain_lora_merge_fills():
    model, masks = tiny_llama()
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    train_steps(peft_model)
    dense = copy.deepcopy(peft_model).merge_and_unload()  # peft's merge: the pruned weights fill up
    assert revived(dense, masks) > 0.9 * sum(int((~m).sum()) for k, m in masks.items() if ".layers." in k)
    merged, report = merge_adapters(peft_model, return_report=True)
    assert revived(merged, masks) == 0 and type(merged) is LlamaForCausalLM
    assert not any(hasattr(m, "lora_A") for m in merged.modules())
    assert report["layers"] == 14 and report["dropped_entries"] > 0 and 0.3 < report["dropped_fraction"] < 0.7
    mask_lora = make_replica(model, lora_args("mask_lora"))
    train_steps(mask_lora)
    _, report = merge_adapters(mask_lora, return_report=True)
    assert report["dropped_entries"] == 0 and report["dropped_fraction"] == 0.0


def test_merge_adapters_refuses_other_adapters():
    from peft import IA3Config

    model, _ = tiny_llama()
    ia3 = get_peft_model(model, IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match="ia3.Linear"):
        merge_adapters(ia3)


# -- the trainer on a PeftModel --------------------------------------------------------------------------------------
def lm_rows(n: int = 16) -> list[dict]:
    return [{"input_ids": torch.randint(1, 64, (12,)), "labels": torch.randint(1, 64, (12,))} for _ in range(n)]


def lm_args(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, report_to="none",
                use_cpu=True, retrain_schedule="llr", disable_tqdm=True)  # fmt: skip
    return SparseSoupConfig(**{**base, **overrides})


def test_the_trainer_trains_a_peft_causal_lm_and_saves_both_forms(tmp_path):
    model, masks = tiny_llama()
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    rows, args = lm_rows(), lm_args(tmp_path, learning_rate=0.01)
    trainer = SparseSoupTrainer(peft_model, args, train_dataset=rows)  # the LM's own loss: no classification loss
    assert trainer.compute_loss_func is None
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    loaded = load_sparse(str(out))
    assert revived(loaded, masks) == 0
    assert any(hasattr(m, "lora_A") for m in peft_model.modules())  # the trainer's model is left as it was


def test_replica_params_in_the_trainer_train_a_subset_and_save_an_adapter_that_loads(tmp_path):
    model, masks = tiny_llama()
    rows, args = lm_rows(), lm_args(tmp_path, learning_rate=0.05, replica_params="mask_lora", lora_rank=4, lora_alpha=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SparseSoupTrainer(model, args, masks=masks, train_dataset=rows)
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    trainer.train()
    state = trainer.optimizer.state_dict()["state"]
    assert sum(v["exp_avg"].numel() for v in state.values()) == sum(
        p.numel() for p in trainer.model.parameters() if p.requires_grad
    )  # frozen weights carry no optimizer state
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # the base never moved
    trainer.save_model()
    soup = load_sparse(str(tmp_path / "out"))
    assert revived(soup, masks) == 0
    # the merged model says so (card, sparsity.json) and refuses its own adapter (the update would count twice)
    notes = json.loads((tmp_path / "out" / "sparsity.json").read_text())["recipe"]["notes"]
    assert any("merged into these weights" in n for n in notes)
    assert "merged into these weights" in (tmp_path / "out" / "README.md").read_text()
    with pytest.raises(ValueError, match="already holds the adapter"):
        load_adapter(soup, str(tmp_path / "out" / "adapter"))
    assert not any(".lora_" in n for n, _ in soup.named_parameters())  # refused before anything was injected
    reloaded = load_adapter(model, str(tmp_path / "out" / "adapter"))
    ids = torch.randint(1, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, soup(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mask_lora", "scale_lora", "bias_norm"])
def test_the_trainer_prunes_a_dense_model_before_training_its_subset(tmp_path, kind):
    """SparseSoupTrainer(dense model, replica_params=K) with no masks prunes to target_sparsity first, as it does for
    full training (it used to train MaskLoRA/ScaleLoRA under the dense model's zeros: 0% sparse); a LoRA the user
    brings is trained under its own zeros instead (the test above)."""
    model, _ = tiny_llama(sparsity=0.0)
    rows, args = lm_rows(), lm_args(tmp_path, learning_rate=0.05, replica_params=kind, lora_rank=4, target_sparsity=0.5)
    trainer = SparseSoupTrainer(model, args, train_dataset=rows)
    masks = {plain_name(n): m for n, m in trainer.masks.items()}
    kept = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
    assert kept == pytest.approx(0.5, abs=1e-3)
    trainer.train()
    assert trainer.state.log_history[-1]["weight_sparsity"] == pytest.approx(0.5, abs=1e-3)
    trainer.save_model()
    soup = load_sparse(str(tmp_path / "out"))
    assert revived(soup, masks) == 0 and sparsity_report(soup)["sparsity"] == pytest.approx(0.5, abs=1e-3)


def test_bias_norm_replicas_train_biases_and_norms_only():
    model = DigitsResNet(width=4)
    replica = make_replica(model, lora_args("bias_norm"))
    trained = {n for n, p in replica.named_parameters() if p.requires_grad}
    norms = {
        f"{m}.{p}"
        for m, mod in model.named_modules()
        if isinstance(mod, nn.BatchNorm2d)
        for p, _ in mod.named_parameters(recurse=False)
    }
    biases = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert trained == norms | biases and "fc.weight" not in trained
    frozen = {n: p for n, p in replica.named_parameters() if not p.requires_grad}
    start = dict(model.named_parameters())
    assert all(p.data_ptr() == start[n].data_ptr() for n, p in frozen.items())  # shared storage, no copy
    assert all(p.requires_grad for p in model.parameters())  # the start's own flags are untouched


def test_distances_from_trained_states_equal_those_of_the_merged_models():
    model, _ = tiny_llama()
    for kind in ("mask_lora", "bias_norm"):
        args = lora_args(kind)
        states = trained_states(model, args, 3)
        merged = [soup_of_states(model, [s], [1.0], args) for s in states]
        expected = [
            float(
                sum(
                    (p - q).detach().double().square().sum()
                    for p, q in zip(merged[i].parameters(), merged[j].parameters())
                )
            )
            ** 0.5
            for i in range(3)
            for j in range(i + 1, 3)
        ]
        assert replica_distances(model, states, args) == pytest.approx(expected, rel=1e-5)
        assert min(expected) > 0


@pytest.mark.parametrize("kind", ["mask_lora", "bias_norm"])
def test_a_subset_soup_shares_what_it_does_not_change_and_never_writes_the_start(kind):
    """The soup of subset replicas costs the tensors it changes (the LoRA targets' weights; the biases and norms),
    not a model: every other parameter shares the start's storage, and making the soup leaves the start as it was."""
    model, masks = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = lora_args(kind)
    states = trained_states(model, args, 2)
    soup = soup_of_states(model, states, [0.5, 0.5], args)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the start is untouched
    start = dict(model.named_parameters())
    changed = {n for n, p in soup.named_parameters() if not torch.equal(p, start[n])}
    shared = {n for n, p in soup.named_parameters() if p.data_ptr() == start[n].data_ptr()}
    assert changed and shared and not changed & shared
    assert changed | shared == set(start)  # a parameter the soup did not change is not copied
    if kind == "mask_lora":
        assert "model.embed_tokens.weight" in shared and "model.layers.0.mlp.down_proj.weight" in changed
    assert revived(soup, masks) == 0
    assert all(p.requires_grad == start[n].requires_grad for n, p in soup.named_parameters())


@pytest.mark.parametrize("kind", ["mask_lora", "scale_lora"])
def test_a_trial_soup_in_adapter_form_is_the_merged_soup_and_leaves_the_replica_as_it_was(kind):
    """Greedy's trial soups of adapters are scored as one gated update of rank k*r (no new weights): the same
    function as the merged soup up to rounding, with the LoRA dropout the merged soup lacks switched off, and the
    template replica is itself again afterwards."""
    model, _ = tiny_llama()
    args = lora_args(kind)
    args.lora_dropout = 0.3
    states, weights = trained_states(model, args, 3), [0.5, 0.0, 0.5]
    template = make_replica(model, args)
    before = dict(template.named_parameters())
    ids = torch.randint(1, 64, (2, 8))
    with torch.no_grad():
        plain = template(input_ids=ids).logits
        merged = soup_of_states(model, [states[0], states[2]], [0.5, 0.5], args)(input_ids=ids).logits
        with adapter_soup(template, states, weights) as trial:
            trial.train()  # dropout on where the template has it: the trial must not use it
            torch.testing.assert_close(trial(input_ids=ids).logits, merged, rtol=1e-5, atol=1e-5)
        template.eval()
        assert not torch.allclose(merged, plain)  # the replicas trained: a soup that ignored them would fail
        assert dict(template.named_parameters()) == before and torch.equal(template(input_ids=ids).logits, plain)


@pytest.mark.parametrize("kind", ["mask_lora", "scale_lora", "bias_norm"])
def test_a_subset_soup_written_in_place_is_the_copied_soup_bit_for_bit(kind):
    """The phase's soup of subset replicas is written into its start (no new weights): the same bits as the soup
    built beside it, the start's zeros exactly."""
    model, masks = tiny_llama()
    args = lora_args(kind)
    states = trained_states(model, args, 2)
    copied = soup_of_states(model, states, [0.5, 0.5], args)
    soup = build_subset_soup(model, states, [0.5, 0.5], args, in_place=True)
    assert soup is model and revived(soup, masks) == 0
    assert all(torch.equal(a, b) for a, b in zip(soup.state_dict().values(), copied.state_dict().values()))


def test_save_adapter_writes_peft_format(tmp_path):
    model, _ = tiny_llama()
    replica = make_replica(model, lora_args("scale_lora"))
    train_steps(replica)
    save_adapter(replica, str(tmp_path / "a"))
    saved = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert saved and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["r"] == 4
    back = load_adapter(model, str(tmp_path / "a"))
    ids = torch.randint(1, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, replica(input_ids=ids).logits)


# -- the SMS loop ------------------------------------------------------------------------------------------------
def _digits():
    train, val, test = load_digits_splits(seed=0)
    return TensorDictDataset(train.x[:192], train.labels[:192], train.augment), val, test


@pytest.mark.parametrize("kind", ["mask_lora", "bias_norm"])
def test_sms_with_subset_replicas_keeps_the_mask_and_resumes(tmp_path, kind):
    train, val, test = _digits()
    torch.manual_seed(0)
    model = DigitsResNet(width=4)
    args = sms_config(tmp_path, replica_params=kind, lora_rank=2, merge_methods=["greedy", "uniform"], max_steps=3,
                      baselines=["imp"], measure_speedup=False)  # fmt: skip
    soup, results = run_sms(model, args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=test)
    # exactly the target's zeros: one revived weight would lower it, one extra zero raise it
    n = sum(m.numel() for m in masks_from_model(soup).values())
    for row in results["rows"]["sms_greedy"][-1:] + results["rows"]["sms_uniform"][-1:] + results["rows"]["imp"][-1:]:
        assert row["sparsity"] == round(0.8 * n) / n
    assert sorted(os.listdir(tmp_path / "run" / "sms" / "phase1" / "replica0")) == ["replica.safetensors"]
    final = load_sparse(str(tmp_path / "run" / "final_soup"), model=DigitsResNet(width=4))
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(), soup.state_dict().values()))
    assert all(d["pairwise_l2"][0] > 0 for d in results["sms"])  # the replicas really differ
    recipe = json.loads((tmp_path / "run" / "final_soup" / "sparsity.json").read_text())["recipe"]
    assert recipe["replica_params"] == kind
    assert any("every replica and the baselines imp retrain" in note for note in recipe["notes"])  # the card too
    again, _ = run_sms(model, args, train, ClassificationAccuracy(), eval_dataset=val, test_dataset=test)  # resumes
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), soup.state_dict().values()))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"pruning_method": "gmp", "pruning_steps": 2}, "pruning_method='imp'"),
        ({"baselines": ["imp_reprune"]}, "imp_reprune"),
        ({"lora_rank": 0}, "lora_rank"),
        ({"replica_params": "adapters"}, "choose one of"),
    ],
)
def test_subset_replicas_refuse_what_they_cannot_do(tmp_path, overrides, match):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", replica_params="mask_lora", max_steps=2)
    with pytest.raises(ValueError, match=match):
        SparseSoupConfig(**{**base, **overrides})


def test_a_model_without_linears_is_refused_for_lora(tmp_path):
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    with pytest.raises(ValueError, match="bias_norm"):
        make_replica(conv, lora_args("mask_lora"))


def test_merge_adapters_keeps_the_zeros_of_a_head_peft_trains_in_full():
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)  # fmt: skip
    model = LlamaForSequenceClassification(config)
    masks = compute_masks(model, 0.5)
    apply_masks(model, masks)
    assert "score.weight" in masks
    peft_model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(3):  # the head (modules_to_save) trains dense
        ids = torch.randint(1, 64, (4, 8))
        peft_model(input_ids=ids, labels=torch.tensor([0, 1, 2, 0])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    merged, report = merge_adapters(peft_model, return_report=True)
    assert type(merged) is LlamaForSequenceClassification and revived(merged, masks) == 0
    assert report["dropped_entries"] > 0
