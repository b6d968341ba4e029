"""Sparse checkpoints: exact round trips for transformers, timm and smp in both formats, loud failures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_cnn, make_resnet, make_t5
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import hf_sms
from hf_sms import apply_masks, compute_masks, load_sparse, save_sparse, sparsity_report
from hf_sms.pruning import masks_from_model
from hf_sms.sparse_format import (
    BITMASK,
    DENSE,
    ELIAS_FANO,
    INDEX_SUFFIX,
    SparseCheckpoint,
    decode_tensor,
    encode_tensor,
    index_info,
    index_mask,
)

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern with -0.0 folded into +0.0 (pruned weights load as +0.0)."""
    return (t + 0.0).view(_INT[t.dtype])


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module, strip: str = "") -> None:
    sa, sb = a.state_dict(), {k.removeprefix(strip): v for k, v in b.state_dict().items()}
    assert set(sa) == set(sb)
    for k, v in sa.items():
        assert sb[k].dtype == v.dtype and torch.equal(sb[k], v), k
        if v.dtype in _INT:
            assert torch.equal(_bits(sb[k]), _bits(v)), k
    ma, mb = masks_from_model(a), masks_from_model(b)
    assert set(ma) == {k.removeprefix(strip) for k in mb} or strip
    for k, m in ma.items():
        assert torch.equal(mb.get(k, mb.get(strip + k)), m), k


# -- codec ---------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 48), min_size=1, max_size=3),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.5, 0.9, 1.0]) | st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    codec=st.sampled_from([None, DENSE, BITMASK, ELIAS_FANO]),
    rows=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_encode_decode_is_exact(shape, density, dtype, codec, rows, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype)
    keep = torch.rand(shape, generator=g) < density
    if rows and len(shape) > 1:  # structured: whole rows pruned
        keep &= torch.rand(shape[0], *[1] * (len(shape) - 1), generator=g) < 0.5
    t = t * keep  # leaves -0.0 where negative weights were pruned
    if t.numel() > 3:
        t.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -1e-30]).to(dtype)
    values, index = encode_tensor(t, codec)
    assert index.dtype == torch.uint8 and values.dtype == dtype and values.dim() == 1
    out = decode_tensor(values, index)
    assert out.shape == t.shape and out.dtype == dtype
    assert torch.equal(_bits(out), _bits(t))
    mask = index_mask(index)
    assert mask is None or torch.equal(mask, t != 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparsity", [0.9, 0.98])
def test_the_chosen_code_is_near_the_entropy_bound(sparsity, dtype):
    g = torch.Generator().manual_seed(0)
    n = 400_000
    t = (torch.randn(n, generator=g) * (torch.rand(n, generator=g) >= sparsity)).to(dtype)
    values, index = encode_tensor(t.reshape(800, 500))
    s = 1 - values.numel() / n
    index_bound = n * -(s * math.log2(s) + (1 - s) * math.log2(1 - s)) / 8
    assert index_info(index)["codec"] == "elias-fano"
    assert index.numel() < 1.15 * index_bound + 100  # a plain bitmask would be 2.1x (90%) to 7x (98%)
    stored = values.numel() * values.element_size()
    assert stored + index.numel() < 1.05 * (stored + index_bound)


def test_corrupted_index_or_values_raise_value_error():
    t = torch.randn(64, 64) * (torch.rand(64, 64) > 0.9)
    values, index = encode_tensor(t)
    flipped = index.clone()
    flipped[-1] ^= 0xFF
    with pytest.raises(ValueError, match="checksum|corrupted"):
        decode_tensor(values, flipped)
    with pytest.raises(ValueError, match="payload|truncated"):
        decode_tensor(values, index[:-3])
    with pytest.raises(ValueError, match="stored values"):
        decode_tensor(values[:-1], index)
    bad_values = values.clone()
    bad_values[0] += 1
    with pytest.raises(ValueError, match="checksum"):
        decode_tensor(bad_values, index)
    with pytest.raises(ValueError, match="header"):
        decode_tensor(values, torch.zeros(40, dtype=torch.uint8))


# -- round trips per family ----------------------------------------------------------------------
def _pruned(model, sparsity=0.8, allocation="uniform"):
    apply_masks(model, compute_masks(model, sparsity, allocation))
    return model.eval()


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
def test_t5_round_trip_with_from_pretrained(tmp_path, fmt, byt5_tokenizer):
    from transformers import AutoModelForSeq2SeqLM, ByT5Tokenizer

    model = _pruned(make_t5())
    recipe = {"phases": [{"phase": 1, "sparsity": 0.8}], "m": 3, "varied": "seed", "merge_method": "uniform"}
    save_sparse(model, str(tmp_path), fmt, recipe=recipe, metrics={"bleu": 1.5}, processing_class=byt5_tokenizer)
    info = json.loads((tmp_path / "sparsity.json").read_text())
    assert info["format"] == fmt and info["library"] == "transformers" and info["recipe"] == recipe
    assert info["metrics"] == {"bleu": 1.5} and info["architecture"] == "T5ForConditionalGeneration"
    assert info["sparsity"] == pytest.approx(sparsity_report(model)["sparsity"])
    assert isinstance(ByT5Tokenizer.from_pretrained(str(tmp_path)), ByT5Tokenizer)

    for loaded in (AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path)), load_sparse(str(tmp_path))):
        _assert_same_state(model, loaded)
        assert loaded.lm_head.weight is loaded.shared.weight  # the tie survives
        assert getattr(loaded.config, "quantization_config", None) is None
        assert not getattr(loaded, "is_quantized", False) and getattr(loaded, "hf_quantizer", None) is None
        ids = torch.tensor([[5, 6, 7, 1]])
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, labels=ids).logits, loaded(input_ids=ids, labels=ids).logits)
    if fmt == "bitmask":
        sd = load_file(str(tmp_path / "model.safetensors"))
        assert "lm_head.weight" not in sd and "shared.weight" + INDEX_SUFFIX in sd
        assert sum(v.numel() * v.element_size() for v in sd.values()) < 0.5 * sum(
            v.numel() * v.element_size() for v in model.state_dict().values() if v.data_ptr() != 0
        )


