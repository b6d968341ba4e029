"""The sparse inference runtime: same outputs as the masked dense model for every family, per-layer decisions,
inference only, and clear errors for what it cannot do."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_pspnet, make_resnet, make_t5
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_sms import apply_masks, compute_masks, to_sparse_runtime
from hf_sms.runtime import SparseConv2d, SparseLinear
from hf_sms.runtime.speed import format_measured

ATOL = 1e-5  # fp32: the sparse product sums the same terms in another order


def _pruned(model: nn.Module, sparsity: float = 0.9) -> nn.Module:
    # every prunable layer, a causal LM's embeddings too (its default leaves them dense): the runtime takes them all
    apply_masks(model, compute_masks(model, sparsity, "uniform", prune_modules=".*"))
    return model.eval()


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=384, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1)
    return GPT2LMHeadModel(config)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=ATOL * max(1.0, float(b.detach().abs().max())))


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


IDS = torch.randint(2, 384, (2, 12), generator=torch.Generator().manual_seed(0))
CASES = {  # name: (model factory, sample input)
    "mlp": (_mlp, torch.randn(8, 64)),
    "timm": (make_resnet, torch.randn(2, 3, 32, 32)),
    "smp": (make_pspnet, torch.randn(2, 3, 32, 32)),
    "t5": (make_t5, {"input_ids": IDS, "decoder_input_ids": IDS[:, :6]}),
    "gpt2": (_gpt2, {"input_ids": IDS}),
}


def _run(model, sample):
    return _logits(model(**sample) if isinstance(sample, dict) else model(sample))


@pytest.mark.parametrize("layout", ["csr", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_runtime_equals_the_masked_dense_model(case, layout):
    make, sample = CASES[case]
    dense = _pruned(make())
    runtime = to_sparse_runtime(copy.deepcopy(dense), layout, sample)
    report = runtime.hf_sms_runtime
    if layout == "csr":  # every prunable layer computes sparsely
        assert report.layers and all(c.layout == "csr" for c in report.layers)
        assert any(isinstance(m, (SparseLinear, SparseConv2d)) for m in runtime.modules())
    assert report.dense_ms > 0 and report.runtime_ms > 0  # measured on the sample, both ways
    with torch.inference_mode():
        assert _close(_run(runtime, sample), _run(dense, sample))
    with torch.no_grad():
        assert _close(_run(runtime, sample), _run(dense, sample))
    assert runtime.state_dict().keys() == dense.state_dict().keys()  # saves as the masked dense model
    assert all(torch.equal(runtime.state_dict()[k], v) for k, v in dense.state_dict().items())


def test_generate_gives_the_same_tokens():
    dense = _pruned(make_t5())
    runtime = to_sparse_runtime(copy.deepcopy(dense), "csr", lambda m: m.generate(input_ids=IDS, max_new_tokens=4))
    kwargs = {"input_ids": IDS, "max_new_tokens": 10, "do_sample": False}
    assert torch.equal(runtime.generate(**kwargs), dense.generate(**kwargs))


def test_a_transformers_pipeline_runs_on_the_runtime():
    from transformers import ByT5Tokenizer, pipeline

    dense = _pruned(_gpt2())
    runtime = to_sparse_runtime(copy.deepcopy(dense), "csr", {"input_ids": IDS})
    assert any(isinstance(m, SparseLinear) for m in runtime.modules())  # GPT-2's Conv1D layers
    tokenizer = ByT5Tokenizer()
    outputs = [
        pipeline("text-generation", model=m, tokenizer=tokenizer, device="cpu")(
            "sparse", max_new_tokens=5, do_sample=False
        )[0]["generated_text"]
        for m in (runtime, dense)
    ]
    assert outputs[0] == outputs[1]


def test_auto_keeps_dense_what_does_not_win_and_reports_why(caplog):
    model = _pruned(_mlp())
    with torch.no_grad():
        model[4].weight.copy_(torch.randn_like(model[4].weight))  # the head: dense again
    # margin=inf: no sparse product is "that much faster", so every timed layer falls back to dense
    runtime = to_sparse_runtime(copy.deepcopy(model), "auto", torch.randn(4, 64), margin=float("inf"))
    report = runtime.hf_sms_runtime  # nothing sparse: the runtime is the dense model, not timed against itself
    assert report.speedup == 1.0 and report.dense_ms > 0 and "slower" not in caplog.text
    reasons = {c.name: (c.layout, c.reason) for c in runtime.hf_sms_runtime.layers}
    assert reasons["4"] == ("dense", "sparsity below min_sparsity=0.5")
    assert reasons["0"][0] == "dense" and "faster" in reasons["0"][1]
    assert runtime.hf_sms_runtime.layers[0].dense_ms is not None and runtime.hf_sms_runtime.layers[0].sparse_ms
    assert not any(isinstance(m, SparseLinear) for m in runtime.modules())
    # a layer the sample never reaches stays dense under auto
    branchy = nn.ModuleDict({"used": nn.Linear(1024, 1024), "unused": nn.Linear(64, 256)})
    _pruned(branchy, 0.98)  # so sparse wins clearly on "used"
    to_sparse_runtime(branchy, "auto", lambda m: m["used"](torch.randn(16, 1024)))
    layouts = {c.name: (c.layout, c.reason) for c in branchy.hf_sms_runtime.layers}
    assert layouts["unused"] == ("dense", "not called by the sample input") and layouts["used"][0] == "csr"
    assert isinstance(branchy["used"], SparseLinear) and isinstance(branchy["unused"], nn.Linear)


def test_inference_only():
    runtime = to_sparse_runtime(_pruned(_mlp()), "csr")
    with pytest.raises(RuntimeError, match="inference only"):
        runtime.train()
    x = torch.randn(2, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="train the masked dense model"):
        runtime(x)
    assert not any(p.requires_grad for p in runtime.parameters())
    runtime(torch.randn(2, 64))  # plain calls work without no_grad
    runtime.eval()


def test_bad_input_gets_clear_errors():
    with pytest.warns(UserWarning, match="unchanged"):
        dense = _mlp()
        assert to_sparse_runtime(dense, "csr") is dense and isinstance(dense[0], nn.Linear)
    with pytest.raises(ValueError, match="sample_input"):
        to_sparse_runtime(_pruned(_mlp()), "auto")
    with pytest.raises(ValueError, match="layout must be one of"):
        to_sparse_runtime(_pruned(_mlp()), "coo")
    with pytest.raises(ValueError, match=r"no cpu kernel for torch.bfloat16.*model.float\(\)"):
        to_sparse_runtime(_pruned(_mlp()).to(torch.bfloat16), "csr")
    with pytest.warns(UserWarning, match="unchanged"):  # auto: a dtype without a kernel does not win; it says why
        kept = to_sparse_runtime(_pruned(_mlp()).to(torch.bfloat16), "auto", torch.randn(4, 64).bfloat16())
    assert {c.reason for c in kept.hf_sms_runtime.layers} >= {"no csr kernel for bfloat16 on cpu"}
    with pytest.raises(ValueError, match="CUDA GPU of compute capability >= 8.0"):
        to_sparse_runtime(_pruned(_mlp()), "semi_structured")
    assert to_sparse_runtime(_pruned(_mlp()), "dense")[0].__class__ is nn.Linear


def test_is_two_four_tells_two_four_masks():  # the refusal itself needs a CUDA GPU: benchmarks/gpu_check.sh
    from hf_sms.runtime.layers import is_two_four

    w = torch.tensor([[1.0, 2.0, 0.0, 0.0, 0.0, 3.0, 4.0, 0.0]])
    assert is_two_four(w) and not is_two_four(torch.tensor([[1.0, 2.0, 3.0, 0.0]]))


def test_state_dict_round_trips_into_the_runtime():
    dense, other = _pruned(_mlp(0)), _pruned(_mlp(1))
    runtime = to_sparse_runtime(copy.deepcopy(dense), "csr")
    runtime.load_state_dict(other.state_dict())
    x = torch.randn(3, 64)
    assert _close(runtime(x), other(x))


# -- loading straight into the runtime ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_load_sparse_builds_the_runtime_from_stored_positions(tmp_path, case, monkeypatch):
    from hf_sms import load_sparse, save_sparse
    from hf_sms.checkpoint import SparseCheckpoint, index_format

    make, sample = CASES[case]
    dense = _pruned(make())
    save_sparse(dense, str(tmp_path / "ckpt"))
    read_dense = []
    original = SparseCheckpoint.read
    monkeypatch.setattr(SparseCheckpoint, "read", lambda self, name: read_dense.append(name) or original(self, name))
    template = _mlp(seed=5) if case == "mlp" else None  # plain torch needs a template
    with monkeypatch.context() as patch:  # indices decoded in many chunks; masks verified against the hash
        patch.setattr(index_format, "CHUNK_BITS", 64)
        runtime = load_sparse(str(tmp_path / "ckpt"), template, runtime="csr")
    sparse = {n: m for n, m in runtime.named_modules() if isinstance(m, (SparseLinear, SparseConv2d))}
    assert sparse and not [n for n in read_dense if n.removesuffix(".weight") in sparse]  # never read dense
    for name, module in sparse.items():  # each holds exactly the stored nonzeros, as CSR
        assert module.weight.layout == torch.sparse_csr
        stored = dict(dense.named_modules())[name].weight
        assert module.weight.values().numel() == int((stored != 0).sum())
    with torch.no_grad():
        assert _close(_run(runtime, sample), _run(dense, sample))
    auto = load_sparse(
        str(tmp_path / "ckpt"), _mlp(seed=5) if case == "mlp" else None, runtime="auto", sample_input=sample
    )
    with torch.no_grad():
        assert _close(_run(auto, sample), _run(dense, sample))
    timed = [c for c in auto.hf_sms_runtime.layers if c.dense_ms is not None]
    assert timed and all(c.sparse_ms is not None for c in timed)  # decided by measurement, layer by layer


def test_a_dense_format_folder_loads_into_the_runtime_too(tmp_path):
    from hf_sms import load_sparse, save_sparse

    dense = _pruned(make_t5())
    save_sparse(dense, str(tmp_path / "ckpt"), "dense")  # no index: the nonzeros are found in the values
    runtime = load_sparse(str(tmp_path / "ckpt"), runtime="csr")
    assert any(isinstance(m, SparseLinear) for m in runtime.modules())
    with torch.no_grad():
        assert _close(_run(runtime, CASES["t5"][1]), _run(dense, CASES["t5"][1]))


def test_load_sparse_into_the_runtime_refuses_what_it_cannot(tmp_path):
    from hf_sms import load_sparse, save_sparse

    save_sparse(_pruned(make_t5()), str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="not a loading layout"):
        load_sparse(str(tmp_path / "ckpt"), runtime="semi_structured")
    with pytest.raises(ValueError, match="sample_input"):
        load_sparse(str(tmp_path / "ckpt"), runtime="auto")
    save_sparse(_pruned(_mlp()), str(tmp_path / "mlp"))
    other = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    with pytest.raises(ValueError, match=r"'0.(weight|bias)' claims shape \(256(, 64)?,?\), but the model's \(128"):
        load_sparse(str(tmp_path / "mlp"), other, runtime="csr")  # a template of another width


def test_a_tied_embedding_and_lm_head_share_one_csr(tmp_path):
    import json

    from hf_sms import load_sparse, save_sparse
    from hf_sms.runtime import SparseEmbedding, weight_bytes

    dense = _pruned(make_t5())
    runtime = to_sparse_runtime(copy.deepcopy(dense), "csr")
    assert isinstance(runtime.shared, SparseEmbedding) and runtime.shared.weight is runtime.lm_head.weight
    assert weight_bytes(runtime) < 0.5 * weight_bytes(dense)  # 90% zeros: values + 32-bit column indices
    save_sparse(dense, str(tmp_path / "ckpt"))
    loaded = load_sparse(str(tmp_path / "ckpt"), runtime="csr")
    assert loaded.shared.weight is loaded.lm_head.weight is loaded.encoder.embed_tokens.weight
    info = json.loads((tmp_path / "ckpt" / "sparsity.json").read_text())
    info["mask_hash"] = "sha256:" + "0" * 64  # metadata from another save: the stored masks disagree
    (tmp_path / "ckpt" / "sparsity.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="do not have the mask recorded"):
        load_sparse(str(tmp_path / "ckpt"), runtime="csr")
    assert load_sparse(str(tmp_path / "ckpt"), runtime="csr", verify=False) is not None


# -- measured speedups in reports ----------------------------------------------------------------------------------
def test_an_sms_run_reports_the_measured_speedup_of_every_soup(tmp_path, capsys):
    import json

    from conftest import sms_config

    from hf_sms import run_sms
    from hf_sms.cli import main
    from hf_sms.cli.demo import DigitsResNet
    from hf_sms.data import load_digits_splits
    from hf_sms.evaluation import ClassificationAccuracy

    train, val, test = load_digits_splits(seed=0)
    args = sms_config(tmp_path, n_phases=2, max_steps=2, baselines=["imp"])
    _, results = run_sms(DigitsResNet(width=8), args, train, ClassificationAccuracy(), eval_dataset=val)
    rows = results["rows"]
    soups = [row["measured_speedup"] for row in rows["sms_uniform"]]  # every phase's soup, timed
    assert all(r["speedup"] > 0 and r["dense_ms"] > 0 and r["threads"] == torch.get_num_threads() for r in soups)
    assert all(r["input"].startswith("x 8x1x8x8") for r in soups)  # one validation batch (per_device_eval_batch_size)
    assert [r["measured_speedup"] for r in rows["best_candidate"]] == soups  # the soup's mask is theirs
    assert [r["measured_speedup"] for r in rows["imp"]] == [None, None]  # baselines: "not measured"
    record = results["measured_speedup"]
    assert record == soups[-1]  # the final soup is the last phase's: timed once
    saved = json.loads((tmp_path / "run" / "results.json").read_text())["measured_speedup"]
    soup = json.loads((tmp_path / "run" / "final_soup" / "sparsity.json").read_text())["metrics"]
    assert saved == record and soup["measured_speedup"] == record and soup["speedup"] > 1
    assert main(["table", str(tmp_path / "run" / "results.json")]) == 0
    out = capsys.readouterr().out
    assert f"measured: {format_measured(record)}" in out  # a plain speedup, or "no reliable speedup" when noisy
    cells = " | ".join(f"{r['speedup']:.2f}x" for r in soups)
    assert "| SMS (uniform): speedup | phase 1 | phase 2 |" in out and f"| measured | {cells} |" in out
    off = run_sms(
        DigitsResNet(width=8), sms_config(tmp_path / "off", n_phases=1, max_steps=2, measure_speedup=False),
        train, ClassificationAccuracy(), eval_dataset=val,
    )[1]  # fmt: skip
    assert "measured_speedup" not in off and off["rows"]["sms_uniform"][0]["measured_speedup"] is None
    assert main(["table", str(tmp_path / "off" / "run" / "results.json")]) == 0
    assert "| measured | not measured |" in capsys.readouterr().out


def test_a_timing_that_fails_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import json

    from conftest import sms_config

    import hf_sms.runtime.speed
    from hf_sms import run_sms
    from hf_sms.cli import main
    from hf_sms.cli.demo import DigitsResNet
    from hf_sms.data import load_digits_splits
    from hf_sms.evaluation import ClassificationAccuracy

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(hf_sms.runtime.speed, "measure_speedup", broken)
    train, val, _ = load_digits_splits(seed=0)
    _, results = run_sms(DigitsResNet(width=4), sms_config(tmp_path, max_steps=2), train, ClassificationAccuracy(),
                         eval_dataset=val)  # fmt: skip
    records = [r["measured_speedup"] for r in results["rows"]["sms_uniform"]]
    assert records == [{"speedup": None, "error": "RuntimeError('no kernel today')"}] * 2
    assert results["measured_speedup"] == records[-1]  # reused, not timed again
    from hf_sms.records.hub import model_card

    assert "not measured (RuntimeError('no kernel today'))" in model_card(str(tmp_path / "run" / "final_soup"))
    assert json.loads((tmp_path / "run" / "results.json").read_text())["measured_speedup"] == records[-1]
    assert main(["table", str(tmp_path / "run" / "results.json")]) == 0
    assert "| measured | not measured | not measured |" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["t5", "timm"])
def test_hf_sms_speed_times_a_saved_soup(tmp_path, capsys, case):
    from hf_sms import save_sparse
    from hf_sms.cli import main

    make, _ = CASES[case]
    save_sparse(_pruned(make()), str(tmp_path / "soup"))
    flags = ["--threads", "1", "--repeats", "3"] + (["--image-size", "32", "--no-memory"] if case == "timm" else [])
    assert main(["speed", str(tmp_path / "soup"), *flags]) == 0
    out = capsys.readouterr().out
    assert "latency:" in out and "ms dense vs" in out and "weights:" in out
    assert ("peak RSS above imports" in out) == (case == "t5")
    save_sparse(_pruned(_mlp()), str(tmp_path / "plain"))
    assert main(["speed", str(tmp_path / "plain")]) == 2  # a plain torch model needs a template: a clear error
    assert "template" in capsys.readouterr().err


@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 12),
    density=st.floats(0.0, 1.0),
    cuts=st.lists(st.integers(0, 144), max_size=4),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=80, deadline=None)
def test_csr_built_from_position_chunks_is_the_dense_matrix_as_csr(rows, cols, density, cuts, seed):
    import numpy as np

    from hf_sms.runtime.csr import CSRBuilder

    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g) * (torch.rand(rows, cols, generator=g) < density)
    positions = torch.nonzero(dense.reshape(-1)).reshape(-1)  # empty rows and an empty matrix included
    builder = CSRBuilder((rows, cols), positions.numel())
    for chunk in np.split(positions.numpy(), sorted(c for c in cuts if c <= positions.numel())):  # rows split too
        builder.add(chunk)
    csr = builder.tensor(dense.reshape(-1)[positions])
    expected = dense.to_sparse_csr()
    assert torch.equal(csr.crow_indices().long(), expected.crow_indices().long())
    assert torch.equal(csr.col_indices().long(), expected.col_indices().long())
    assert torch.equal(csr.to_dense(), dense)


def test_csr_positions_that_break_the_invariants_are_refused():
    import numpy as np

    from hf_sms.runtime.csr import CSRBuilder

    for chunks in ([[3, 2]], [[1, 2], [2]], [[0, 12]], [[-1]], [[0, 1, 2]]):  # order, repeat, range, count
        builder = CSRBuilder((3, 4), 2)
        with pytest.raises(ValueError, match="CSR positions"):
            for chunk in chunks:
                builder.add(np.asarray(chunk, dtype=np.int64))
    builder = CSRBuilder((3, 4), 2)
    builder.add(np.asarray([1], dtype=np.int64))
    with pytest.raises(ValueError, match="positions of 2"):
        builder.tensor(torch.ones(1))  # fewer positions than the matrix holds


def test_a_runtime_model_survives_torch_save_and_load(tmp_path):
    """Issue 30: torch.load of a torch.save'd runtime model failed (its cast guard was a bound method); it loads,
    computes the same and still refuses a cast its sparse layers cannot take."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    apply_masks(model, compute_masks(model, 0.9))
    runtime = to_sparse_runtime(model, "csr", torch.randn(2, 64), min_sparsity=0.0)
    torch.save(runtime, tmp_path / "runtime.pt")
    loaded = torch.load(tmp_path / "runtime.pt", weights_only=False)  # our own file, written just now
    x = torch.randn(3, 64)
    torch.testing.assert_close(loaded(x), runtime(x))
    with pytest.raises(ValueError, match="cannot become torch.bfloat16"):
        loaded.to(torch.bfloat16)
