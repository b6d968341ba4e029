"""Smaller models their own library loads (issue 37 item 4): pruned at 50% with the default arguments, a model
whose library's config cannot state the widths is cut in place and saved with timm's ``pruned.txt`` or a
``torch.export`` program; one whose config states them is its library's own folder. The card's lines load each in a
process that never imports hf_sms, with the smaller model's outputs."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from zoo import ZOO, _hf, _image, _timm, _tokens

import hf_sms
from hf_sms.checkpoint.family_files import plain_route_lines
from hf_sms.checkpoint.inspect import inspect_checkpoint
from hf_sms.checkpoint.integrity import CorruptionError
from hf_sms.checkpoint.shrink_record import IN_PLACE, SMALLER, ShrinkRecord
from hf_sms.pruning.masks import apply_masks


def _pspnet(seed=0):
    import segmentation_models_pytorch as smp

    torch.manual_seed(seed)
    return smp.PSPNet("resnet18", encoder_weights=None, classes=3)  # smp's own encoder, fixed by its name


CASES = {  # name: (model, batch, structure, the route its folder gets with the default arguments)
    "efficientnet_b0": (ZOO["efficientnet_b0"].make, _image(32), "filters", "timm"),
    "mobilenetv3": (ZOO["mobilenetv3"].make, _image(32), "filters", "timm"),
    "convnext_atto": (ZOO["convnext_atto"].make, _image(32), "filters+neurons", "timm"),
    "regnety": (_timm("regnety_002", num_classes=4), _image(32), "filters", "torch.export"),  # grouped convs
    "bloom": (_hf("BloomForCausalLM", "BloomConfig", vocab_size=64, hidden_size=16, n_layer=2, n_head=2),
              _tokens, "neurons", "torch.export"),
    # the family's own example for a seq2seq model names both inputs: the program takes both
    "bart_heads": (ZOO["bart"].make, lambda: _tokens(decoder_input_ids=_tokens(length=5)["input_ids"]), "heads",
                   "torch.export"),
    "smp_pspnet": (_pspnet, _image(64), "filters", "smp"),  # its config states the decoder: smp loads it
    "smp_pspnet_every_unit": (_pspnet, _image(64), "filters", "torch.export"),  # fit_config=False: the encoder too
    "torchvision_resnet": (ZOO["torchvision_resnet"].make, _image(32), "filters", "torch.export"),
}  # fmt: skip
OWN = {"smp": "import segmentation_models_pytorch as smp\nmodel = smp.from_pretrained({f!r})"}

LOAD = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
out = {}
for name, (folder, code) in json.loads(sys.argv[1]).items():
    scope = {}
    exec(code, scope)
    model, batch = scope["model"], load_file(folder + "/batch.safetensors")
    if hasattr(model, "eval") and not isinstance(model, torch.fx.GraphModule):
        model.eval()
    with torch.no_grad():
        y = model(**batch) if "input_ids" in batch else model(batch["x"])
    y = y if torch.is_tensor(y) else (y["logits"] if isinstance(y, dict) else y.logits)
    out[name] = y.float().contiguous()
assert not any(m == "hf_sms" or m.startswith("hf_sms.") for m in sys.modules), "hf_sms was imported"
save_file(out, sys.argv[2])
"""


def _smaller(name):
    """``name``'s model pruned at 50% and cut with the default arguments (the final soup of a default run)."""
    make, batch, structure, _ = CASES[name]
    model, x = make().eval(), batch()
    every = {"fit_config": False} if name.endswith("every_unit") else {}
    apply_masks(model, hf_sms.compute_masks(model, 0.5, structure=structure, example_inputs=x, **every))
    smaller = hf_sms.shrink(model, x, structure=structure, **every)
    assert hf_sms.shrinking.parameter_count(smaller) < hf_sms.shrinking.parameter_count(model), name
    return smaller, x


CI = ["efficientnet_b0", "bloom", "smp_pspnet", "torchvision_resnet"]  # each route; the rest with -m slow


