"""The sparse LLMs users already have (issue 50 item 6): folders in compressed-tensors' sparse-bitmask and
sparse-24-bitmask formats, built here from the format's description (no download), open exactly, convert to hf-sms
folders, and a run starts from them with their mask kept (2:4 stays 2:4)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sms
from hf_sms import SparseSoupConfig, run_sms
from hf_sms.cli import main
from hf_sms.evaluation.metrics import NegativePerplexity
from hf_sms.pruning.masks import apply_masks


def _pruned(structure: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    apply_masks(model, hf_sms.compute_masks(model, 0.5, structure=structure))
    return model


def _compress(weight: torch.Tensor, fmt: str, prefix: str) -> dict[str, torch.Tensor]:
    """What compressed-tensors 0.14's compressors store for one weight (their code, in short)."""
    if fmt == "sparse-24-bitmask":  # two of every four kept, by magnitude
        groups = weight.reshape(-1, 4)
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.abs().topk(2, dim=1).indices, True)
        keep = keep.reshape(weight.shape)
    else:
        keep = weight != 0
    packed = torch.from_numpy(np.packbits(keep.numpy(), axis=-1, bitorder="little"))
    out = {f"{prefix}.compressed": weight[keep], f"{prefix}.bitmask": packed}
    if fmt == "sparse-24-bitmask":
        out[f"{prefix}.compressed"] = out[f"{prefix}.compressed"].reshape(weight.shape[0], weight.shape[1] // 2)
        out[f"{prefix}.shape"] = torch.tensor(list(weight.shape)).reshape(-1, 1)
    else:
        counts = keep.sum(-1)
        out[f"{prefix}.row_offsets"] = counts.cumsum(0) - counts
        out[f"{prefix}.shape"] = torch.tensor(list(weight.shape))
    return out


def _folder(model, path, fmt: str):
    """``model`` saved as llm-compressor wrote such folders: its decoder's linear weights compressed."""
    path.mkdir()
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "sparsity_config": {
            "format": fmt,
            "sparsity_structure": "2:4" if fmt == "sparse-24-bitmask" else "unstructured",
            "targets": ["Linear"],
            "ignore": ["lm_head"],
            "global_sparsity": 0.5,
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, t in model.state_dict().items():
        if "layers" in name and name.endswith("proj.weight"):
            tensors.update(_compress(t, fmt, name.removesuffix(".weight")))
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("fmt,structure", [("sparse-bitmask", "unstructured"), ("sparse-24-bitmask", "2:4")])
def test_a_compressed_tensors_folder_opens_exactly_and_converts(tmp_path, fmt, structure):
    model = _pruned(structure)
    folder = _folder(model, tmp_path / "ct", fmt)
    loaded = hf_sms.load_sparse(str(folder))
    assert type(loaded) is LlamaForCausalLM and not hasattr(loaded.config, "quantization_config")
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())  # every weight, its zeros too
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')  # issue 54 item 4: it was dropped
    assert main(["convert", str(folder), "--output", str(tmp_path / "hf"), "--format", "bitmask"]) == 0
    assert (tmp_path / "hf" / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    again = hf_sms.load_sparse(str(tmp_path / "hf"))
    assert all(torch.equal(v, want[k]) for k, v in again.state_dict().items())
    assert main(["convert", str(folder), "--output", str(tmp_path / "hf")]) == 2  # not empty: --overwrite
    with pytest.raises(ValueError, match="hf_sms.load_sparse"):  # transformers would fill its layers at random
        LlamaForCausalLM.from_pretrained(str(folder))


def test_a_damaged_compressed_weight_is_named(tmp_path):
    model = _pruned("unstructured")
    folder = _folder(model, tmp_path / "ct", "sparse-bitmask")
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.bitmask"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] ^= 1  # one position more or less than the values stored
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj: .* stored values"):
        hf_sms.load_sparse(str(folder))


def test_a_two_four_folder_stays_two_four_through_a_phase_of_mask_lora_replicas(tmp_path):
    folder = _folder(_pruned("2:4"), tmp_path / "ct", "sparse-24-bitmask")
    model = hf_sms.load_sparse(str(folder))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (x := torch.randint(1, 64, (8,), generator=g)), "labels": x.clone()} for _ in range(20)]
    args = SparseSoupConfig(output_dir=str(tmp_path / "run"), structure="2:4", target_sparsity=0.5, n_phases=1,
                            num_replicas=2, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                            report_to="none", use_cpu=True, replica_params="mask_lora", measure_speedup=False,
                            disable_tqdm=True)  # fmt: skip
    before = {n: p.detach() != 0 for n, p in model.named_parameters() if "layers" in n and n.endswith("proj.weight")}
    soup, _ = run_sms(model, args, rows[:12], NegativePerplexity(), eval_dataset=rows[12:16], test_dataset=rows[16:])
    saved = hf_sms.load_sparse(str(tmp_path / "run" / "final_soup"))
    for model_ in (soup, saved):
        params = dict(model_.named_parameters())
        for name, kept in before.items():
            now = params[name] != 0
            assert torch.equal(now, kept), name  # the very mask it arrived with
            assert bool((now.reshape(-1, 4).sum(-1) <= 2).all())


def _edited(folder, edit):
    """``folder``'s weights with ``edit(tensors)`` applied, written back."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_damaged_or_foreign_compressed_folders_say_what_is_wrong(tmp_path, capsys):
    """Issue 54 item 4: a float16 layer in a float32 folder loaded a mixed-dtype model that failed at its first
    forward; int8 values, a crafted config.json, a NaN in a shape and a truncated file gave raw errors."""
    model = _pruned("unstructured")
    name = "model.layers.0.mlp.up_proj"

    def fresh(tag):
        return _folder(model, tmp_path / tag, "sparse-bitmask")

    folder = fresh("fp16")
    _edited(folder, lambda t: t.__setitem__(f"{name}.compressed", t[f"{name}.compressed"].half()))
    loaded = hf_sms.load_sparse(str(folder))
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    loaded(torch.randint(1, 64, (1, 5)))  # the first forward runs
    torch.testing.assert_close(
        loaded.state_dict()[f"{name}.weight"], model.state_dict()[f"{name}.weight"].half().float()
    )

    folder = fresh("int8")
    _edited(folder, lambda t: t.__setitem__(f"{name}.compressed", t[f"{name}.compressed"].to(torch.int8)))
    with pytest.raises(ValueError, match="not a floating-point weight: a quantized folder"):
        hf_sms.load_sparse(str(folder))

    folder = fresh("nan")
    _edited(folder, lambda t: t.__setitem__(f"{name}.shape", torch.tensor([float("nan"), 32.0])))
    with pytest.raises(ValueError, match="stored shape .* is not whole numbers"):
        hf_sms.load_sparse(str(folder))

    for architectures in (["AutoModelForCausalLM"], ["pipeline"]):
        folder = fresh("arch" + architectures[0])
        config = json.loads((folder / "config.json").read_text())
        config["architectures"] = architectures
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="names no transformers model class"):
            hf_sms.load_sparse(str(folder))

    folder = fresh("truncated")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        hf_sms.load_sparse(str(folder))
    assert main(["convert", str(folder), "--output", str(tmp_path / "out")]) != 0  # a message, no traceback
    err = capsys.readouterr().err
    assert "model.safetensors is not a readable safetensors file" in err and "Traceback" not in err
