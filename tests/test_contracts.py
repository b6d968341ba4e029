"""Contract tests over every registry entry (peft's test-matrix style): a new soup, pruning method, baseline or
model family gets every generic test by being registered, so one that breaks a promise fails at once."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import make_cnn, make_pspnet, make_resnet, make_t5, sms_config

import hf_sms
from hf_sms import apply_masks, compute_masks, load_sparse, run_sms, save_sparse, uniform_soup
from hf_sms.checkpoint import merge_checkpoints
from hf_sms.cli.demo import DigitsResNet
from hf_sms.data import load_digits_splits
from hf_sms.evaluation import ClassificationAccuracy
from hf_sms.families import FAMILIES, family_of
from hf_sms.methods.common import MethodContext
from hf_sms.pruning import masks_from_model
from hf_sms.soup import soup
from hf_sms.soup.learned import FitData

FAMILY_MODELS = {
    "transformers": make_t5,
    "timm": make_resnet,
    "segmentation_models_pytorch": make_pspnet,
    "torch": make_cnn,
}


@pytest.fixture(scope="module")
def digits():
    train, val, test = load_digits_splits(seed=0)
    return train, val, test


def _replicas(make, m=3, sparsity=0.7):
    base = make()
    masks = compute_masks(base, sparsity, "uniform")
    apply_masks(base, masks)
    out = []
    for i in range(m):
        r = copy.deepcopy(base)
        torch.manual_seed(i)
        with torch.no_grad():
            for p in r.parameters():
                p.add_(torch.randn_like(p) * 0.05 * (i + 1))
        out.append(apply_masks(r, masks))
    return out, masks, base  # base: the pruned start of every replica (model_stock, ties and dare merge from it)


# -- soups ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", hf_sms.SOUPS.names())
def test_every_soup_keeps_the_mask_and_its_promises(name):
    method = hf_sms.SOUPS.get(name)
    replicas, masks, start = _replicas(make_cnn)
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    target = replicas[0](x).detach()

    @torch.no_grad()
    def evaluate(model):  # higher is better: closeness to replica 0's outputs
        return -float((model(x) - target).pow(2).mean())

    scores = [evaluate(r) for r in replicas]
    rows = [{"x": x[i], "labels": target[i]} for i in range(len(x))]  # held-out data for a method that learns
    fit = FitData(rows, 8, torch.utils.data.default_collate, lambda m, b: (m(b["x"]) - b["labels"]).pow(2).mean())
    result, weights = soup(
        replicas,
        name,
        scores=scores,
        evaluate=evaluate,
        sparsity=0.7,
        reprune=lambda m, s: compute_masks(m, s, "uniform"),
        base=start if method.needs_base else None,
        fit=fit if method.fit else None,
    )
    assert len(weights) == len(replicas) and any(weights)
    got = masks_from_model(result)
    if method.same_mask or not method.reprune:  # a weight pruned in every candidate is exactly zero in the soup
        assert all(not (got[n] & ~m).any() for n, m in masks.items()), name
    else:  # re-pruned to the sparsity it was given
        assert hf_sms.sparsity_report(result)["sparsity"] == pytest.approx(0.7, abs=0.02)
    if hf_sms.SOUPS.meta(name).get("never_worse"):
        assert evaluate(result) >= max(scores) - 1e-12, name


# -- model families -----------------------------------------------------------------------------------------------
def test_every_family_has_a_contract_model():
    assert set(FAMILIES) <= set(FAMILY_MODELS), "give a new family a tiny model in FAMILY_MODELS"


@pytest.mark.parametrize("library", sorted(FAMILY_MODELS))
def test_every_family_owns_its_models_widths_and_folders(library):
    """One class per library: it detects its contract model, rebuilds it from its own config at the same shapes
    (on the meta device, as the smaller model's search does), makes a batch the model runs, and names only its own
    knobs; plain torch rebuilds nothing and needs a batch from the caller."""
    from hf_sms.shrinking.fit import tensor_shapes
    from hf_sms.shrinking.shrink import eval_output

    family, model = FAMILIES[library], FAMILY_MODELS[library]()
    assert family_of(model) is family
    with torch.device("meta"):
        built = family.build(model, {})
    if library == "torch":
        assert built is None and family.example(model) is None
        return
    assert tensor_shapes(built) == tensor_shapes(model)
    assert eval_output(model, family.example(model)).isfinite().all()
    assert set(family.values(model)) <= {k.name for k in family.knobs}


@pytest.mark.parametrize("library", sorted(FAMILY_MODELS))
def test_every_family_round_trips_and_merges(tmp_path, library):
    make = FAMILY_MODELS[library]
    replicas, _, _ = _replicas(make, m=2)
    folders = [save_sparse(r, str(tmp_path / f"r{i}")) for i, r in enumerate(replicas)]
    template = make() if library == "torch" else None
    loaded = load_sparse(folders[0], template)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), replicas[0].state_dict().values()))
    merge_checkpoints(folders, str(tmp_path / "soup"))
    merged = load_sparse(str(tmp_path / "soup"), make() if library == "torch" else None)
    expected = uniform_soup(replicas).state_dict()
    assert all(torch.equal(merged.state_dict()[k], v) for k, v in expected.items())


# -- pruning methods and baselines: a tiny end-to-end run each ---------------------------------------------------
class _OnlyTheContext:
    """The loop seen through :class:`MethodContext`: any other attribute is an error, so a method that reaches
    into the runner fails its contract test."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)

    def __getattr__(self, name):
        declared = set(MethodContext.__annotations__) | {n for n in vars(MethodContext) if not n.startswith("_")}
        if name not in declared:
            raise AttributeError(f"a method used ctx.{name}, which MethodContext does not declare")
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"a method set ctx.{name}: methods return their results and record through ctx.recorder")