@pytest.mark.parametrize("names", [CI, pytest.param([n for n in CASES if n not in CI], marks=pytest.mark.slow)])
def test_smaller_models_load_without_hf_sms(tmp_path, names):
    jobs, expected = {}, {}
    for name in names:
        route = CASES[name][-1]
        smaller, x = _smaller(name)
        folder = tmp_path / name
        # no record passed: found by its shapes against its config; a plain torch model has none, a run records it
        # the defaults (issue 49 item 8): the format and the example batch (of one) the family makes; a plain torch
        # model makes none, so it is given the batch
        torch_model = "torchvision" in name
        recipe = {"shrunk": ShrinkRecord(SMALLER, cut=IN_PLACE).to_json()} if torch_model else None
        hf_sms.save_sparse(smaller, str(folder), recipe=recipe, example_inputs=x if torch_model else None)
        recipe = json.loads((folder / "sparsity.json").read_text()).get("recipe") or {}
        card = (folder / "README.md").read_text()
        assert "No hf-sms needed" in card, name
        if route in OWN:  # a smaller model its config states: its library's own folder
            assert "shrunk" not in recipe and not (folder / "model.pt2").exists(), name
            jobs[name] = (str(folder), OWN[route].format(f=str(folder)))
        else:
            assert (recipe["shrunk"]["cut"], recipe["shrunk"].get("plain")) == ("in place", route), name
            route_file = "pruned.txt" if route == "timm" else "model.pt2"
            assert route_file in card and route_file in json.loads((folder / "sparsity.json").read_text())["files"]
            jobs[name] = (str(folder), "\n".join(plain_route_lines(route, str(folder), hub=False)))
        save_file({"x": x} if torch.is_tensor(x) else x, str(folder / "batch.safetensors"))
        with torch.no_grad():
            y = smaller(x) if torch.is_tensor(x) else smaller(**x).logits
        expected[name] = y.float()
        loaded = hf_sms.load_sparse(str(folder), model=ZOO["torchvision_resnet"].make() if "torchvision" in name
                                    else None)  # fmt: skip
        with torch.no_grad():  # hf-sms loads it too
            again = loaded(x) if torch.is_tensor(x) else loaded(**x).logits
        torch.testing.assert_close(again, y, rtol=1e-4, atol=1e-5)
    out = tmp_path / "out.safetensors"
    subprocess.run([sys.executable, "-c", LOAD, json.dumps(jobs), str(out)], check=True, timeout=300)
    from safetensors.torch import load_file

    got = load_file(str(out))
    for name, y in expected.items():
        torch.testing.assert_close(got[name], y, rtol=1e-4, atol=1e-5, msg=name)
    timm_folder = tmp_path / next(n for n in names if CASES[n][-1] == "timm")
    widths = timm_folder / "pruned.txt"  # the card tells users to run it: the manifest covers it
    widths.write_text(widths.read_text().replace("[", "[1", 1))
    with pytest.raises(CorruptionError, match="pruned.txt"):
        inspect_checkpoint(str(timm_folder))


def test_an_exported_program_takes_other_batch_sizes_and_lengths(tmp_path):
    smaller, x = _smaller("bloom")
    hf_sms.save_sparse(smaller, str(tmp_path), "dense", example_inputs=x)
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    for ids in (x["input_ids"][:1], torch.randint(2, 64, (3, 11))):
        with torch.no_grad():
            torch.testing.assert_close(program(input_ids=ids)["logits"], smaller(input_ids=ids).logits)


def test_a_model_its_config_states_gets_no_plain_route(tmp_path):
    """A dense model, and a smaller one its own config states, load with their library as they are: no extra file."""
    model = ZOO["efficientnet_b0"].make()
    hf_sms.save_sparse(model, str(tmp_path / "dense"), "dense")
    assert sorted(p.name for p in (tmp_path / "dense").iterdir()) == [
        "README.md", "config.json", "model.safetensors", "sparsity.json"]  # fmt: skip
    info = json.loads((tmp_path / "dense" / "sparsity.json").read_text())
    assert "shrunk" not in (info.get("recipe") or {})


@pytest.mark.parametrize("fmt", ["bitmask"])
def test_resaving_drops_a_stale_route(tmp_path, fmt):
    smaller, x = _smaller("efficientnet_b0")
    hf_sms.save_sparse(smaller, str(tmp_path), "dense", example_inputs=x)
    assert (tmp_path / "pruned.txt").is_file()
    hf_sms.save_sparse(ZOO["efficientnet_b0"].make(), str(tmp_path), fmt)  # the dense model over it
    assert not (tmp_path / "pruned.txt").exists() and not (tmp_path / "model.pt2").exists()
