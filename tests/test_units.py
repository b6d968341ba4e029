"""Units found from the model's graph (docs/method.md §11): every family's filters, neurons and heads, each weight
slice in one unit at most, outputs never pruned, and every unit's removal exact (random graphs included)."""

from __future__ import annotations

import pytest
import torch
from conftest import eval_output, make_cnn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from zoo import ZOO

from hf_sms import apply_masks, compute_masks, shrink
from hf_sms.pruning import removed_units, trace_units
from hf_sms.shrinking import parameter_count

FAST = settings(max_examples=25, deadline=None)


def _no_slice_twice(groups) -> None:
    """No position of any tensor dimension lies in two units (of one group or of two)."""
    seen: dict[tuple[str, int], set[int]] = {}
    for g in groups:
        for m in g.members:
            positions = m.positions.flatten().tolist()
            assert len(set(positions)) == len(positions), f"{g.name}: {m.name} has a position twice"
            taken = seen.setdefault((m.name, m.dim), set())
            assert not taken & set(positions), f"{m.name} dim {m.dim}: in two units"
            taken |= set(positions)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_family_has_its_units_and_each_slice_in_one_unit(name):
    entry = ZOO[name]
    kinds = entry.kinds + entry.every
    groups = trace_units(entry.make(), entry.batch()).groups(kinds)
    assert set().union(*(g.kinds for g in groups)) >= set(kinds), name  # a 1x1-conv MLP is filters and neurons
    _no_slice_twice(groups)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_unit_the_graph_has_cuts_out_exactly(name):
    """fit_config=False: prune half of every group the graph has, cut them all out in place: equal outputs,
    smaller. (Heads of families that size attention from module attributes cut only where their config can say
    so, in the next test.)"""
    entry = ZOO[name]
    kinds = tuple(k for k in entry.kinds + entry.every if k != "heads") or ("heads",)
    model, batch = entry.make(), entry.batch()
    apply_masks(model, compute_masks(model, 0.5, structure="+".join(kinds), example_inputs=batch, fit_config=False))
    smaller = shrink(model, batch, structure="+".join(kinds), fit_config=False)
    torch.testing.assert_close(eval_output(smaller, batch), eval_output(model, batch), rtol=1e-4, atol=1e-5)
    assert parameter_count(smaller) < 0.95 * parameter_count(model), name


def test_a_segmentation_head_keeps_every_class_channel():
    """smp with 19 classes, filters at 50 %: the head's 19 output channels are the model's output, never units."""
    entry = ZOO["smp_unet"]
    model, batch = entry.make(), entry.batch()
    masks = compute_masks(model, 0.5, structure="filters", example_inputs=batch, fit_config=False)
    head = model.segmentation_head[0].weight
    assert bool(masks["segmentation_head.0.weight"].any(dim=(1, 2, 3)).all())  # no class channel removed
    apply_masks(model, masks)
    assert shrink(model, batch, fit_config=False)(batch).shape[1] == 19 == head.shape[0]


def test_a_1x1_conv_mlp_is_one_unit_group_whatever_structures_name_it():
    """convnext_atto with filters+neurons at 50 %: each MLP's hidden units are pruned once, exactly half."""
    entry = ZOO["convnext_atto"]
    model, batch = entry.make(), entry.batch()
    masks = compute_masks(model, 0.5, structure="filters+neurons", example_inputs=batch, fit_config=False)
    fc1 = [n for n in masks if n.endswith("mlp.fc1.weight")]
    assert fc1
    for n in fc1:
        rows = masks[n].flatten(1).any(1)
        assert int((~rows).sum()) == rows.numel() // 2, n


def test_t5_self_attention_heads_span_the_stack_and_cross_attention_heads_each_layer():
    """T5's first self-attention computes the position bias every later one adds head by head: one unit across the
    stack. Cross-attention layers add a zeros bias each: their heads are per layer."""
    entry = ZOO["t5"]
    groups = trace_units(entry.make(), entry.batch()).groups(("heads",))
    names = sorted(g.name for g in groups)
    assert len(groups) == 3, names  # encoder stack, decoder stack (1 layer), the decoder's one cross-attention
    encoder = next(g for g in groups if g.name.startswith("encoder"))
    assert {m.name for m in encoder.members if m.name.endswith("relative_attention_bias.weight")}
    assert encoder.layers == 2


def test_grouped_query_attention_keeps_its_ratio():
    """LLaMA with 4 query and 2 key/value heads: a unit is a key/value head with the 2 query heads that read it."""
    entry = ZOO["llama"]
    model, batch = entry.make(), entry.batch()
    groups = trace_units(model, batch).groups(("heads",))
    assert [g.n_units for g in groups] == [2, 2]
    q = next(m for m in groups[0].members if m.name.endswith("q_proj.weight"))
    assert tuple(q.positions.shape) == (2, 16)  # 2 query heads of 8


def test_a_structure_that_finds_nothing_names_the_layers_it_looked_at():
    with pytest.raises(ValueError, match=r"(?s)'heads' finds no units in TinyCNN.*fc1: its output is normalised over"):
        compute_masks(make_cnn(), 0.5, structure="heads", example_inputs=torch.randn(2, 3, 8, 8))
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="'filters' finds no units in Sequential.*no convolution layers"):
        compute_masks(mlp, 0.5, structure="filters")
    with pytest.raises(ValueError, match="needs a batch: pass example_inputs"):
        compute_masks(mlp, 0.5, structure="neurons")


