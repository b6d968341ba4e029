"""Pruning as criterion x structure x allocation: masks keep whole units, every criterion is deterministic, and
``shrink`` gives a smaller model of the same family with the same outputs, which loads without hf-sms."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import eval_output, make_cnn, make_t5, without_hf_sms
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import hf_sms
from hf_sms import CRITERIA, apply_masks, compute_masks, shrink
from hf_sms.pruning.structures import removed_units, unit_groups, unit_report

FAST = settings(max_examples=12, deadline=None)


def make_gated_t5(seed: int = 0):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=64, d_model=16, d_ff=24, d_kv=4, num_heads=4, num_layers=2, num_decoder_layers=1,
                      feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    return T5ForConditionalGeneration(config)


def make_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, n_inner=24))


def make_bert(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=32, num_labels=3)  # fmt: skip
    return BertForSequenceClassification(config)


def make_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(config)


def make_vit(seed: int = 0):
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, img_size=16, patch_size=8,
                             embed_dim=16, depth=2, num_heads=2, mlp_ratio=1.5)  # fmt: skip


def _tokens(vocab=64, **extra):
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(2, vocab, (2, 7), generator=g), **extra}


def _image(size):
    return lambda: torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3))


def _seq2seq(vocab=64):
    g = torch.Generator().manual_seed(2)
    return _tokens(vocab, labels=torch.randint(2, vocab, (2, 5), generator=g))


# (model, structure, example batch, the plain loader's import line or None, the config fields that shrink)
FAMILIES = {
    "t5": (make_t5, "neurons+heads", lambda: _seq2seq(384), "AutoModelForSeq2SeqLM", ("d_ff", "num_heads")),
    "t5_gated": (make_gated_t5, "neurons+heads", _seq2seq, "AutoModelForSeq2SeqLM", ("d_ff", "num_heads")),
    "gpt2": (make_gpt2, "neurons", _tokens, "AutoModelForCausalLM", ("n_inner",)),
    "bert": (make_bert, "neurons", _tokens, "AutoModelForSequenceClassification", ("intermediate_size",)),
    "llama": (make_llama, "neurons+heads", _tokens, "AutoModelForCausalLM", ("intermediate_size", "num_key_value_heads")),  # noqa: E501
    "vit": (make_vit, "neurons", _image(16), None, ()),
    "cnn": (make_cnn, "filters", _image(8), None, ()),
}  # fmt: skip


def _unit_state(model, group, masks):
    """Per unit of ``group``: how many of its masked weights the masks keep, and how many it has."""
    masked = [m for m in group.members if m.masked]
    kept = sum(m.unit_sums(masks[m.name].long(), group.n_units) for m in masked)
    total = sum(m.unit_sums(torch.ones_like(masks[m.name], dtype=torch.long), group.n_units) for m in masked)
    return kept, total


# -- masks keep whole units ---------------------------------------------------------------------------------------
@FAST
@given(
    family=st.sampled_from(sorted(FAMILIES)),
    s1=st.floats(0.0, 0.6),
    extra=st.floats(0.0, 0.3),
    criterion=st.sampled_from(["l2", "l1", "magnitude", "random"]),
    seed=st.integers(0, 2**16),
)
def test_masks_keep_whole_units_remove_the_fraction_asked_and_only_grow(family, s1, extra, criterion, seed):
    make, structure, *_ = FAMILIES[family]
    model = make(seed % 3)
    groups = unit_groups(model, structure)
    assume(all(g.n_units - round((s1 + extra) * g.n_units) >= 1 for g in groups))  # else refused (tested below)
    first = compute_masks(model, s1, structure=structure, criterion=criterion, seed=seed)
    torch.manual_seed(seed)  # new weights: the earlier units must stay removed whatever their norms now
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    second = compute_masks(model, s1 + extra, masks=first, structure=structure, criterion=criterion, seed=seed)
    for g in groups:
        for masks, s in ((first, s1), (second, s1 + extra)):
            kept, total = _unit_state(model, g, masks)
            assert bool(((kept == 0) | (kept == total)).all()), f"{g.name}: a unit is partly pruned"
            assert int((kept == 0).sum()) == round(s * g.n_units), g.name
        was, now = (_unit_state(model, g, m)[0] == 0 for m in (first, second))
        assert not bool((was & ~now).any()), f"{g.name}: a removed unit came back"
    grouped = {m.name for g in groups for m in g.members}
    assert all(bool(m.all()) for n, m in second.items() if n not in grouped)  # the rest is not pruned


@pytest.mark.parametrize("criterion", sorted(CRITERIA))
def test_every_criterion_gives_the_same_masks_for_the_same_inputs(criterion):
    model, batch = make_t5(), _seq2seq(384)
    a, b = (compute_masks(model, 0.5, structure="neurons+heads", criterion=criterion, seed=7, example_inputs=batch)
            for _ in range(2))  # fmt: skip
    assert all(torch.equal(a[n], b[n]) for n in a)
    u = compute_masks(model, 0.6, criterion=criterion, seed=7, example_inputs=batch)  # unstructured too
    assert all(torch.equal(u[n], m) for n, m in compute_masks(model, 0.6, criterion=criterion, seed=7,
                                                               example_inputs=batch).items())  # fmt: skip


def test_random_follows_its_seed_and_wanda_reads_the_inputs():
    model, batch = make_llama(), _tokens()
    one, two = (compute_masks(model, 0.5, structure="neurons", criterion="random", seed=s) for s in (1, 2))
    assert any(not torch.equal(one[n], two[n]) for n in one)
    with pytest.raises(ValueError, match="criterion='wanda' scores weights by their inputs"):
        compute_masks(model, 0.5, criterion="wanda")
    wanda = compute_masks(model, 0.5, criterion="wanda", example_inputs=batch)
    magnitude = compute_masks(model, 0.5, criterion="magnitude")
    assert any(not torch.equal(wanda[n], magnitude[n]) for n in wanda)


# -- shrink: smaller, same outputs, plain loading ---------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shrink_gives_a_smaller_model_with_equal_outputs(family):
    make, structure, batch_of, _, fields = FAMILIES[family]
    model, batch = make(), batch_of()
    apply_masks(model, compute_masks(model, 0.5, structure=structure, criterion="l2"))
    smaller = shrink(model, batch)
    assert type(smaller) is type(model) and {n for n, _ in smaller.named_modules()} == {
        n for n, _ in model.named_modules()
    }
    params = sum(p.numel() for p in smaller.parameters())
    assert params < sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(eval_output(smaller, batch), eval_output(model, batch), rtol=1e-4, atol=1e-5)
    for field in fields:
        assert getattr(smaller.config, field) < getattr(model.config, field), field
    assert (
        unit_report(smaller, structure)
        == {
            k: {"removed": 0, "units": v["units"] - v["removed"], "sparsity": 0.0}
            for k, v in unit_report(model, structure).items()
        }
        or family == "cnn"
    )


# the SMS tests below load the other families' final soups the same way; these extra rows run with -m slow
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "family", ["t5", *(pytest.param(f, marks=_SLOW) for f in ("t5_gated", "gpt2", "bert", "llama", "vit"))]
)
def test_a_shrunk_checkpoint_loads_without_hf_sms(tmp_path, family):
    make, structure, batch_of, auto, _ = FAMILIES[family]
    model, batch = make(), batch_of()
    apply_masks(model, compute_masks(model, 0.5, structure=structure))
    hf_sms.save_sparse(shrink(model, batch), str(tmp_path / "small"), "dense")
    torch.save({"batch": batch, "expected": eval_output(model, batch)}, tmp_path / "io.pt")
    if auto is not None:
        load = f"import transformers\nm = transformers.{auto}.from_pretrained({str(tmp_path / 'small')!r})"
        call = "out = m(**io['batch']).logits"
    else:
        load = f"import timm\nm = timm.create_model('local-dir:{tmp_path / 'small'}', pretrained=True)"
        call = "out = m(io['batch'])"
    code = f"""{load}
