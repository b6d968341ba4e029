"""save_sparse / load_sparse: exact round trips for transformers, timm, smp and plain torch in both formats,
loud failures that leave files intact, and the transformers integration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import float_bits, forget_manifest, make_cnn, make_pspnet, make_resnet, make_t5
from safetensors.torch import load_file, save_file

from hf_sms import apply_masks, compute_masks, load_sparse, prunable_tensors, save_sparse, sparsity_report
from hf_sms.checkpoint import INDEX_SUFFIX, SparseCheckpoint, inspect_checkpoint, transformers_integration
from hf_sms.checkpoint.masks import MaskStats
from hf_sms.pruning.masks import masks_from_model


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module, strip: str = "") -> None:
    sa, sb = a.state_dict(), {k.removeprefix(strip): v for k, v in b.state_dict().items()}
    assert set(sa) == set(sb)
    for k, v in sa.items():
        assert sb[k].dtype == v.dtype and torch.equal(sb[k], v), k
        if v.is_floating_point():
            assert torch.equal(float_bits(sb[k]), float_bits(v)), k
    ma, mb = masks_from_model(a), masks_from_model(b)
    assert set(ma) == {k.removeprefix(strip) for k in mb} or strip
    for k, m in ma.items():
        assert torch.equal(mb.get(k, mb.get(strip + k)), m), k


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


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
def test_smp_round_trip(tmp_path, fmt):
    import segmentation_models_pytorch as smp

    model = _pruned(make_pspnet(), 0.9, "global")
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


class _CrossAttention(torch.nn.Module):
    """nn.MultiheadAttention with kdim != embed_dim: separate q/k/v_proj_weight instead of in_proj_weight."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 2, kdim=8, vdim=8, batch_first=True)

    def forward(self, x):
        return self.attn(x, x[..., :8], x[..., :8])[0]


