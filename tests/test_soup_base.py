"""Soups that see the phase's start (issue 38 item 1): model_stock, ties, dare. Each equals a straightforward
reference on small tensors, keeps the mask exactly (property test, without the masking the soup applies after), and
runs in the loop, in memory and in hf-sms merge with --base; their options are checked before any work."""

import copy
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_resnet, sms_config
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sms import apply_masks, compute_masks, load_sparse, save_sparse
from hf_sms.checkpoint import merge_checkpoints
from hf_sms.cli import main
from hf_sms.pruning.masks import masks_from_model
from hf_sms.registry import SOUPS
from hf_sms.seeding import derive_seed
from hf_sms.soup.method import Tensors
from hf_sms.soup.soup import soup

ROOT = Path(__file__).parent.parent
OPTIONS = {"model_stock": {}, "ties": {"density": 0.2, "scale": 1.0}, "dare": {"density": 0.1}}


# -- references: one entry at a time, as the papers write them ------------------------------------------------
def ref_model_stock(xs, ws, base):
    k = len(xs)
    ups = [[float(x[j]) - float(base[j]) for j in range(len(base))] for x in xs]
    norm = [math.sqrt(sum(v * v for v in u)) for u in ups]
    cos = [sum(a * b for a, b in zip(ups[i], ups[j])) / (norm[i] * norm[j])
           for i, j in itertools.combinations(range(k), 2) if norm[i] and norm[j]]  # fmt: skip
    c = min(max(sum(cos) / len(cos), 0.0), 1.0) if cos else None
    t = 1.0 if c is None else (k * c / (1 + (k - 1) * c) if c > 0 else 0.0)
    return [float(base[j]) + t * sum(w * u[j] for w, u in zip(ws, ups)) for j in range(len(base))]


def _kept(xs, base):
    return [j for j in range(len(base)) if base[j] != 0 or any(x[j] != 0 for x in xs)]


def ref_ties(xs, ws, base, density):
    kept = _kept(xs, base)
    k = round(density * len(kept))
    trimmed = []
    for x in xs:
        u = {j: float(x[j]) - float(base[j]) for j in kept}
        top = set(sorted(kept, key=lambda j: -abs(u[j]))[:k])
        trimmed.append({j: (u[j] if j in top else 0.0) for j in kept})
    out = [float(b) for b in base]
    for j in kept:
        total = sum(w * t[j] for w, t in zip(ws, trimmed))
        sign = (total > 0) - (total < 0)
        agree = [(w, t[j]) for w, t in zip(ws, trimmed) if t[j] != 0 and ((t[j] > 0) - (t[j] < 0)) == sign]
        if agree:
            out[j] += sum(w * v for w, v in agree) / sum(w for w, _ in agree)
    return out


def ref_dare(xs, ws, base, density, seed, name):
    kept = _kept(xs, base)
    out = [float(b) for b in base]
    for i, (x, w) in enumerate(zip(xs, ws)):
        draw = torch.rand(len(kept), generator=torch.Generator().manual_seed(derive_seed(seed, name, i)),
                          dtype=torch.float64).tolist()  # fmt: skip
        survivors = [j for j, r in zip(kept, draw) if r < density]
        for j in survivors:
            out[j] += w * (float(x[j]) - float(base[j])) * len(kept) / len(survivors)
    return out


def _case(seed, m, n=40, sparsity=0.6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=g) >= sparsity
    base = torch.randn(n, generator=g, dtype=torch.float64) * mask
    xs = [(base + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)) * mask for _ in range(m)]
    return mask, base.to(dtype), [x.to(dtype) for x in xs]


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("weights", ["uniform", "skewed"])
def test_each_method_equals_its_reference(m, weights):
    _, base, xs = _case(m, m)
    ws = [1 / m] * m if weights == "uniform" else [w / sum(range(1, m + 1)) for w in range(1, m + 1)]
    context = {k: Tensors("layer.weight", base, o, seed=7) for k, o in OPTIONS.items()}
    got = {k: SOUPS.get(k).combine(xs, ws, context[k]) for k in OPTIONS}
    torch.testing.assert_close(got["model_stock"], torch.tensor(ref_model_stock(xs, ws, base), dtype=torch.float64))
    torch.testing.assert_close(got["ties"], torch.tensor(ref_ties(xs, ws, base, 0.2), dtype=torch.float64))
    ref = ref_dare(xs, ws, base, 0.1, 7, "layer.weight")
    torch.testing.assert_close(got["dare"], torch.tensor(ref, dtype=torch.float64))