import torch
io = torch.load({str(tmp_path / "io.pt")!r})
m.eval()
with torch.no_grad():
    {call}
torch.testing.assert_close(out.float(), io['expected'], rtol=1e-4, atol=1e-5)
print(sum(p.numel() for p in m.parameters()))
"""
    assert int(without_hf_sms(code)) == sum(p.numel() for p in shrink(model, batch).parameters())


def test_layers_of_one_config_field_keep_the_same_count(tmp_path):
    """A layer that removed fewer units sets the count; the others keep a few removed ones (zeros: exact)."""
    model, batch = make_gpt2(), _tokens()
    masks = compute_masks(model, 0.5, structure="neurons")
    first = unit_groups(model, "neurons")[0]
    for m in first.members:  # the first FFN keeps every neuron
        if m.masked:
            masks[m.name] = torch.ones_like(masks[m.name])
    apply_masks(model, masks)
    smaller = shrink(model, batch)
    assert smaller.config.n_inner == 24 and all(b.mlp.c_fc.nf == 24 for b in smaller.transformer.h)
    torch.testing.assert_close(eval_output(smaller, batch), eval_output(model, batch), rtol=1e-4, atol=1e-5)


# -- bad input, before any work ----------------------------------------------------------------------------------------
def test_filters_of_a_model_fx_cannot_follow_are_refused_before_training(tmp_path):
    """The soup of a filter-pruned model is only smaller where torch.fx follows its channels."""
    from conftest import sms_config

    from hf_sms.evaluation import ClassificationAccuracy

    class Branchy(nn.Module):  # control flow on the data: symbolic tracing cannot follow it
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            h = self.conv(x)
            h = h.relu() if h.mean() > 0 else h.tanh()
            return self.fc(h.mean((2, 3)))

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(3, 8, 8, generator=g), "labels": torch.tensor(i % 4)} for i in range(16)]
    args = sms_config(tmp_path, structure="filters", target_sparsity=0.5, n_phases=1, max_steps=2)
    with pytest.raises(ValueError, match="structure='filters': shrink_filters needs a model torch.fx can trace"):
        hf_sms.SparseModelSoup(Branchy(), args, data[:8], ClassificationAccuracy(), eval_dataset=data[8:])
    assert not (tmp_path / "run").exists()


def test_structures_that_do_not_fit_the_model_are_explained():
    with pytest.raises(ValueError, match="'heads' finds no units in TinyCNN"):
        compute_masks(make_cnn(), 0.5, structure="heads")
    with pytest.raises(ValueError, match="GPT-2 computes the head size as hidden size / heads"):
        compute_masks(make_gpt2(), 0.5, structure="heads")
    with pytest.raises(ValueError, match="removes every one of the 2 heads"):
        compute_masks(make_t5(), 0.8, structure="heads")
    with pytest.raises(ValueError, match="use allocation='uniform', not 'global'"):
        compute_masks(make_t5(), 0.5, "global", structure="neurons")
    with pytest.raises(ValueError, match="unknown pruning structure 'rows'"):
        compute_masks(make_t5(), 0.5, structure="rows")
    with pytest.raises(ValueError, match="unknown pruning criterion 'taylor'"):
        compute_masks(make_t5(), 0.5, criterion="taylor")
    with pytest.raises(ValueError, match="joins unit structures, each once"):
        compute_masks(make_t5(), 0.5, structure="neurons+neurons")
    with pytest.raises(ValueError, match="'filter_l2' means structure='filters'"):
        compute_masks(make_cnn(), 0.5, "filter_l2", structure="neurons")


def test_n_of_m_that_fits_no_layer_or_asks_too_much_is_refused():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(ValueError, match="2:3 sparsity prunes linear layers whose input size is a multiple of 3"):
        compute_masks(mlp, 1 / 3, structure="2:3")
    with pytest.raises(ValueError, match="2:4 keeps 2 of every 4 weights: its sparsity is at most 0.5, not 0.9"):
        compute_masks(mlp, 0.9, "2:4")
    args = hf_sms.SparseSoupConfig(output_dir="o", structure="1:32", target_sparsity=31 / 32, report_to="none")
    from hf_sms.loop.checks import check_structure

    with pytest.raises(ValueError, match="input size is a multiple of 32, and Sequential has none"):
        check_structure(args, mlp)


def test_the_config_resolves_and_records_what_it_prunes():
    args = hf_sms.SparseSoupConfig(output_dir="o", structure="neurons+heads", criterion="l2", report_to="none")
    assert args.allocation == "uniform" and args.pruning["structure"] == "neurons+heads"
    legacy = hf_sms.SparseSoupConfig(output_dir="o", allocation="filter_l2", report_to="none")
    assert {k: legacy.pruning[k] for k in ("allocation", "structure", "criterion")} == {
        "allocation": "uniform", "structure": "filters", "criterion": "l2"}  # fmt: skip
    with pytest.raises(ValueError, match="allocation='erk', structure='neurons': .*use allocation='uniform'"):
        hf_sms.SparseSoupConfig(output_dir="o", allocation="erk", structure="neurons", report_to="none")


def test_removed_units_reads_the_weights():
    model = make_t5()
    apply_masks(model, compute_masks(model, 0.5, structure="neurons"))
    for g in unit_groups(model, "neurons"):
        assert int(removed_units(model, g).sum()) == 16
    info = json.dumps(unit_report(model, "neurons+heads"))
    assert '"neurons": {"removed": 32, "units": 64' in info and '"heads": {"removed": 0' in info


def test_docs_name_every_structure_and_criterion():
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "method.md")).read()
    for name in [*hf_sms.STRUCTURES.names(), *CRITERIA.names()]:
        assert f"`{name}`" in text, name


# -- SMS with structure ------------------------------------------------------------------------------------------------
def test_sms_with_neurons_and_heads_gives_a_plain_smaller_t5(tmp_path):
    """Prune -> SMS (2 phases, 2 replicas, uniform soup) -> soup -> shrink -> save -> load in an interpreter that
    never imports hf_sms, outputs equal; the IMP baseline prunes the same structure."""
    from conftest import copy_task_rows, neg_loss, sms_config

    rows = copy_task_rows()
    model = make_gated_t5()
    model.config.vocab_size = 384
    model.resize_token_embeddings(384)
    args = sms_config(
        tmp_path,
        structure="neurons+heads",
        criterion="l2",
        target_sparsity=0.5,
        n_phases=2,
        learning_rate=1e-3,
        optim="adamw_torch",
        baselines=["imp"],
        per_device_train_batch_size=8,
    )
    soup, results = hf_sms.run_sms(model, args, rows[:32], neg_loss, eval_dataset=rows[32:])
    for method in ("sms_uniform", "imp"):
        units = [r["units"] for r in results["rows"][method]]
        assert units[0] == {"neurons": pytest.approx(1 / 3, abs=0.05), "heads": 0.25}, method  # 1 - 0.5**0.5
        assert units[-1] == {"neurons": 0.5, "heads": 0.5}, method
    for g in unit_groups(soup, "neurons+heads"):  # the soup keeps whole units: half of every group is all zero
        assert int(removed_units(soup, g).sum()) == g.n_units // 2
    folder = tmp_path / "run" / "final_soup"
    info = json.loads((folder / "sparsity.json").read_text())
    shrunk = info["recipe"]["shrunk"]
    assert info["format"] == "dense" and shrunk["saved"] == "smaller" and shrunk["parameter_ratio"] < 1
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    card = (folder / "README.md").read_text()
    assert "**No hf-sms needed**" in card and "whole units cut out" in card and "it loads with its own library" in card
    assert "saves these FLOPs as it is, on any device." in card and "sparse kernels" not in card
    batch = {k: torch.stack([r[k] for r in rows[:4]]) for k in rows[0]}
    torch.save({"batch": batch, "expected": eval_output(soup, batch)}, tmp_path / "io.pt")
    out = without_hf_sms(f"""import torch, transformers