def _transformer_encoder(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _cross_attention(seed=0):
    torch.manual_seed(seed)
    return _CrossAttention()


@pytest.mark.parametrize("make", [_transformer_encoder, _cross_attention], ids=["encoder", "cross-attention"])
def test_attention_projections_are_stored_sparse(tmp_path, make):
    model = _pruned(make(), 0.8, "global")
    prunable = {t.name for t in prunable_tensors(model)}
    assert any(n.endswith(("in_proj_weight", "q_proj_weight")) for n in prunable)
    save_sparse(model, str(tmp_path))
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert {n for n in stored if n.endswith(INDEX_SUFFIX)} == {n + INDEX_SUFFIX for n in prunable}
    info = json.loads((tmp_path / "sparsity.json").read_text())
    assert set(info["per_tensor"]) == prunable
    assert info["sparsity"] == pytest.approx(sparsity_report(model)["sparsity"])
    loaded = load_sparse(str(tmp_path), model=make(seed=1))
    _assert_same_state(model, loaded)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


def test_attention_projections_load_through_from_pretrained(tmp_path):
    from transformers import PretrainedConfig, PreTrainedModel

    class AttentionConfig(PretrainedConfig):
        model_type = "hf-sms-test-attention"

    class AttentionModel(PreTrainedModel):
        config_class = AttentionConfig

        def __init__(self, config):
            super().__init__(config)
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.post_init()

        def _init_weights(self, module):
            pass

    torch.manual_seed(0)
    model = _pruned(AttentionModel(AttentionConfig()), 0.8, "global")
    save_sparse(model, str(tmp_path))
    assert "attn.in_proj_weight" + INDEX_SUFFIX in load_file(str(tmp_path / "model.safetensors"))
    _assert_same_state(model, AttentionModel.from_pretrained(str(tmp_path)))


def test_checkpoints_saved_before_attention_weights_were_eligible_still_verify(tmp_path):
    """Older saves counted only ``*.weight`` tensors in the mask hash; loading checks the tensors they list."""
    model = _pruned(_transformer_encoder(), 0.8, "global")
    save_sparse(model, str(tmp_path), "dense")
    stats = MaskStats()
    for name, t in model.state_dict().items():
        if t.dim() >= 2 and name.rsplit(".", 1)[-1] == "weight":  # the rule hf-sms had before
            stats.add(name, t != 0, "dense")
    info = json.loads((tmp_path / "sparsity.json").read_text())
    (tmp_path / "sparsity.json").write_text(json.dumps({**info, **stats.summary()}))
    _assert_same_state(model, load_sparse(str(tmp_path), model=_transformer_encoder(seed=1)))
    assert inspect_checkpoint(str(tmp_path))["sparsity_json"] == "matches"


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
    for load in _loaders(t5_dir):  # the manifest refuses the rewritten file, naming it
        with pytest.raises(ValueError, match="model.safetensors differs from what sparsity.json records"):
            load()
    forget_manifest(t5_dir)  # a folder saved before the manifest: the loaders' own checks
    for load in _loaders(t5_dir):
        with pytest.raises(ValueError, match="encoder.final_layer_norm.weight"):
            load()
    sd = load_file(path)
    del sd["shared.weight" + INDEX_SUFFIX]  # values without their index
    save_file(sd, path, metadata={"format": "pt"})
    forget_manifest(t5_dir)
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
    folder = tmp_path / "ckpt"  # its parent is this test's own: temporaries of other tests never show
    save_sparse(model, str(folder), "dense")
    (folder / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("hf_sms.checkpoint.codec.encode", boom)
    with pytest.raises(OSError):
        save_sparse(model, str(folder), "bitmask")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf_sms-")]


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
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZER_MAPPING["hf-sms-sparse"] is transformers_integration.SparseCheckpointQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["hf-sms-sparse"] is transformers_integration.SparseCheckpointConfig
    transformers_integration.register()  # a second call changes nothing (transformers would raise)
    assert AUTO_QUANTIZER_MAPPING["hf-sms-sparse"] is transformers_integration.SparseCheckpointQuantizer


def test_plain_transformers_says_how_to_load_a_bitmask_folder_and_older_folders_still_load(t5_dir, tmp_path):
    """Without hf_sms imported, transformers' own warning names the fix; folders written with the short name of the
    quantization method (before the warning said more) still load."""
    import shutil

    from transformers import AutoModelForSeq2SeqLM

    code = (
        "from transformers import AutoModelForSeq2SeqLM\n"
        f"try:\n    AutoModelForSeq2SeqLM.from_pretrained({str(t5_dir)!r})\nexcept Exception:\n    pass"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    said = "Unknown quantization type, got hf-sms-sparse, loaded after `import hf_sms` (pip install hf-sms); never "
    assert said + "with ignore_mismatched_sizes=True (random weights)" in out.stderr + out.stdout
    old = tmp_path / "old"
    shutil.copytree(t5_dir, old)
    config = json.loads((old / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "hf-sms-sparse"
    (old / "config.json").write_text(json.dumps(config))
    model = AutoModelForSeq2SeqLM.from_pretrained(str(old))
    for name, tensor in load_sparse(str(t5_dir)).state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


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


@pytest.mark.parametrize("fmt", ["bitmask", "dense"])
def test_a_model_transformers_saves_under_former_names_loads_into_a_template(tmp_path, fmt):
    """transformers 5 saves ViT under its former names (``encoder.layer.0.attention.attention.query``) and renames
    them as it loads: a template (a replica's start, ``load_sparse(dir, model)``) is loaded the same way."""
    from safetensors import safe_open
    from transformers import ViTConfig, ViTForImageClassification

    def make():
        torch.manual_seed(0)
        shape = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 32}
        return ViTForImageClassification(ViTConfig(image_size=16, patch_size=8, num_labels=3, **shape)).eval()

    model = make()
    apply_masks(model, compute_masks(model, 0.5))
    save_sparse(model, str(tmp_path / "vit"), format=fmt)
    with safe_open(str(tmp_path / "vit" / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert not {k.removesuffix(".sp_index") for k in stored} <= set(model.state_dict())  # the former names
    loaded = load_sparse(str(tmp_path / "vit"), make())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
