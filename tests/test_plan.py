"""The pruning plan (criterion x structure x allocation, resolved once): masks keep whole units and only grow,
criteria are deterministic, every bad combination is refused before work, and filter units count, merge and save
as Li et al. remove them."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import make_cnn, make_resnet
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from zoo import ZOO

import hf_sms
from hf_sms import CRITERIA, apply_masks, compute_masks, load_sparse, save_sparse, uniform_soup
from hf_sms.evaluation.flops import theoretical_speedup
from hf_sms.pruning import MaskEnforcer, masks_from_model, removed_units, trace_units

FAST = settings(max_examples=12, deadline=None)
UNITS = {name: ZOO[name] for name in ("t5", "t5_gated", "gpt2", "llama", "timm_vit", "timm_resnet")}


def _unit_state(group, masks):
    """Per unit of ``group``: how many of its masked weights the masks keep, and how many it has."""
    kept = sum(m.unit_sums(masks[m.name].long()) for m in group.masked)
    total = sum(m.unit_sums(torch.ones_like(masks[m.name], dtype=torch.long)) for m in group.masked)
    return kept, total


@FAST
@given(
    name=st.sampled_from(sorted(UNITS)),
    s1=st.floats(0.0, 0.5),
    extra=st.floats(0.0, 0.25),
    criterion=st.sampled_from(["l2", "l1", "magnitude", "random"]),
    seed=st.integers(0, 2**16),
)
def test_masks_keep_whole_units_remove_the_fraction_asked_and_only_grow(name, s1, extra, criterion, seed):
    entry = UNITS[name]
    model, batch, structure = entry.make(seed % 3), entry.batch(), "+".join(entry.kinds)
    groups = hf_sms.plan.get_structure(structure).groups(model, batch)
    assume(all(g.n_units - round((s1 + extra) * g.n_units) >= 1 for g in groups))  # else refused (tested below)
    kwargs = dict(structure=structure, criterion=criterion, seed=seed, example_inputs=batch)
    first = compute_masks(model, s1, **kwargs)
    torch.manual_seed(seed)  # new weights: the earlier units must stay removed whatever their norms now
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    second = compute_masks(model, s1 + extra, masks=first, **kwargs)
    for masks, s in ((first, s1), (second, s1 + extra)):
        removed = [_unit_state(g, masks)[0] == 0 for g in groups]
        for g, gone in zip(groups, removed):
            assert int(gone.sum()) == round(s * g.n_units), g.name
        expected = {n: torch.ones_like(m) for n, m in masks.items()}
        for g, gone in zip(groups, removed):  # every zero of the masks is a removed unit's slice, and only those
            for m in g.masked:
                expected[m.name] &= m.expand(~gone, expected[m.name].shape)
        assert all(torch.equal(expected[n], masks[n]) for n in masks)
    for g in groups:
        was, now = (_unit_state(g, m)[0] == 0 for m in (first, second))
        assert not bool((was & ~now).any()), f"{g.name}: a removed unit came back"


@pytest.mark.parametrize("criterion", sorted(CRITERIA))
def test_every_criterion_gives_the_same_masks_for_the_same_inputs(criterion):
    entry = ZOO["t5"]
    model, batch = entry.make(), entry.batch()
    for kwargs in ({"structure": "neurons+heads"}, {}):
        a, b = (compute_masks(model, 0.5, criterion=criterion, seed=7, example_inputs=batch, **kwargs)
                for _ in range(2))  # fmt: skip
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_random_follows_its_seed_and_wanda_reads_the_inputs():
    entry = ZOO["llama"]
    model, batch = entry.make(), entry.batch()
    one, two = (compute_masks(model, 0.5, structure="neurons", criterion="random", seed=s, example_inputs=batch)
                for s in (1, 2))  # fmt: skip
    assert any(not torch.equal(one[n], two[n]) for n in one)
    with pytest.raises(ValueError, match="criterion='wanda' scores weights by their inputs"):
        compute_masks(model, 0.5, criterion="wanda")
    wanda = compute_masks(model, 0.5, criterion="wanda", example_inputs=batch)
    magnitude = compute_masks(model, 0.5, criterion="magnitude")
    assert any(not torch.equal(wanda[n], magnitude[n]) for n in wanda)


def test_wanda_compares_within_a_layer_and_refuses_a_global_threshold():
    """Its scores scale with each layer's input norms: one global threshold pruned a LLaMA's embedding, o_proj and
    down_proj to 100% (a test perplexity of exactly the vocabulary size). It allocates per layer by default."""
    entry = ZOO["llama"]
    model, batch = entry.make(), entry.batch()
    assert hf_sms.resolve_pruning(criterion="wanda").allocation == "uniform"
    masks = compute_masks(model, 0.5, criterion="wanda", example_inputs=batch)
    assert all(abs(1 - m.float().mean().item() - 0.5) < 0.01 for m in masks.values())  # no layer emptied
    with pytest.raises(ValueError, match="removes whole\\s+layers|one global threshold removes whole"):
        compute_masks(model, 0.5, "global", criterion="wanda", example_inputs=batch)


def test_units_default_to_li_et_al_l2_norm_and_uniform_allocation():
    plan = hf_sms.resolve_pruning(structure="neurons")
    assert (plan.allocation, plan.criterion, plan.units) == ("uniform", "l2", "units")
    assert hf_sms.resolve_pruning().describe() == {"allocation": "global", "structure": "unstructured",
                                                   "criterion": "magnitude"}  # fmt: skip
    legacy = hf_sms.resolve_pruning("filter_l1")
    assert (legacy.allocation, legacy.structure.name, legacy.criterion) == ("uniform", "filters", "l1")


def test_combinations_that_do_not_exist_are_refused_before_work():
    model = ZOO["t5"].make()
    with pytest.raises(ValueError, match="removes every one of the 4 heads"):
        compute_masks(model, 0.9, structure="heads", example_inputs=ZOO["t5"].batch())
    with pytest.raises(ValueError, match="use allocation='uniform', not 'global'"):
        compute_masks(model, 0.5, "global", structure="neurons")
    with pytest.raises(ValueError, match="unknown pruning structure 'rows'"):
        compute_masks(model, 0.5, structure="rows")
    with pytest.raises(ValueError, match="must be a name"):
        compute_masks(model, 0.5, structure=["neurons"])
    with pytest.raises(ValueError, match="unknown pruning criterion 'taylor'"):
        compute_masks(model, 0.5, criterion="taylor")
    with pytest.raises(ValueError, match="joins unit structures, each once"):
        compute_masks(model, 0.5, structure="neurons+neurons")
    with pytest.raises(ValueError, match="'filter_l2' means structure='filters'"):
        compute_masks(make_cnn(), 0.5, "filter_l2", structure="neurons")
    with pytest.raises(ValueError, match="unit_multiple=0 must be a positive integer"):
        compute_masks(model, 0.5, structure="neurons", unit_multiple=0)


def test_n_of_m_that_fits_no_layer_or_asks_too_much_is_refused():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(ValueError, match="2:3 sparsity prunes linear layers whose input size is a multiple of 3"):
        compute_masks(mlp, 1 / 3, structure="2:3")
    with pytest.raises(ValueError, match="2:4 keeps 2 of every 4 weights: its sparsity is at most 0.5, not 0.9"):
        compute_masks(mlp, 0.9, "2:4")
    with pytest.raises(ValueError, match="prunes linear weights to exactly 0.5: set target_sparsity=0.5"):
        hf_sms.SparseSoupConfig(output_dir="o", structure="2:4", target_sparsity=0.9, report_to="none")
    args = hf_sms.SparseSoupConfig(output_dir="o", structure="1:32", target_sparsity=31 / 32, report_to="none")
    with pytest.raises(ValueError, match="input size is a multiple of 32, and Sequential has none"):
        args.plan.check(mlp, args.target_sparsity)


def test_the_config_resolves_its_plan_once_and_records_it():
    args = hf_sms.SparseSoupConfig(output_dir="o", structure="neurons+heads", report_to="none", unit_multiple=8)
    assert args.allocation == "uniform" and args.plan.describe() == {
        "allocation": "uniform", "structure": "neurons+heads", "criterion": "l2", "unit_multiple": 8,
        "fit_config": True}  # fmt: skip
    import dataclasses

    assert dataclasses.replace(args, seed=3).plan.structure.name == "neurons+heads"  # a replica's args
    legacy = hf_sms.SparseSoupConfig(output_dir="o", allocation="filter_l2", report_to="none")
    assert legacy.plan.describe()["structure"] == "filters" and legacy.plan.criterion == "l2"
    with pytest.raises(ValueError, match="allocation='erk', structure='neurons': .*use allocation='uniform'"):
        hf_sms.SparseSoupConfig(output_dir="o", allocation="erk", structure="neurons", report_to="none")


def test_the_structure_kind_is_asked_only_by_the_plan():
    """Outside hf_sms/plan nothing asks which structure a run has: the loop, checks, recorder, card and checkpoint
    call the plan."""
    root = os.path.join(os.path.dirname(__file__), "..", "hf_sms")
    asked = []
    for folder, _, files in os.walk(root):
        for f in files:
            path = os.path.join(folder, f)
            if f.endswith(".py") and os.sep + "plan" + os.sep not in path:
                text = open(path).read()
                patterns = (
                    "is_unit_structure",
                    "NOfM",
                    ".structure ==",
                    "structure == ",
                    ".units ==",
                    ".units !=",
                    ".structure.",
                )
                asked += [(path, pattern) for pattern in patterns if pattern in text]
    assert not asked, asked


def test_docs_name_every_structure_and_criterion():
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "method.md")).read()
    for name in [*hf_sms.STRUCTURES.names(), *CRITERIA.names()]:
        assert f"`{name}`" in text, name


# -- filter units: counted, merged and saved as Li et al. remove them ------------------------------------------------
def _plain_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


def test_a_filter_unit_takes_the_kernel_slices_of_every_layer_reading_it():
    """Li et al. 2017: a removed filter goes with the next layers' kernel slices that read it, so the FLOP count of
    the pruned model is the smaller model's, conv by conv."""
    model, x = _plain_net(), torch.randn(2, 3, 6, 6)
    apply_masks(model, compute_masks(model, 0.5, structure="filters", example_inputs=x))
    assert int((model[3].weight.flatten(1) != 0).any(1).sum()) == 4  # conv2 keeps 4 filters...
    assert int((model[3].weight.transpose(0, 1).flatten(1) != 0).any(1).sum()) == 4  # ...reading 4 channels
    pixels = 2 * 6 * 6
    f1, f2, head = 2 * pixels * 3 * 8 * 9, 2 * pixels * 8 * 8 * 9, 2 * 2 * 8 * 4
    assert theoretical_speedup(model, x) == pytest.approx((f1 + f2 + head) / (f1 / 2 + f2 / 4 + head / 2))
    smaller = hf_sms.shrink(model, x)
    assert [smaller[0].out_channels, smaller[3].in_channels, smaller[3].out_channels, smaller[7].in_features] == [
        4, 4, 4, 4]  # fmt: skip