def test_bitmask_from_pretrained_keeps_the_requested_dtype_and_loads_submodels(tmp_path):
    from transformers import AutoModelForSeq2SeqLM, T5EncoderModel

    model = _pruned(make_t5())
    save_sparse(model, str(tmp_path))
    loaded = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert torch.equal(loaded.shared.weight, model.shared.weight.to(torch.bfloat16))
    encoder, full = T5EncoderModel.from_pretrained(str(tmp_path)), model.state_dict()
    assert all(torch.equal(v, full[k]) for k, v in encoder.state_dict().items())


def _maxvit():
    import timm

    torch.manual_seed(0)
    return timm.create_model(
        "maxvit_rmlp_nano_rw_256",
        pretrained=False,
        img_size=32,
        num_classes=3,
        embed_dim=(8, 8, 8, 8),
        depths=(1, 1, 1, 1),
        stem_width=8,
        transformer_dim_head=4,
    )


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
@pytest.mark.parametrize("make", [make_resnet, _maxvit], ids=["resnet", "maxvit"])
def test_timm_round_trip(tmp_path, fmt, make):
    import timm
    from transformers import AutoModelForImageClassification

    model = _pruned(make())
    save_sparse(model, str(tmp_path), fmt)
    x = torch.randn(2, 3, 32, 32)
    loaded = load_sparse(str(tmp_path))
    _assert_same_state(model, loaded)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    if fmt == "dense":
        _assert_same_state(model, timm.create_model(f"local-dir:{tmp_path}", pretrained=True))
    # transformers maps the timm folder to TimmWrapper; the config must suit both (no model_args.num_classes)
    wrapped = AutoModelForImageClassification.from_pretrained(str(tmp_path))
    _assert_same_state(model, wrapped.timm_model)


def _pspnet():
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    return smp.PSPNet(encoder_name="resnet18", encoder_weights=None, encoder_depth=3, classes=2, psp_out_channels=16)


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
def test_smp_round_trip(tmp_path, fmt):
    import segmentation_models_pytorch as smp

    model = _pruned(_pspnet(), 0.9, "global")
    save_sparse(model, str(tmp_path), fmt)
    loaded = load_sparse(str(tmp_path))
    _assert_same_state(model, loaded)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    if fmt == "dense":
        _assert_same_state(model, smp.from_pretrained(str(tmp_path)))
    else:
        assert os.path.getsize(tmp_path / "model.safetensors") < 0.15 * 4 * sum(p.numel() for p in model.parameters())
        with pytest.raises(RuntimeError):  # smp's own loader refuses a bitmask file loudly
            smp.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
def test_plain_module_loads_into_a_template(tmp_path, fmt):
    model = _pruned(make_cnn(), 0.5, "global")
    model.tied = torch.nn.Linear(8, 16)
    model.tied.weight = model.fc1.weight  # a shared parameter is stored once
    save_sparse(model, str(tmp_path), fmt)
    template = make_cnn(seed=1)
    template.tied = torch.nn.Linear(8, 16)
    template.tied.weight = template.fc1.weight
    loaded = load_sparse(str(tmp_path), model=template)
    assert loaded is template and loaded.tied.weight is loaded.fc1.weight
    _assert_same_state(model, loaded)
    with pytest.raises(ValueError, match="template"):
        load_sparse(str(tmp_path))