def test_removed_units_are_the_ones_whose_weights_are_all_zero():
    entry = ZOO["t5"]
    model, batch = entry.make(), entry.batch()
    apply_masks(model, compute_masks(model, 0.5, structure="neurons", example_inputs=batch))
    for g in trace_units(model, batch).groups(("neurons",)):
        assert int(removed_units(model, g).sum()) == g.n_units // 2


# -- random graphs: every unit's removal is exact ---------------------------------------------------------------------
class RandomNet(nn.Module):
    """A small net drawn from ``spec``: MLP blocks (gated or not, residual or not), conv blocks (residual adds,
    concatenations, depthwise convs, squeeze-excite gates, pooling and resizing), attention blocks."""

    def __init__(self, spec: list[tuple[str, int]], width: int = 8):
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        for kind, hidden in spec:
            block = nn.Module()
            if kind == "conv_residual":
                block.a, block.bn = nn.Conv2d(width, hidden, 3, padding=1), nn.BatchNorm2d(hidden)
                block.b = nn.Conv2d(hidden, width, 1)
            elif kind == "conv_concat":
                block.a, block.b = nn.Conv2d(width, hidden, 1), nn.Conv2d(width, hidden, 3, padding=1)
                block.c = nn.Conv2d(2 * hidden, width, 1)
            elif kind == "inverted":  # expand, depthwise, squeeze-excite, project
                block.a, block.dw = nn.Conv2d(width, hidden, 1), nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
                block.se1, block.se2 = nn.Conv2d(hidden, 4, 1), nn.Conv2d(4, hidden, 1)
                block.b = nn.Conv2d(hidden, width, 1)
            elif kind == "resize":
                block.a = nn.Conv2d(width, hidden, 3, stride=2, padding=1)
                block.b = nn.Conv2d(hidden, width, 1)
            self.blocks.append(block)
        self.proj = nn.Linear(width, 16)
        self.norm = nn.LayerNorm(16)
        self.mlps = nn.ModuleList()
        for kind, hidden in spec:
            mlp = nn.Module()
            mlp.up, mlp.down = nn.Linear(16, hidden), nn.Linear(hidden, 16)
            if kind in ("inverted", "conv_concat"):
                mlp.gate = nn.Linear(16, hidden)
            self.mlps.append(mlp)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True) if len(spec) > 1 else None
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        for (kind, _), b in zip(self.spec, self.blocks):
            if kind == "conv_residual":
                x = x + b.b(torch.relu(b.bn(b.a(x))))
            elif kind == "conv_concat":
                x = x + b.c(torch.cat([torch.relu(b.a(x)), torch.tanh(b.b(x))], 1))
            elif kind == "inverted":
                h = nn.functional.silu(b.dw(nn.functional.silu(b.a(x))))
                h = h * torch.sigmoid(b.se2(torch.relu(b.se1(h.mean((2, 3), keepdim=True)))))
                x = x + b.b(h)
            else:
                h = nn.functional.interpolate(torch.relu(b.a(x)), size=x.shape[-2:], mode="nearest")
                x = x + b.b(h)
        t = self.norm(self.proj(x.flatten(2).transpose(1, 2)))  # tokens
        for mlp in self.mlps:
            h = nn.functional.gelu(mlp.up(t))
            if hasattr(mlp, "gate"):
                h = h * mlp.gate(t)
            t = t + mlp.down(h)
        if self.attention is not None:
            t = t + self.attention(t, t, t, need_weights=False)[0]
        return self.head(t.mean(1))


@FAST
@given(
    spec=st.lists(
        st.tuples(st.sampled_from(["conv_residual", "conv_concat", "inverted", "resize"]), st.integers(4, 12)),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 2**16),
    sparsity=st.sampled_from([0.25, 0.5]),
)
def test_on_random_graphs_every_unit_cuts_out_exactly_and_no_slice_is_in_two_units(spec, seed, sparsity):
    torch.manual_seed(seed)
    model = RandomNet(spec).eval()
    for m in model.modules():  # trained-looking BatchNorms: a removed filter still emits a nonzero constant
        if isinstance(m, nn.BatchNorm2d):
            m.bias.data.normal_(), m.running_mean.normal_(), m.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 6, 6)
    groups = trace_units(model, x).groups(("filters", "neurons", "heads"))
    _no_slice_twice(groups)
    kinds = {g.kind for g in groups}
    assert "filters" in kinds and "neurons" in kinds
    pruned = apply_masks(model, compute_masks(model, sparsity, structure="filters+neurons", example_inputs=x,
                                              fit_config=False, criterion="random", seed=seed))  # fmt: skip
    smaller = shrink(pruned, x, structure="filters+neurons", fit_config=False)
    torch.testing.assert_close(smaller(x), pruned(x), rtol=1e-4, atol=1e-5)
    assert parameter_count(smaller) < parameter_count(pruned)


def test_an_unknown_op_is_one_registration(monkeypatch):
    """An aten op the tracer does not know pins what it reads (no units behind it); OPS.add(name, kind) makes it
    followed, without an edit of the tracer (issue 37 item 7)."""
    import copy

    from torch import nn

    from hf_sms.pruning.graph import OPS, trace_units

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.LogSigmoid(), nn.Conv2d(8, 4, 3)).eval()  # aten.log_sigmoid_forward
    x = torch.randn(2, 3, 12, 12)
    assert trace_units(model, x).groups(("filters",)) == []
    monkeypatch.setattr(OPS, "_kinds", copy.deepcopy(OPS._kinds))  # the registration stays in this test
    OPS.add("log_sigmoid_forward", "pointwise")
    (group,) = trace_units(model, x).groups(("filters",))
    assert group.n_units == 8
    with pytest.raises(ValueError, match="unknown op kind"):
        OPS.add("x", "elementwise")