m = transformers.AutoModelForSeq2SeqLM.from_pretrained({str(folder)!r}).eval()
io = torch.load({str(tmp_path / "io.pt")!r})
with torch.no_grad():
    torch.testing.assert_close(m(**io['batch']).logits, io['expected'], rtol=1e-4, atol=1e-5)
print(m.config.d_ff, m.config.num_heads)
""")
    assert out.split() == ["12", "2"]


def test_hf_sms_speed_times_a_smaller_folder_against_its_dense_shapes(tmp_path, capsys):
    from hf_sms.cli import main
    from hf_sms.loop.final_soup import save_final_soup

    dense, batch = make_t5(), _seq2seq(384)
    pruned = make_t5()
    apply_masks(pruned, compute_masks(pruned, 0.5, structure="neurons+heads"))
    folder = str(tmp_path / "soup")
    save_final_soup(pruned, folder, dense=dense, structure="neurons+heads", example=batch, recipe={})
    info = json.loads((tmp_path / "soup" / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert info["dense_config"] == {"d_ff": 32, "num_heads": 2} and info["saved"] == "smaller"
    assert main(["speed", folder, "--repeats", "2", "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "the smaller model vs the dense shapes" in out and "of 11,504 parameters" in out


def _lm_rows(vocab=64, n=24, length=8, classes=None):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, vocab, (n, length), generator=g)
    labels = None if classes is None else ids[:, 0] % classes
    return [{"input_ids": ids[i], "labels": ids[i] if classes is None else labels[i]} for i in range(n)]


@pytest.mark.parametrize(
    ("family", "rows", "auto"),
    [
        ("gpt2", lambda: _lm_rows(), "AutoModelForCausalLM"),
        ("llama", lambda: _lm_rows(), "AutoModelForCausalLM"),
        ("bert", lambda: _lm_rows(classes=3), "AutoModelForSequenceClassification"),
    ],
)
def test_sms_with_units_gives_a_plain_smaller_model_for_every_family(tmp_path, family, rows, auto):
    """prune -> SMS -> soup -> shrink -> save -> load where hf_sms is never imported, outputs equal."""
    from conftest import neg_loss, sms_config

    make, structure, *_ = FAMILIES[family]
    data = rows()
    args = sms_config(tmp_path, structure=structure, target_sparsity=0.5, n_phases=1, max_steps=2,
                      learning_rate=1e-3, optim="adamw_torch", per_device_train_batch_size=8)  # fmt: skip
    soup, results = hf_sms.run_sms(make(), args, data[:16], neg_loss, eval_dataset=data[16:])
    assert set(results["rows"]["sms_uniform"][-1]["units"]) == set(structure.split("+"))
    folder = tmp_path / "run" / "final_soup"
    assert json.loads((folder / "sparsity.json").read_text())["recipe"]["shrunk"]["saved"] == "smaller"
    batch = {k: torch.stack([r[k] for r in data[:4]]) for k in data[0]}
    torch.save({"batch": batch, "expected": eval_output(soup, batch)}, tmp_path / "io.pt")
    without_hf_sms(f"""import torch, transformers