@pytest.mark.slow
def test_plain_loaders_without_hf_sms(tmp_path):
    """Dense folders load with no hf-sms imported; bitmask folders fail loudly instead of loading garbage."""
    for fmt in ("dense", "bitmask"):
        save_sparse(_pruned(make_t5()), str(tmp_path / f"t5-{fmt}"), fmt)
        save_sparse(_pruned(make_resnet()), str(tmp_path / f"timm-{fmt}"), fmt)
    script = f"""
import sys, timm, torch
from transformers import AutoModelForSeq2SeqLM
d = {str(tmp_path)!r}
AutoModelForSeq2SeqLM.from_pretrained(d + "/t5-dense")
timm.create_model("local-dir:" + d + "/timm-dense", pretrained=True)
for load in (lambda: AutoModelForSeq2SeqLM.from_pretrained(d + "/t5-bitmask"),
             lambda: timm.create_model("local-dir:" + d + "/timm-bitmask", pretrained=True)):
    try:
        load()
        sys.exit("a bitmask folder loaded without hf_sms")
    except RuntimeError:
        pass
assert "hf_sms" not in sys.modules
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# -- reliability ---------------------------------------------------------------------------------
@pytest.fixture
def t5_dir(tmp_path):
    save_sparse(_pruned(make_t5()), str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


def _loaders(directory):
    from transformers import AutoModelForSeq2SeqLM

    return [lambda: load_sparse(str(directory)), lambda: AutoModelForSeq2SeqLM.from_pretrained(str(directory))]


def test_truncated_file_raises(t5_dir):
    path = t5_dir / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 10)
    for load in _loaders(t5_dir):
        with pytest.raises(ValueError, match="truncated"):
            load()


def test_corrupted_values_raise(t5_dir):
    path = t5_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x55
    path.write_bytes(bytes(data))
    for load in _loaders(t5_dir):
        with pytest.raises(ValueError, match="checksum|corrupted"):
            load()


def test_missing_tensor_raises_instead_of_random_init(t5_dir):
    path = str(t5_dir / "model.safetensors")
    sd = load_file(path)
    del sd["encoder.final_layer_norm.weight"]
    save_file(sd, path, metadata={"format": "pt"})
    for load in _loaders(t5_dir):
        with pytest.raises(ValueError, match="encoder.final_layer_norm.weight"):
            load()
    sd = load_file(path)
    del sd["shared.weight" + INDEX_SUFFIX]  # values without their index
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mask|shape|does not load"):
        load_sparse(str(t5_dir))


def test_shape_mismatch_and_foreign_directories_raise(tmp_path, t5_dir):
    import transformers

    wider = transformers.T5ForConditionalGeneration(
        make_t5().config.__class__(**{**make_t5().config.to_dict(), "d_ff": 48})
    )
    with pytest.raises(ValueError, match="shape"):
        load_sparse(str(t5_dir), model=wider)
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("hello")
    for d in ("empty", "foreign", "missing"):
        with pytest.raises(ValueError):
            load_sparse(str(tmp_path / d))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "sparsity.json").write_text("{}")
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="safetensors"):
        load_sparse(str(tmp_path / "junk"))


def test_mask_hash_mismatch_is_detected(t5_dir):
    info = json.loads((t5_dir / "sparsity.json").read_text())
    info["mask_hash"] = "sha256:" + "0" * 64
    (t5_dir / "sparsity.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="mask"):
        load_sparse(str(t5_dir))


def test_failed_save_leaves_existing_files_intact(tmp_path, monkeypatch):
    model = _pruned(make_resnet())
    save_sparse(model, str(tmp_path), "dense")
    (tmp_path / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("hf_sms.sparse_format._encode", boom)
    with pytest.raises(OSError):
        save_sparse(model, str(tmp_path), "bitmask")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith(".hf_sms-")]


def test_saving_over_a_folder_replaces_weights_and_keeps_other_files(tmp_path):
    model = _pruned(make_resnet())
    save_sparse(model, str(tmp_path), "bitmask")
    (tmp_path / "notes.txt").write_text("mine")
    save_sparse(model, str(tmp_path), "dense")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert SparseCheckpoint(str(tmp_path)).format == "dense"
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    _assert_same_state(model, load_sparse(str(tmp_path)))


def test_nothing_is_unpickled(t5_dir, monkeypatch):
    from transformers import AutoModelForSeq2SeqLM

    def no_pickle(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_pickle)
    load_sparse(str(t5_dir))
    AutoModelForSeq2SeqLM.from_pretrained(str(t5_dir))


def test_quantizer_is_registered_once():
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    before = AUTO_QUANTIZER_MAPPING["hf-sms-sparse"]
    hf_sms.sparse_format.register_transformers_quantizer()
    assert AUTO_QUANTIZER_MAPPING["hf-sms-sparse"] is before


def test_trainer_final_save_is_a_sparse_checkpoint(make_args, t5_dataset, byt5_tokenizer, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    from hf_sms import SparseSoupConfig, SparseSoupTrainer

    args = make_args(SparseSoupConfig, max_steps=2, target_sparsity=0.8, allocation="uniform")
    trainer = SparseSoupTrainer(make_t5(), args, train_dataset=t5_dataset, processing_class=byt5_tokenizer)
    trainer.train()
    out = str(tmp_path / "final")
    trainer.save_model(out)
    assert SparseCheckpoint(out).format == "bitmask"
    assert json.loads(open(os.path.join(out, "sparsity.json")).read())["sparsity"] == pytest.approx(0.8, abs=0.01)
    _assert_same_state(trainer.model.eval(), AutoModelForSeq2SeqLM.from_pretrained(out))
