"""SMS with whole units, end to end: prune -> retrain replicas -> soup -> shrink -> save -> load in a process that
never imports hf_sms, outputs equal; what the run says before it trains; a soup that cannot be cut is still saved."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from conftest import copy_task_rows, eval_output, neg_loss, sms_config, without_hf_sms
from torch import nn
from zoo import ZOO

import hf_sms
from hf_sms.evaluation import ClassificationAccuracy, MeanIoU
from hf_sms.pruning import removed_units


def test_sms_with_neurons_and_heads_gives_a_plain_smaller_t5(tmp_path):
    """2 phases, 2 replicas, uniform soup and the IMP baseline on a gated T5: the final soup is a T5 with half the
    FFN width and half the heads, which transformers alone loads with the soup's outputs."""
    rows = copy_task_rows()
    model = ZOO["t5_gated"].make()
    model.resize_token_embeddings(384)
    args = sms_config(tmp_path, structure="neurons+heads", target_sparsity=0.5, n_phases=2, learning_rate=1e-3,
                      optim="adamw_torch", baselines=["imp"], per_device_train_batch_size=8)  # fmt: skip
    soup, results = hf_sms.run_sms(model, args, rows[:32], neg_loss, eval_dataset=rows[32:])
    for method in ("sms_uniform", "imp"):
        units = [r["units"] for r in results["rows"][method]]
        assert units[0] == {"neurons": pytest.approx(1 / 3, abs=0.05), "heads": 0.25}, method  # 1 - 0.5**0.5
        assert units[-1] == {"neurons": 0.5, "heads": 0.5}, method
    batch = {k: torch.stack([r[k] for r in rows[:4]]) for k in rows[0]}
    for g in args.plan.structure.groups(soup, batch):  # the soup keeps whole units: half of every group is zero
        assert int(removed_units(soup, g).sum()) == g.n_units // 2
    folder = tmp_path / "run" / "final_soup"
    info = json.loads((folder / "sparsity.json").read_text())
    shrunk = info["recipe"]["shrunk"]
    assert info["format"] == "dense" and shrunk["saved"] == "smaller" and shrunk["parameter_ratio"] < 1
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    card = (folder / "README.md").read_text()
    assert "**No hf-sms needed**" in card and "whole units cut out" in card and "it loads with its own library" in card
    assert "saves these FLOPs as it is, on any device." in card and "sparse kernels" not in card
    torch.save({"batch": batch, "expected": eval_output(soup, batch)}, tmp_path / "io.pt")
    out = without_hf_sms(f"""import torch, transformers
m = transformers.AutoModelForSeq2SeqLM.from_pretrained({str(folder)!r}).eval()
io = torch.load({str(tmp_path / "io.pt")!r})
with torch.no_grad():
    torch.testing.assert_close(m(**io['batch']).logits, io['expected'], rtol=1e-4, atol=1e-5)
print(m.config.d_ff, m.config.num_heads)
""")
    assert out.split()[-2:] == ["24", "2"]


def _lm_rows(vocab=64, n=24, length=8, classes=None):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, vocab, (n, length), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i] if classes is None else ids[i, 0] % classes} for i in range(n)]


def _images(n=24, size=32, segmentation=False):
    g = torch.Generator().manual_seed(7)
    return [
        {"x": torch.randn(3, size, size, generator=g),
         "labels": torch.randint(0, 19, (size, size), generator=g) if segmentation else torch.tensor(i % 4)}
        for i in range(n)
    ]  # fmt: skip


_SLOW = pytest.mark.slow
RUNS = {  # zoo entry, its data, the metric: one family per library in CI, the rest with -m slow
    "llama": (lambda: _lm_rows(), lambda: neg_loss),
    "timm_resnet": (lambda: _images(), ClassificationAccuracy),
    "smp_pspnet": (lambda: _images(segmentation=True), lambda: MeanIoU(num_classes=19)),
    "gpt2": (lambda: _lm_rows(), lambda: neg_loss),
    "bert": (lambda: _lm_rows(classes=3), lambda: neg_loss),
    "opt": (lambda: _lm_rows(), lambda: neg_loss),
    "phi": (lambda: _lm_rows(), lambda: neg_loss),
    "vit": (lambda: [{"pixel_values": r["x"][:, :16, :16], "labels": r["labels"] % 3} for r in _images()],
            lambda: neg_loss),
    "timm_vit": (lambda: [{"x": r["x"][:, :16, :16], "labels": r["labels"]} for r in _images()],
                 ClassificationAccuracy),
    "maxvit": (lambda: _images(), ClassificationAccuracy),
}  # fmt: skip


