"""``hf-sms merge`` equals the in-memory uniform soup and refuses bad inputs; ``hf-sms inspect`` reports."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from conftest import make_resnet, make_t5

from hf_sms import apply_masks, compute_masks, load_sparse, save_sparse, uniform_soup
from hf_sms.checkpoint import merge_checkpoints
from hf_sms.cli import main


def _replicas(make, m=3, sparsity=0.8, seed=0):
    base = make()
    masks = compute_masks(base, sparsity, "uniform")
    apply_masks(base, masks)
    torch.manual_seed(seed)
    out = []
    for _ in range(m):
        r = copy.deepcopy(base)
        with torch.no_grad():
            for p in r.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            for b in r.buffers():
                if b.is_floating_point():
                    b.add_(torch.rand_like(b))  # BatchNorm statistics differ between replicas
        out.append(apply_masks(r, masks))
    return out


def _save_all(models, root, formats):
    return [
        save_sparse(m, str(root / f"r{i}"), fmt, recipe={"varied": "seed"})
        for i, (m, fmt) in enumerate(zip(models, formats))
    ]


def _assert_equal(soup, loaded):
    a, b = soup.state_dict(), loaded.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("out_format", ["bitmask", "dense"])
@pytest.mark.parametrize("make", [make_resnet, make_t5], ids=["resnet", "t5"])
def test_merge_equals_the_in_memory_uniform_soup(tmp_path, make, out_format):
    models = _replicas(make)
    dirs = _save_all(models, tmp_path, ["bitmask", "dense", "bitmask"])  # mixed input formats
    out = str(tmp_path / "soup")
    assert main(["merge", *dirs, "--method", "uniform", "--output", out, "--format", out_format]) == 0
    merged = load_sparse(out)
    _assert_equal(uniform_soup(models), merged)
    info = json.loads(open(os.path.join(out, "sparsity.json")).read())
    assert info["format"] == out_format and info["recipe"]["m"] == 3 and info["recipe"]["merge_method"] == "uniform"
    assert info["recipe"]["varied"] == "seed"  # input 0's recipe is kept
    assert info["mask_hash"] == json.loads(open(os.path.join(dirs[0], "sparsity.json")).read())["mask_hash"]


def test_chunked_dense_merge_is_exact(tmp_path, monkeypatch):
    monkeypatch.setattr("hf_sms.checkpoint.merge.CHUNK", 7)  # chunk edges everywhere
    models = _replicas(make_t5)
    dirs = _save_all(models, tmp_path, ["dense", "bitmask", "dense"])
    merge_checkpoints(dirs, str(tmp_path / "soup"), format="bitmask")
    _assert_equal(uniform_soup(models), load_sparse(str(tmp_path / "soup")))


def test_merge_hands_a_methods_combine_whole_tensors_and_keeps_the_mask(tmp_path, monkeypatch):
    from hf_sms import SOUPS
    from hf_sms.pruning.masks import masks_from_model
    from hf_sms.soup import SoupMethod, indicator_weights
    from hf_sms.soup.soup import soup

    def rescaled_max(tensors, weights, context):
        """Per tensor: the elementwise max, plus the tensor's mean (a per-tensor statistic, nonzero at zeros)."""
        stacked = torch.stack(tensors)
        return stacked.max(0).values + stacked.mean()

    everyone = SoupMethod(lambda s, t, c: indicator_weights(range(len(s)), len(s)), combine=rescaled_max)
    SOUPS.add("rescaled_max", everyone)
    models = _replicas(make_resnet)
    dirs = _save_all(models, tmp_path, ["bitmask", "dense", "bitmask"])
    monkeypatch.setattr("hf_sms.checkpoint.merge.CHUNK", 7)  # chunks would change a per-tensor statistic
    try:
        merge_checkpoints(dirs, str(tmp_path / "soup"), method="rescaled_max")
        merged, expected = load_sparse(str(tmp_path / "soup")), soup(models, "rescaled_max")[0]
    finally:
        SOUPS.remove("rescaled_max")
    for (name, a), b in zip(expected.state_dict().items(), merged.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    for name, mask in masks_from_model(models[0]).items():  # the shared mask, although the combine fills zeros
        assert torch.equal(masks_from_model(merged)[name], mask) and torch.equal(masks_from_model(expected)[name], mask)


def test_merge_of_bitmask_inputs_keeps_the_index_and_loads_with_the_plain_loader(tmp_path):
    import timm

    models = _replicas(make_resnet)
    dirs = _save_all(models, tmp_path, ["bitmask"] * 3)
    out = str(tmp_path / "soup")
    merge_checkpoints(dirs, out, format="dense")
    _assert_equal(uniform_soup(models), timm.create_model(f"local-dir:{out}", pretrained=True))


def test_merge_refuses_different_masks_before_writing(tmp_path, capsys):
    models = _replicas(make_resnet)
    with torch.no_grad():
        w = models[2].fc.weight
        w.view(-1)[(w.view(-1) == 0).nonzero()[0]] = 1.0  # one pruned weight revived
    dirs = _save_all(models, tmp_path, ["bitmask", "bitmask", "dense"])
    out = tmp_path / "soup"
    assert main(["merge", *dirs, "--output", str(out)]) == 2
    assert "different masks" in capsys.readouterr().err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".hf_sms-")]
    # a lying sparsity.json does not help: the data are checked as they are merged
    info = json.loads((tmp_path / "r2" / "sparsity.json").read_text())
    info["per_tensor"]["fc.weight"]["mask_hash"] = json.loads((tmp_path / "r0" / "sparsity.json").read_text())[
        "per_tensor"
    ]["fc.weight"]["mask_hash"]
    (tmp_path / "r2" / "sparsity.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="different masks"):
        merge_checkpoints(dirs, str(out))
    assert not out.exists()


def test_merge_refuses_different_architectures(tmp_path, capsys):
    import timm

    a = _replicas(make_resnet, m=1)[0]
    b = timm.create_model("resnet18", pretrained=False, num_classes=4, layers=(1, 1, 1, 1), channels=(8, 16, 16, 32))
    c = make_t5()
    d = [save_sparse(x, str(tmp_path / n)) for x, n in ((a, "a"), (b, "b"), (c, "c"))]
    assert main(["merge", d[0], d[1], "--output", str(tmp_path / "o")]) == 2
    assert "differ in" in capsys.readouterr().err
    assert main(["merge", d[0], d[2], "--output", str(tmp_path / "o")]) == 2
    assert "different architectures" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_merge_output_rules(tmp_path, capsys):
    dirs = _save_all(_replicas(make_resnet, m=2), tmp_path, ["bitmask"] * 2)
    out = tmp_path / "soup"
    out.mkdir()
    (out / "old.txt").write_text("old")
    assert main(["merge", *dirs, "--output", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "old.txt").exists()
    assert main(["merge", *dirs, "--output", str(out), "--overwrite"]) == 0
    assert not (out / "old.txt").exists() and (out / "sparsity.json").exists()
    with pytest.raises(ValueError, match="greedy_soup"):
        merge_checkpoints(dirs, str(tmp_path / "g"), method="greedy")
    assert main(["merge", *dirs, "--output", str(tmp_path / "g"), "--method", "greedy"]) == 2  # explained
    assert "greedy_soup" in capsys.readouterr().err and not (tmp_path / "g").exists()
    assert main(["merge", dirs[0], str(tmp_path / "nothing"), "--output", str(tmp_path / "x")]) == 2


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_merge_refuses_an_output_among_the_inputs_a_file_or_a_repeated_input(tmp_path, capsys, monkeypatch):
    _save_all(_replicas(make_resnet, m=2), tmp_path, ["bitmask"] * 2)
    (tmp_path / "notes.txt").write_text("not a folder")
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    refused = {
        ("r0", "r1", "--output", "r1", "--overwrite"): ["is input 1", "new folder"],
        ("r0", "r1", "--output", "./r0/"): ["is input 0", "new folder"],
        ("r0", "r1", "--output", ".", "--overwrite"): ["contains input 0", "outside the inputs"],
        ("r0", "r1", "--output", "notes.txt"): ["existing file", "folder path"],
        ("r0", "r1", "--output", "notes.txt", "--overwrite"): ["existing file", "folder path"],
        ("r0", "r0", "--output", "soup"): ["same folder as input 0", "list each checkpoint once"],
        ("r0", "r1", "./r0/", "--output", "soup"): ["input 2 (./r0/) is the same folder as input 0", "once"],
    }
    for argv, messages in refused.items():
        assert main(["merge", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert all(m in err for m in messages), (argv, err)
        assert _tree(tmp_path) == before, argv  # nothing written, nothing replaced, no temporary folder left


def test_inspect_measures_the_weights_and_flags_an_edited_sparsity_json(tmp_path, capsys):
    d = save_sparse(_replicas(make_t5, m=1)[0], str(tmp_path / "t5"))
    path = tmp_path / "t5" / "sparsity.json"
    info = json.loads(path.read_text())
    true = info["sparsity"]
    info["sparsity"] = 0.99
    info["per_tensor"]["shared.weight"]["nnz"] = 1
    path.write_text(json.dumps(info))
    assert main(["inspect", d, "--json"]) == 1  # the record disagrees with the weights: a failing check
    report = json.loads(capsys.readouterr().out)
    assert report["integrity"] == "verified"  # the bytes themselves are intact
    assert report["sparsity"] == pytest.approx(true) and report["sparsity"] < 0.9
    assert report["sparsity_json"] == "mismatch" and report["recorded"]["sparsity"] == 0.99
    assert any(m.startswith("sparsity:") and "0.99" in m for m in report["mismatches"])
    assert any(m.startswith("shared.weight nnz:") for m in report["mismatches"])
    assert main(["inspect", d]) == 1
    text = capsys.readouterr().out
    assert f"sparsity:     {100 * true:.2f}%" in text and "measured" in text
    assert "WARNING" in text and "sparsity.json does not match the stored weights" in text and "0.99" in text


def test_inspect_text_and_json(tmp_path, capsys):
    model = _replicas(make_t5, m=1)[0]
    d = save_sparse(model, str(tmp_path / "t5"), recipe={"m": 3}, metrics={"bleu": 2.0})
    assert main(["inspect", d, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["integrity"] == "verified" and report["manifest"] == "checked"
    assert report["format"] == "bitmask" and report["library"] == "transformers"
    assert report["sparsity"] == pytest.approx(0.8, abs=0.01) and report["recipe"] == {"m": 3}
    assert report["metrics"] == {"bleu": 2.0} and report["weights_bytes"] < report["dense_weights_bytes"]
    assert report["size_on_disk"] >= report["weights_bytes"]
    assert "shared.weight" in report["per_tensor"]
    assert report["sparsity_json"] == "matches" and report["mismatches"] == []
    assert "T5ForConditionalGeneration.from_pretrained" in report["how_to_load"]
    assert main(["inspect", d]) == 0
    text = capsys.readouterr().out
    assert "format:       bitmask" in text and "shared.weight" in text and "80." in text and "WARNING" not in text
    # a plain transformers folder without sparsity.json is measured
    plain = str(tmp_path / "plain")
    model.save_pretrained(plain)
    assert main(["inspect", plain, "--json"]) == 0
    plain_report = json.loads(capsys.readouterr().out)
    assert plain_report["sparsity"] == pytest.approx(report["sparsity"]) and plain_report["sparsity_json"] == "missing"
    assert main(["inspect", str(tmp_path / "missing")]) == 2


def test_every_folder_carries_its_card_and_convert_gives_a_copy_that_needs_no_hf_sms(tmp_path):
    import subprocess
    import sys

    model = make_t5()
    apply_masks(model, compute_masks(model, 0.5))
    folder = save_sparse(model, str(tmp_path / "soup"))
    card = (tmp_path / "soup" / "README.md").read_text()
    assert "**Loading needs hf-sms**" in card and "hf-sms convert DIR --output DENSE_DIR --format dense" in card
    assert card.index("Loading needs hf-sms") < card.index("## Sparsity")  # in its first lines
    (tmp_path / "soup" / "tokenizer_config.json").write_text("{}")
    assert main(["convert", folder, "--output", str(tmp_path / "plain")]) == 0
    assert "**No hf-sms needed**" in (tmp_path / "plain" / "README.md").read_text()
    assert (tmp_path / "plain" / "tokenizer_config.json").is_file()
    assert main(["convert", folder, "--output", str(tmp_path / "plain")]) == 2  # not over a folder without asking
    code = (
        "import sys, transformers\n"
        f"m = transformers.T5ForConditionalGeneration.from_pretrained({str(tmp_path / 'plain')!r})\n"
        "assert 'hf_sms' not in sys.modules\nprint(sum(int((p == 0).sum()) for p in m.parameters()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 0  # the pruned weights, as zeros
    # a card the user wrote is never replaced by a later save into the folder
    (tmp_path / "soup" / "README.md").write_text("# mine\n")
    save_sparse(model, folder)
    assert (tmp_path / "soup" / "README.md").read_text() == "# mine\n"
    dirs = _save_all(_replicas(make_t5, m=2), tmp_path, ["bitmask"] * 2)
    assert main(["merge", *dirs, "--output", str(tmp_path / "merged")]) == 0
    assert "**Loading needs hf-sms**" in (tmp_path / "merged" / "README.md").read_text()
