"""Filter-pruned timm and smp convnets cut down to widths their constructor arguments state, so the smaller model
loads with timm / smp alone (``hf_sms.pruning.fit_config``)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import eval_output, make_resnet, without_hf_sms
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hf_sms
from hf_sms import apply_masks, compute_masks, shrink
from hf_sms.pruning.fit_config import fit_filters
from hf_sms.pruning.shrink import parameter_count
from hf_sms.pruning.structured import kept_widths, module_zero_filters, shrink_filters


def make_bottleneck_resnet(seed: int = 0):
    """timm's ResNet-50 layout with one narrow bottleneck block per stage: its width is ``base_width``'s."""
    import timm

    torch.manual_seed(seed)
    return timm.create_model("resnet50", pretrained=False, num_classes=4, layers=(1, 1, 1, 1), channels=(8, 8, 16, 16))


def make_native_pspnet(seed: int = 0):
    """smp's PSPNet on smp's own ResNet-18 encoder: its name fixes the encoder's widths, only the decoder's are free."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(seed)
    return smp.PSPNet(encoder_name="resnet18", encoder_weights=None, encoder_depth=3, classes=2, psp_out_channels=16)


def make_timm_pspnet(seed: int = 0):
    """smp's PSPNet on a timm (``tu-``) encoder: smp passes ``base_width`` on to timm and records it."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(seed)
    return smp.PSPNet(encoder_name="tu-resnet26", encoder_weights=None, encoder_depth=3, classes=2,
                      psp_out_channels=16, layers=(1, 1, 1, 1), channels=(8, 8, 16, 16))  # fmt: skip


MODELS = {  # model, the arguments a 50% filter soup is stated by
    "timm-bottleneck": (make_bottleneck_resnet, {"base_width": 32}),
    "timm-basic": (make_resnet, {"block_reduce_first": 2}),
    "smp-pspnet": (make_native_pspnet, {"psp_out_channels": 8}),
    "smp-pspnet-timm-encoder": (make_timm_pspnet, {"base_width": 32, "psp_out_channels": 8}),
}


def _images(n=2, size=32, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _pruned(make, sparsity=0.5, seed=0):
    model = make(seed).eval()
    apply_masks(model, compute_masks(model, sparsity, structure="filters", criterion="l2"))
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_filter_soup_fits_its_family_arguments_with_equal_outputs(name):
    make, arguments = MODELS[name]
    pruned, x = _pruned(make), _images()
    smaller, chosen = fit_filters(pruned, x)
    assert chosen == arguments
    torch.testing.assert_close(eval_output(smaller, x), eval_output(pruned, x), rtol=1e-4, atol=1e-6)
    assert parameter_count(smaller) < parameter_count(pruned)
    kept = kept_widths(pruned, x)
    for conv, width in kept.items():  # never fewer channels than the soup needs
        assert smaller.get_submodule(conv).out_channels >= width
    if name.startswith("smp"):
        assert {k: smaller._hub_mixin_config[k] for k in arguments} == arguments
    else:
        assert smaller._model_args == {**pruned._model_args, **arguments}


@settings(max_examples=6, deadline=None)
@given(sparsity=st.sampled_from([0.25, 0.4, 0.5, 0.6, 0.75]), seed=st.integers(0, 3))
def test_fitting_keeps_outputs_and_every_needed_channel(sparsity, seed):
    pruned, x = _pruned(make_bottleneck_resnet, sparsity, seed), _images(seed=seed)
    smaller, chosen = fit_filters(pruned, x)
    torch.testing.assert_close(eval_output(smaller, x), eval_output(pruned, x), rtol=1e-4, atol=1e-6)
    kept = kept_widths(pruned, x)
    assert all(smaller.get_submodule(c).out_channels >= w for c, w in kept.items())
    assert set(chosen) <= {"base_width"} and chosen.get("base_width", 64) <= 64


def test_shrink_cuts_every_removable_channel_when_asked_not_to_fit():
    pruned, x = _pruned(make_native_pspnet), _images()
    fitted, free = shrink(pruned, x), shrink(pruned, x, fit_config=False)
    assert parameter_count(free) < parameter_count(fitted) < parameter_count(pruned)
    zeros = sum(int(module_zero_filters(m).sum()) for m in fitted.modules() if isinstance(m, nn.Conv2d))
    assert zeros > 0  # the native ResNet encoder's widths are no argument: its removed filters stay, as zeros
    torch.testing.assert_close(eval_output(free, x), eval_output(pruned, x), rtol=1e-4, atol=1e-6)


def test_widths_outside_what_a_conv_keeps_are_refused():
    pruned, x = _pruned(make_resnet), _images()
    kept = kept_widths(pruned, x)
    conv = next(c for c, w in kept.items() if w < pruned.get_submodule(c).out_channels)
    with pytest.raises(ValueError, match=f"width {kept[conv] - 1} for {conv} is not between"):
        shrink_filters(pruned, x, widths={conv: kept[conv] - 1})


@pytest.mark.parametrize("name", ["timm-bottleneck", "smp-pspnet"])
def test_sms_with_filters_gives_a_plain_smaller_timm_or_smp_model(tmp_path, name, capsys):
    """prune -> SMS -> soup -> shrink -> save -> load in an interpreter that never imports hf_sms, outputs equal;
    ``hf-sms speed`` times it against the dense widths it was cut from."""
    from conftest import sms_config

    from hf_sms.cli import main
    from hf_sms.evaluation import ClassificationAccuracy, MeanIoU

    make, arguments = MODELS[name]
    g, segmentation = torch.Generator().manual_seed(7), name.startswith("smp")
    data = [
        {"x": torch.randn(3, 32, 32, generator=g),
         "labels": torch.randint(0, 2, (32, 32), generator=g) if segmentation else torch.tensor(i % 4)}
        for i in range(24)
    ]  # fmt: skip
    metric = MeanIoU(num_classes=2) if segmentation else ClassificationAccuracy()
    args = sms_config(tmp_path, structure="filters", target_sparsity=0.5, n_phases=1, max_steps=2,
                      per_device_train_batch_size=8)  # fmt: skip
    soup, _ = hf_sms.run_sms(make(), args, data[:16], metric, eval_dataset=data[16:])
    folder = tmp_path / "run" / "final_soup"
    shrunk = json.loads((folder / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert shrunk["saved"] == "smaller" and shrunk["parameter_ratio"] < 1
    assert set(shrunk["dense_config"]) == set(arguments)
    assert shrunk["zero_filters_kept"] > 0  # timm's 64-wide stem, smp's own encoder: no argument states them
    card = (folder / "README.md").read_text()
    assert "**No hf-sms needed**" in card and f"{shrunk['zero_filters_kept']:,} removed filters stay" in card
    assert "saves these FLOPs as it is, on any device, but for the all-zero filters it keeps (above)." in card
    batch = torch.stack([r["x"] for r in data[:4]])
    torch.save({"batch": batch, "expected": eval_output(soup, batch)}, tmp_path / "io.pt")
    load = (
        f"import segmentation_models_pytorch as smp\nm = smp.from_pretrained({str(folder)!r})"
        if segmentation
        else f"import timm\nm = timm.create_model('local-dir:{folder}', pretrained=True)"
    )
    without_hf_sms(f"""import torch
{load}
io = torch.load({str(tmp_path / "io.pt")!r})
with torch.no_grad():
    torch.testing.assert_close(m.eval()(io['batch']), io['expected'], rtol=1e-4, atol=1e-5)