def test_model_stock_at_its_edges():
    _, base, xs = _case(0, 3)
    ms = SOUPS.get("model_stock").combine
    same = Tensors("w", base)
    assert torch.equal(ms(xs[:1], [1.0], same), xs[0])  # k = 1: the candidate itself
    assert torch.equal(ms([base, base], [0.5, 0.5], same), base)  # zero updates: the start
    opposite = [base + (xs[0] - base), base - (xs[0] - base)]  # cos = -1: the start, not a blow-up
    assert torch.allclose(ms(opposite, [0.5, 0.5], same), base)
    parallel = [xs[0], xs[0]]  # cos = 1: t = 1, the average
    torch.testing.assert_close(ms(parallel, [0.5, 0.5], same), xs[0])


def test_dare_drops_only_among_kept_entries_and_keeps_their_total():
    """Iterated plain DARE empties a pruned tensor (mergekit#258); the sparsity-adjusted drop keeps the total of a
    constant update exactly and never drops a pruned entry's update, whatever the sparsity."""
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[::20] = True  # 95% sparse
    base = torch.randn(1000, dtype=torch.float64) * mask
    x = base + 1.0 * mask
    out = SOUPS.get("dare").combine([x], [1.0], Tensors("w", base, {"density": 0.3}, seed=1))
    update = out - base
    assert update[~mask].abs().sum() == 0
    assert update.sum().item() == pytest.approx(float(mask.sum()), rel=1e-12)
    assert 0 < int((update != 0).sum()) < int(mask.sum())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    m=st.integers(1, 4),
    sparsity=st.floats(0.0, 0.99),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    density=st.floats(0.01, 1.0),
)
def test_no_pruned_entry_becomes_nonzero(seed, m, sparsity, dtype, density):
    """The combine functions themselves (not the mask the soup applies after them) keep every pruned entry 0."""
    mask, base, xs = _case(seed, m, n=64, sparsity=sparsity, dtype=dtype)
    for name in OPTIONS:
        opts = {k: density if k == "density" else v for k, v in OPTIONS[name].items()}
        out = SOUPS.get(name).combine(xs, [1 / m] * m, Tensors("t", base, opts, seed=seed))
        assert out.dtype == dtype and out[~mask].count_nonzero() == 0, name


def _resnet_replicas(m=3):
    start = make_resnet()
    apply_masks(start, compute_masks(start, 0.8, "uniform"))
    torch.manual_seed(1)
    replicas = []
    for _ in range(m):
        r = copy.deepcopy(start)
        with torch.no_grad():
            for p in r.parameters():
                p.add_(torch.randn_like(p) * 0.05 + 0.02)  # a shared drift: the updates are correlated
        apply_masks(r, masks_from_model(start))
        replicas.append(r)
    return start, replicas


def test_in_memory_soups_keep_the_mask_and_need_their_base():
    start, replicas = _resnet_replicas()
    masks = masks_from_model(start)
    for name in OPTIONS:
        with pytest.raises(ValueError, match="pass base="):
            soup(replicas, name)
        result, weights = soup(replicas, name, base=start, seed=3)
        assert weights == [1 / 3] * 3
        for k, mask in masks_from_model(result).items():
            assert torch.equal(mask, masks[k]), (name, k)
    with pytest.raises(ValueError, match="no option"):
        soup(replicas, "ties", base=start, options={"k": 20})


