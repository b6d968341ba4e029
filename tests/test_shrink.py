"""``shrink``: the smaller model its family's own config states (transformers, timm, smp), equal outputs, loading
in a process that never imports hf-sms; widths at multiples; every bad input refused before work."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import eval_output, make_cnn, without_hf_sms
from zoo import ZOO

import hf_sms
from hf_sms import apply_masks, compute_masks, shrink
from hf_sms.pruning import trace_units
from hf_sms.shrinking import parameter_count
from hf_sms.shrinking.fit import tensor_shapes

STATED = sorted(n for n, e in ZOO.items() if e.kinds and e.loader)  # families that load without hf-sms
# in CI: each library and each kind of unit (filters, neurons, heads, a gated MLP); the rest with -m slow
STATED_CI = ["bart", "llama", "maxvit", "smp_pspnet", "t5_gated", "timm_resnet"]


def _pruned(name, sparsity=0.5, **kwargs):
    entry = ZOO[name]
    model, batch = entry.make(), entry.batch()
    structure = "+".join(entry.kinds)
    apply_masks(model, compute_masks(model, sparsity, structure=structure, example_inputs=batch, **kwargs))
    return model, batch, structure


@pytest.mark.parametrize(
    "names", [STATED_CI, pytest.param([n for n in STATED if n not in STATED_CI], marks=pytest.mark.slow)]
)
def test_every_family_shrinks_to_a_model_its_own_library_loads_without_hf_sms(tmp_path, names):
    """At 50 % of the units its config can state: smaller than 0.95x, equal outputs, saved in the family's own
    format and loaded by transformers' Auto classes, timm or smp in one process that never imports hf_sms."""
    assert set(STATED_CI) <= set(STATED)
    checks = []
    for name in names:
        model, batch, structure = _pruned(name)
        smaller = shrink(model, batch, structure=structure)
        assert type(smaller) is type(model), name
        assert parameter_count(smaller) < 0.95 * parameter_count(model), name
        folder = str(tmp_path / name)
        hf_sms.save_sparse(smaller, folder, "dense")
        torch.save({"batch": batch, "expected": eval_output(model, batch)}, tmp_path / f"{name}.pt")
        load = ZOO[name].loader.format(f=folder)
        checks.append(f"""
{load}
io = torch.load({str(tmp_path / f"{name}.pt")!r})
m.eval()
with torch.no_grad():
    out = m(**io['batch']) if isinstance(io['batch'], dict) else m(io['batch'])
torch.testing.assert_close(getattr(out, 'logits', out).float(), io['expected'], rtol=1e-4, atol=1e-5)
print('LOADED', {name!r})
""")
    out = without_hf_sms("import torch\n" + "".join(checks))
    assert sorted(line.split()[1] for line in out.splitlines() if line.startswith("LOADED")) == sorted(names)


@pytest.mark.parametrize("name", ["efficientnet_b0", "convnext_atto"])
def test_what_a_family_cannot_state_is_cut_in_place_by_default(name, caplog):
    """timm's efficientnet_b0 and convnext_atto take no argument that sizes their blocks: with the defaults every
    unit the graph finds is pruned (the log says why and how it will load) and shrink cuts them in place, as with
    fit_config=False (tests/test_plain_routes.py: the plain route that loads it without hf-sms)."""
    import logging

    entry = ZOO[name]
    model, batch = entry.make(), entry.batch()
    with caplog.at_level(logging.WARNING, logger="hf_sms"):
        masks = compute_masks(model, 0.5, structure="filters", example_inputs=batch)
    assert "states none of its filters widths" in caplog.text and "torch.export" in caplog.text
    every = compute_masks(model, 0.5, structure="filters", example_inputs=batch, fit_config=False)
    assert all(torch.equal(masks[k], every[k]) for k in every)  # the same units as fit_config=False
    apply_masks(model, masks)
    smaller = shrink(model, batch)
    assert parameter_count(smaller) < 0.6 * parameter_count(model)
    assert tensor_shapes(smaller) == tensor_shapes(shrink(model, batch, fit_config=False))


def test_maxvit_filters_and_neurons_are_stated_by_its_expand_ratios():
    model, batch, structure = _pruned("maxvit")
    smaller = shrink(model, batch, structure=structure)
    assert set(smaller._model_args) >= {"conv_expand_ratio", "transformer_expand_ratio"}
    mlp = "stages.0.blocks.0.attn_block.mlp.fc1"
    assert smaller.get_submodule(mlp).out_features == model.get_submodule(mlp).out_features // 2