""")
    assert main(["speed", str(folder), "--repeats", "2", "--image-size", "32"]) == 0
    assert "the smaller model vs the dense shapes" in capsys.readouterr().out


@pytest.mark.parametrize("architecture", ["FPN", "DeepLabV3", "Unet"])
def test_smp_architectures_are_followed_through_their_decoders(architecture):
    """fx follows smp's encoders and decoders (resizing, residual adds); concatenations keep their channels."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    model = getattr(smp, architecture)(encoder_name="resnet18", encoder_weights=None, classes=2).eval()
    apply_masks(model, compute_masks(model, 0.5, structure="filters", criterion="l2"))
    x = _images(1, 64)
    with pytest.warns(UserWarning, match="kept .* all-zero filters"):  # what a concatenation or stream keeps
        free = shrink(model, x, fit_config=False)
    fitted = shrink(model, x)
    assert parameter_count(free) < 0.9 * parameter_count(model) and parameter_count(fitted) <= parameter_count(model)
    for smaller in (free, fitted):
        torch.testing.assert_close(eval_output(smaller, x), eval_output(model, x), rtol=1e-4, atol=1e-5)


def test_a_soup_shrink_cannot_cut_is_still_saved_pruned(tmp_path):
    """At the end of a long run a shrink that fails loses nothing: the pruned soup is saved, the recipe says why."""
    from unittest import mock

    from hf_sms.loop.final_soup import save_final_soup

    pruned, x = _pruned(make_resnet), _images()
    folder = str(tmp_path / "soup")
    with mock.patch("hf_sms.loop.final_soup.shrink", side_effect=ValueError("outputs differ")):
        save_final_soup(pruned, folder, dense=make_resnet(), structure="filters", example=x, recipe={})
    shrunk = json.loads((tmp_path / "soup" / "sparsity.json").read_text())["recipe"]["shrunk"]
    assert shrunk["saved"] == "pruned" and "outputs differ" in shrunk["why"]
    loaded = hf_sms.load_sparse(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), pruned.state_dict().values()))


def test_a_unit_run_says_before_training_how_much_smaller_its_soup_will_be(tmp_path, caplog):
    """An hour of training should not end in a pruned model no smaller than the dense one without a word first."""
    from conftest import sms_config

    from hf_sms.evaluation import ClassificationAccuracy

    class Concatenating(nn.Module):  # every conv's channels reach a concatenation: none can be cut
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(11, 4)

        def forward(self, x):
            return self.fc(torch.cat([x, self.conv(x).relu()], 1).mean((2, 3)))

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(3, 8, 8, generator=g), "labels": torch.tensor(i % 4)} for i in range(16)]
    for model, expected in ((Concatenating(), "hardly smaller (about 1.000x"), (make_resnet(), "about 0.")):
        args = sms_config(tmp_path, structure="filters", target_sparsity=0.5, n_phases=1, max_steps=2)
        caplog.clear()
        with caplog.at_level("INFO", logger="hf_sms.loop.checks"):
            hf_sms.SparseModelSoup(model, args, data[:8], ClassificationAccuracy(), eval_dataset=data[8:])
        assert expected in caplog.text, caplog.text