@pytest.mark.parametrize("layer", [nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ConvTranspose2d(8, 8, 3, padding=1)])
def test_grouped_convolutions_keep_their_channels_and_transposed_ones_prune_output_filters(layer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), layer, nn.ReLU(), nn.Conv2d(8, 4, 1))
    x = torch.randn(2, 3, 5, 5)
    groups = trace_units(model, x).groups(("filters",))
    names = {m.name for g in groups for m in g.producers}
    if isinstance(layer, nn.ConvTranspose2d):
        assert "2.weight" in names and "0.weight" in names
        apply_masks(model, compute_masks(model, 0.5, structure="filters", example_inputs=x))
        torch.testing.assert_close(hf_sms.shrink(model, x)(x), model(x), rtol=1e-4, atol=1e-5)
    else:  # a grouped conv mixes channels within groups: its input and output channels stay
        assert "0.weight" not in names and "2.weight" not in names


def test_a_uniform_soup_of_filter_pruned_replicas_keeps_every_removed_filter_zero(monkeypatch, caplog):
    base, x = make_resnet(), torch.randn(4, 3, 16, 16)
    monkeypatch.setattr("hf_sms.plan.unit_groups._TOLD", set())
    with caplog.at_level("WARNING", logger="hf_sms"):
        masks = compute_masks(base, 0.5, structure="filters", example_inputs=x)
        compute_masks(base, 0.5, structure="filters", example_inputs=x)
    assert caplog.text.count("fit_config=True leaves") == 1 and "cannot state their widths" in caplog.text
    apply_masks(base, masks)
    replicas = []
    for seed in range(3):
        replica = copy.deepcopy(base).train()
        enforcer = MaskEnforcer(replica, masks)
        optimizer = torch.optim.SGD(replica.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
        torch.manual_seed(seed)
        for _ in range(3):
            loss = nn.functional.cross_entropy(replica(torch.randn(4, 3, 16, 16)), torch.randint(0, 4, (4,)))
            optimizer.zero_grad()
            loss.backward()
            enforcer.mask_gradients()
            optimizer.step()
            enforcer.mask_parameters()
        replicas.append(replica)
    soup = uniform_soup(replicas)
    groups = hf_sms.plan.get_structure("filters").groups(base, x)
    for g in groups:
        assert torch.equal(removed_units(soup, g), removed_units(base, g)), g.name
    # the true fraction counts every filter the graph finds, those fit_config left dense too (issue 37 item 3)
    every = hf_sms.plan.get_structure("filters").groups(base, x, fit_config=False)
    removed = sum(int(removed_units(soup, g).sum()) * g.layers for g in every)
    assert len(every) > len(groups)  # this ResNet's stem and first stage stay dense
    assert hf_sms.resolve_pruning(structure="filters").achieved(soup, x) == {
        "filters": pytest.approx(removed / sum(g.n_units * g.layers for g in every)),
        "filters in pruned groups": 0.5,
    }
    assert removed / sum(g.n_units * g.layers for g in every) < 0.5


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
def test_save_and_load_keep_whole_units(tmp_path, fmt):
    model, x = make_resnet(), torch.randn(2, 3, 16, 16)
    apply_masks(model, compute_masks(model, 0.5, structure="filters", example_inputs=x))
    save_sparse(model, str(tmp_path), fmt)
    loaded = load_sparse(str(tmp_path))
    for name, mask in masks_from_model(model).items():
        assert torch.equal(masks_from_model(loaded)[name], mask), name


def test_cases_that_pruned_nothing_without_a_word_are_refused_or_pruned():
    """Issue 30: heads on a LLaMA with one key/value head (multi-query attention) prune its query heads, and the
    config says 4 of 8; neurons of a plain module holding a transformers layer need a batch to be traced."""
    from transformers import BertConfig, LlamaConfig, LlamaForCausalLM
    from transformers.models.bert.modeling_bert import BertLayer

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=1, head_dim=2)  # fmt: skip
    llama, ids = LlamaForCausalLM(config), {"input_ids": torch.randint(0, 64, (2, 6))}
    apply_masks(llama, compute_masks(llama, 0.5, structure="heads", example_inputs=ids))
    smaller = hf_sms.shrink(llama, ids)
    assert (smaller.config.num_attention_heads, smaller.config.num_key_value_heads) == (4, 1)

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = BertLayer(BertConfig(hidden_size=16, num_attention_heads=2, intermediate_size=32))

        def forward(self, x):
            return self.layer(x)[0]

    with pytest.raises(ValueError, match="Holder needs a batch: pass example_inputs"):
        compute_masks(Holder(), 0.5, structure="neurons")
    masks = compute_masks(Holder(), 0.5, structure="neurons", example_inputs=torch.randn(2, 5, 16))
    assert int((~masks["layer.intermediate.dense.weight"].any(1)).sum()) == 16