m = transformers.{auto}.from_pretrained({str(folder)!r}).eval()
io = torch.load({str(tmp_path / "io.pt")!r})
with torch.no_grad():
    torch.testing.assert_close(m(**io['batch']).logits, io['expected'], rtol=1e-4, atol=1e-5)
""")


def make_maxvit(seed: int = 0):
    import timm

    torch.manual_seed(seed)  # two stage widths: the MLPs keep one expand ratio of their own block's width
    tiny = {"embed_dim": (8, 16, 16, 16), "depths": (1, 1, 1, 1), "stem_width": 8, "transformer_dim_head": 4}
    return timm.create_model("maxvit_rmlp_nano_rw_256", pretrained=False, img_size=32, num_classes=4, **tiny)


@pytest.mark.parametrize(("make", "size", "first_mlp"), [
    (make_vit, 16, "blocks.0.mlp.fc1"),
    (make_maxvit, 32, "stages.0.blocks.0.attn_block.mlp.fc1"),
], ids=["vit", "maxvit"])  # fmt: skip
def test_sms_with_neurons_gives_a_plain_smaller_timm_model(tmp_path, make, size, first_mlp):
    """timm's ViT (``mlp_ratio``) and MaxViT (``transformer_expand_ratio``; its relative-position MLPs keep their
    units, no argument states their width): the final soup is a smaller model timm alone loads."""
    from conftest import sms_config

    from hf_sms.evaluation import ClassificationAccuracy

    g = torch.Generator().manual_seed(6)
    data = [{"x": torch.randn(3, size, size, generator=g), "labels": torch.tensor(i % 4)} for i in range(24)]
    args = sms_config(tmp_path, structure="neurons", target_sparsity=0.5, n_phases=1, max_steps=2,
                      per_device_train_batch_size=8)  # fmt: skip
    dense = make()
    width = dense.get_submodule(first_mlp).out_features
    soup, _ = hf_sms.run_sms(dense, args, data[:16], ClassificationAccuracy(), eval_dataset=data[16:])
    folder = tmp_path / "run" / "final_soup"
    batch = torch.stack([r["x"] for r in data[:4]])
    torch.save({"batch": batch, "expected": eval_output(soup, batch)}, tmp_path / "io.pt")
    without_hf_sms(f"""import torch, timm
m = timm.create_model('local-dir:{folder}', pretrained=True).eval()
io = torch.load({str(tmp_path / "io.pt")!r})
with torch.no_grad():
    torch.testing.assert_close(m(io['batch']), io['expected'], rtol=1e-4, atol=1e-5)
assert m.get_submodule({first_mlp!r}).out_features == {width // 2}
""")