def _narrowed(monkeypatch, registry, name):
    """Registry entry ``name`` (and its preflight) called with the loop narrowed to :class:`MethodContext`."""
    entry = registry._entries[name]
    meta = {**entry.meta}
    if "preflight" in meta:
        meta["preflight"] = lambda ctx, f=meta["preflight"]: f(_OnlyTheContext(ctx))
    narrowed = dataclasses.replace(entry, obj=lambda ctx: entry.obj(_OnlyTheContext(ctx)), meta=meta)
    monkeypatch.setitem(registry._entries, name, narrowed)


@pytest.mark.parametrize("name", hf_sms.PRUNING_METHODS.names())
def test_every_pruning_method_runs_end_to_end(tmp_path, digits, name, monkeypatch):
    train, val, test = digits
    _narrowed(monkeypatch, hf_sms.PRUNING_METHODS, name)  # a method sees the loop only as MethodContext
    tiny = hf_sms.PRUNING_METHODS.meta(name).get("tiny")
    assert tiny is not None, f"register {name!r} with tiny={{...}}: settings for a seconds-long run"
    args = sms_config(tmp_path, pruning_method=name, num_replicas=2, measure_speedup=False, **tiny)
    soup_model, results = run_sms(DigitsResNet(width=4), args, train, ClassificationAccuracy(), eval_dataset=val)
    assert results["rows"] and (tmp_path / "run" / "final_soup" / "sparsity.json").is_file()
    assert hf_sms.sparsity_report(soup_model)["sparsity"] == pytest.approx(args.target_sparsity, abs=0.02)


@pytest.mark.parametrize("name", hf_sms.PRUNING_METHODS.names())
def test_every_pruning_method_keeps_whole_filters(tmp_path, digits, name):
    """A structure reaches every pruning method: the soup has whole filters removed, the fraction asked."""
    train, val, test = digits
    tiny = {**hf_sms.PRUNING_METHODS.meta(name)["tiny"], "target_sparsity": 0.5}
    args = sms_config(tmp_path, pruning_method=name, num_replicas=2, measure_speedup=False, structure="filters", **tiny)
    soup_model, results = run_sms(DigitsResNet(width=4), args, train, ClassificationAccuracy(), eval_dataset=val)
    batch = torch.stack([val[i]["x"] for i in range(4)])
    assert args.plan.achieved(soup_model, batch) == {"filters": pytest.approx(0.5, abs=0.01)}, name
    assert results["rows"][results["final_row"]][-1]["units"] == {"filters": pytest.approx(0.5, abs=0.01)}


@pytest.mark.parametrize("name", hf_sms.BASELINES.names())
def test_every_baseline_runs_end_to_end(tmp_path, digits, name, monkeypatch):
    train, val, test = digits
    _narrowed(monkeypatch, hf_sms.BASELINES, name)  # a baseline sees the loop only as MethodContext
    args = sms_config(tmp_path, n_phases=2, max_steps=2, baselines=[name], measure_speedup=False)
    _, results = run_sms(DigitsResNet(width=4), args, train, ClassificationAccuracy(), eval_dataset=val)
    assert [r["phase"] for r in results["rows"][name]] == [1, 2]