def test_layers_of_one_config_field_keep_the_same_count():
    """A layer that removed fewer units sets the count; the others keep a few removed ones (zeros: exact)."""
    entry = ZOO["gpt2"]
    model, batch = entry.make(), entry.batch()
    masks = compute_masks(model, 0.5, structure="neurons", example_inputs=batch)
    first = trace_units(model, batch).groups(("neurons",))[0]
    for m in first.masked:  # the first FFN keeps every neuron
        masks[m.name] = torch.ones_like(masks[m.name])
    apply_masks(model, masks)
    with pytest.warns(UserWarning, match="kept 32 neurons removed units as zeros"):
        smaller = shrink(model, batch)
    assert smaller.config.n_inner == 64 and all(b.mlp.c_fc.nf == 64 for b in smaller.transformer.h)
    assert trace_units(smaller, batch).groups(("neurons",))[1].n_units == 64  # 32 of them all zero
    torch.testing.assert_close(eval_output(smaller, batch), eval_output(model, batch), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "timm_resnet"])
def test_widths_at_multiples_of_n(name):
    """``unit_multiple`` keeps a multiple of n units per group (the next best stay); ``shrink(multiple_of=n)`` pads
    a soup pruned without it with removed units."""
    entry = ZOO[name]
    structure = "+".join(entry.kinds)
    model, batch = entry.make(), entry.batch()
    masks = compute_masks(model, 0.6, structure=structure, example_inputs=batch, unit_multiple=4)
    apply_masks(model, masks)
    for g in trace_units(model, batch).groups(entry.kinds):
        kept = g.n_units - int(hf_sms.pruning.removed_units(model, g).sum())
        assert kept == g.n_units or kept % 4 == 0 or kept == min(g.n_units, math.ceil(0.4 * g.n_units)), g.name
    plain, _, _ = _pruned(name, 0.6)
    smaller = shrink(plain, batch, structure=structure, multiple_of=4)
    for g in trace_units(smaller, batch).groups(entry.kinds):
        assert g.n_units % 4 == 0 or g.n_units in (1, 2), g.name
    torch.testing.assert_close(eval_output(smaller, batch), eval_output(plain, batch), rtol=1e-4, atol=1e-5)


def test_bad_input_is_refused_before_any_work():
    model, batch, _ = _pruned("llama")
    for rtol in (float("nan"), -1, 0):
        with pytest.raises(ValueError, match="rtol=.* must be a positive number"):
            shrink(model, batch, rtol=rtol)
    with pytest.raises(ValueError, match="multiple_of=0 must be a positive integer"):
        shrink(model, batch, multiple_of=0)
    with pytest.raises(ValueError, match="not a unit structure"):
        shrink(model, batch, structure=["neurons"])
    dense = ZOO["bert"].make()
    apply_masks(dense, compute_masks(dense, 0.5))  # unstructured: no unit is all zero
    with pytest.raises(ValueError, match="no filters/neurons/heads unit .* is entirely zero"):
        shrink(dense)
    with torch.device("meta"):
        meta = ZOO["llama"].make()
    with pytest.raises(ValueError, match="parameters on the meta device"):
        shrink(meta)
    runtime = hf_sms.to_sparse_runtime(model, "csr", batch, min_sparsity=0.0)
    with pytest.raises(ValueError, match="sparse-runtime layer"):
        shrink(runtime, batch)


def test_a_plain_model_needs_a_batch_and_gets_every_unit_cut():
    model, x = make_cnn(), torch.randn(2, 3, 8, 8)
    apply_masks(model, compute_masks(model, 0.5, structure="filters", example_inputs=x))
    with pytest.raises(ValueError, match="TinyCNN needs a batch: pass example_inputs"):
        shrink(model)
    smaller = shrink(model, x)
    assert smaller.conv1.out_channels == 4 and smaller.bn1.num_features == 4
    torch.testing.assert_close(smaller(x), model(x), rtol=1e-4, atol=1e-5)


def test_hf_sms_speed_times_a_smaller_folder_against_its_dense_shapes(tmp_path, capsys):
    from hf_sms.cli import main
    from hf_sms.loop.final_soup import save_final_soup

    entry = ZOO["t5"]
    dense, batch = entry.make(), entry.batch()
    pruned, _, structure = _pruned("t5")
    plan = hf_sms.resolve_pruning(structure=structure)
    folder = str(tmp_path / "soup")
    save_final_soup(pruned, folder, dense=dense, plan=plan, example=batch, recipe={})
    info = json.loads((tmp_path / "soup" / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert info["dense_config"] == {"d_ff": 64, "num_heads": 4} and info["saved"] == "smaller"
    # its fresh-process memory rows are tested on a saved soup (tests/test_runtime.py)
    assert main(["speed", folder, "--repeats", "2", "--seq-len", "8", "--no-memory"]) == 0
    out = capsys.readouterr().out
    assert "the smaller model vs the dense shapes" in out and f"of {parameter_count(dense):,} parameters" in out