@pytest.mark.parametrize("name", [*list(RUNS)[:3], *(pytest.param(n, marks=_SLOW) for n in list(RUNS)[3:])])
def test_sms_with_units_gives_a_smaller_model_its_own_library_loads(tmp_path, name, capsys):
    from hf_sms.cli import main

    entry = ZOO[name]
    data_of, metric_of = RUNS[name]
    data = data_of()
    args = sms_config(tmp_path, structure="+".join(entry.kinds), target_sparsity=0.5, n_phases=1, max_steps=2,
                      learning_rate=1e-3, optim="adamw_torch", per_device_train_batch_size=8)  # fmt: skip
    soup, results = hf_sms.run_sms(entry.make(), args, data[:16], metric_of(), eval_dataset=data[16:])
    units = results["rows"]["sms_uniform"][-1]["units"]  # every unit counted; "... in pruned groups" where left dense
    assert {k.removesuffix(" in pruned groups") for k in units} == set(entry.kinds)
    assert all(units[k] <= units.get(f"{k} in pruned groups", units[k]) for k in entry.kinds)
    folder = tmp_path / "run" / "final_soup"
    shrunk = json.loads((folder / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert shrunk["saved"] == "smaller" and shrunk["parameter_ratio"] < 0.95, shrunk
    batch = {k: torch.stack([r[k] for r in data[:4]]) for k in data[0] if k != "labels" or "input_ids" in data[0]}
    if "x" in batch:
        batch = batch["x"]
    torch.save({"batch": batch, "expected": eval_output(soup, batch)}, tmp_path / "io.pt")
    without_hf_sms(f"""import torch
{entry.loader.format(f=str(folder))}
io = torch.load({str(tmp_path / "io.pt")!r})
m.eval()
with torch.no_grad():
    out = m(**io['batch']) if isinstance(io['batch'], dict) else m(io['batch'])
torch.testing.assert_close(getattr(out, 'logits', out).float(), io['expected'], rtol=1e-4, atol=1e-5)
""")
    if name == "timm_resnet":  # hf-sms speed times it against the dense widths it was cut from
        # its fresh-process memory rows are tested on a saved soup (tests/test_runtime.py)
        assert main(["speed", str(folder), "--repeats", "2", "--image-size", "32", "--no-memory"]) == 0
        assert "the smaller model vs the dense shapes" in capsys.readouterr().out


def test_a_unit_run_says_before_training_how_much_smaller_its_soup_will_be(tmp_path, caplog):
    """An hour of training should not end in a model no smaller than the dense one without a word first."""
    entry = ZOO["timm_resnet"]
    data = _images(16)
    for fit_config, expected in ((True, "will have about 0.5"), (False, "will have about 0.3")):
        args = sms_config(tmp_path, structure="filters", target_sparsity=0.5, n_phases=1, max_steps=2,
                          fit_config=fit_config)  # fmt: skip
        caplog.clear()
        with caplog.at_level("INFO", logger="hf_sms.loop.checks"):
            hf_sms.SparseModelSoup(entry.make(), args, data[:8], ClassificationAccuracy(), eval_dataset=data[8:])
        assert expected in caplog.text, caplog.text


def test_a_run_whose_structure_finds_nothing_is_refused_before_work(tmp_path):
    class Branchy(nn.Module):  # no layer its units could be cut from: filters read only by a grouped conv
        def __init__(self):
            super().__init__()
            self.conv, self.grouped = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1, groups=4)

        def forward(self, x):
            return self.grouped(self.conv(x).relu()).mean((2, 3))

    data = [{"x": torch.randn(3, 8, 8), "labels": torch.tensor(i % 4)} for i in range(16)]
    args = sms_config(tmp_path, structure="filters", target_sparsity=0.5, n_phases=1, max_steps=2)
    with pytest.raises(ValueError, match="(?s)'filters' finds no units in Branchy.*grouped convolution"):
        hf_sms.SparseModelSoup(Branchy(), args, data[:8], ClassificationAccuracy(), eval_dataset=data[8:])
    assert not (tmp_path / "run").exists()


def test_a_soup_shrink_cannot_cut_is_still_saved_pruned(tmp_path):
    """At the end of a long run a shrink that fails loses nothing: the pruned soup is saved, the recipe says why."""
    from hf_sms.loop.final_soup import save_final_soup

    entry = ZOO["timm_resnet"]
    pruned, x = entry.make(), entry.batch()
    plan = hf_sms.resolve_pruning(structure="filters")
    hf_sms.apply_masks(pruned, plan.masks(pruned, 0.5, example_inputs=x))
    folder = str(tmp_path / "soup")
    with mock.patch("hf_sms.plan.structures.shrink", side_effect=ValueError("outputs differ")):
        save_final_soup(pruned, folder, dense=entry.make(), plan=plan, example=x, recipe={})
    shrunk = json.loads((tmp_path / "soup" / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert shrunk["saved"] == "pruned" and "outputs differ" in shrunk["why"]
    loaded = hf_sms.load_sparse(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), pruned.state_dict().values()))


@pytest.mark.parametrize("name", ["efficientnet_b0", "torchvision_resnet"])
def test_a_smaller_model_its_config_cannot_state_is_saved_cut_in_place(tmp_path, name):
    """timm's efficientnet_b0 (no argument sizes its blocks) and a plain torch model, with the defaults: the final
    soup is the smaller model all the same; hf_sms.load_sparse cuts the model its family (or a template) builds to
    the stored widths, and its plain route (timm's pruned.txt, a torch.export program) is saved beside it."""
    entry = ZOO[name]
    data = _images(16)
    args = sms_config(tmp_path, structure="filters", target_sparsity=0.5, n_phases=1, max_steps=2,
                      per_device_train_batch_size=8)  # fmt: skip
    soup, _ = hf_sms.run_sms(entry.make(), args, data[:8], ClassificationAccuracy(), eval_dataset=data[8:])
    folder = tmp_path / "run" / "final_soup"
    shrunk = json.loads((folder / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert (shrunk["saved"], shrunk["cut"]) == ("smaller", "in place") and shrunk["parameter_ratio"] < 0.5
    template = entry.make() if name == "torchvision_resnet" else None
    loaded = hf_sms.load_sparse(str(folder), model=template)
    x = torch.stack([r["x"] for r in data[:4]])
    torch.testing.assert_close(eval_output(loaded, x), eval_output(soup, x), rtol=1e-4, atol=1e-5)
    card = (folder / "README.md").read_text()  # the plain route (tests/test_plain_routes.py loads it without hf-sms)
    route = {"efficientnet_b0": ("timm", "pruned.txt"), "torchvision_resnet": ("torch.export", "model.pt2")}[name]
    assert shrunk["plain"] == route[0] and (folder / route[1]).is_file()
    assert "No hf-sms needed" in card and route[1] in card