def test_hf_sms_merge_with_base_equals_the_in_memory_soup(tmp_path, monkeypatch, capsys):
    """The command docs/checkpoints.md gives, as written, on replicas saved in both formats and their start."""
    start, replicas = _resnet_replicas()
    monkeypatch.chdir(tmp_path)
    dirs = [
        save_sparse(r, f"r{i}", fmt) for i, (r, fmt) in enumerate(zip(replicas, ["bitmask", "dense", "bitmask"]), 1)
    ]
    save_sparse(start, "start", "bitmask")
    with pytest.raises(ValueError, match="pass --base"):  # refused before anything is written
        merge_checkpoints(dirs, "soup-ties", "ties")
    with pytest.raises(ValueError, match="drop --base"):
        merge_checkpoints(dirs, "soup-ties", "uniform", base="start")
    with pytest.raises(ValueError, match="same folder"):
        merge_checkpoints(dirs, "soup-ties", "ties", base="r2")
    assert not (tmp_path / "soup-ties").exists()
    command = "hf-sms merge r1 r2 r3 --method ties --base start --option density=0.2 --output soup-ties"
    assert command in (ROOT / "docs" / "checkpoints.md").read_text()
    assert main(command.split()[1:]) == 0
    loaded = load_sparse("soup-ties")
    expected, _ = soup(replicas, "ties", base=start, options={"density": 0.2})
    for k, v in expected.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    recipe = json.loads((tmp_path / "soup-ties" / "sparsity.json").read_text())["recipe"]
    assert recipe["merge_method"] == "ties" and recipe["merge_options"] == {"density": 0.2, "scale": 1.0}
    capsys.readouterr()
    bad = command.replace("density=0.2", "density=lots").replace("soup-ties", "other")
    assert main(bad.split()[1:]) == 2 and "KEY=NUMBER" in capsys.readouterr().err
    dare = "hf-sms merge r1 r2 r3 --method dare --base start --seed 5 --output soup-dare"
    assert main(dare.split()[1:]) == 0
    expected, _ = soup(replicas, "dare", base=start, seed=5)
    assert all(torch.equal(v, load_sparse("soup-dare").state_dict()[k]) for k, v in expected.state_dict().items())


def test_options_are_checked_before_any_training(tmp_path):
    ok = sms_config(tmp_path, merge_methods=["uniform", "ties"], soup_options='{"ties": {"density": 0.5}}')
    assert ok.soup_options == {"ties": {"density": 0.5, "scale": 1.0}}
    assert sms_config(tmp_path, merge_methods=["dare"]).soup_options == {"dare": {"density": 0.1}}
    for options, match in [
        ({"ties": {"density": 0.0}}, r"density.*\(0.0, 1.0\]"),
        ({"ties": {"density": 1.5}}, "density"),
        ({"ties": {"k": 20}}, "no option"),
        ({"dare": {"density": 0.5}}, "does not run"),
        ("{ties: 1}", "must be JSON"),
        ({"ties": 0.5}, "maps a soup method"),
    ]:
        with pytest.raises(ValueError, match=match):
            sms_config(tmp_path, merge_methods=["ties"], soup_options=options)


def test_the_loop_souping_from_its_pruned_start(tmp_path):
    """Every base-aware soup is a trajectory of the loop; its base is the phase's pruned start: model_stock's soup
    lies on the line from that start to the uniform soup, per tensor, and every soup keeps the mask."""
    from hf_sms import SparseModelSoup
    from hf_sms.cli.demo import DigitsResNet
    from hf_sms.data import TensorDictDataset, load_digits_splits
    from hf_sms.evaluation import ClassificationAccuracy

    train, val, test = load_digits_splits(seed=0)
    train = TensorDictDataset(train.x[:128], train.labels[:128])
    methods = ["uniform", "model_stock", "ties", "dare"]
    args = sms_config(tmp_path, n_phases=1, num_replicas=3, max_steps=6, merge_methods=methods,
                      soup_options={"ties": {"density": 0.5}}, recalibrate_bn=False)  # fmt: skip
    torch.manual_seed(0)
    runner = SparseModelSoup(DigitsResNet(width=4), args, train, ClassificationAccuracy(), val, test)
    soups, starts = {}, {}
    run_phase = runner.run_phase

    def spy(spec):
        result = run_phase(spec)
        soups[spec.soup] = {k: v.clone() for k, v in result.soup.state_dict().items()}
        starts[spec.soup] = {k: v.clone() for k, v in spec.start.state_dict().items()}
        return result

    runner.run_phase = spy
    runner.run()
    assert {f"sms_{m}" for m in methods} <= set(runner.results["rows"])
    start, uniform, stock = starts["model_stock"], soups["uniform"], soups["model_stock"]
    for k, s in start.items():
        if not s.is_floating_point() or "running" in k:
            continue
        d_uniform, d_stock = (uniform[k] - s).double(), (stock[k] - s).double()
        if d_uniform.norm() > 0:
            t = float((d_stock * d_uniform).sum() / (d_uniform * d_uniform).sum())
            assert -1e-6 <= t <= 1 + 1e-6 and torch.allclose(d_stock, t * d_uniform, atol=1e-6), k
    for name in methods:
        for k, s in start.items():
            if s.dim() > 1:
                assert soups[name][k][s == 0].count_nonzero() == 0, (name, k)
    assert not torch.equal(soups["ties"]["fc.weight"], uniform["fc.weight"])
