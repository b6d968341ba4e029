"""Pairwise distances between replicas are computed piece by piece (float64 copies of at most ``BUCKET`` elements,
a tensor larger than that split over several pieces) and equal the distance of the whole flattened models."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_sms.soup.averaging as averaging
from hf_sms.loop.distributed import ReplicaWorld
from hf_sms.soup.averaging import pieces


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(1, 17))
def test_pieces_cover_every_element_once_and_none_is_larger_than_a_bucket(sizes, bucket):
    template = {f"t{i}": torch.empty(n) for i, n in enumerate(sizes)}
    averaging.BUCKET, before = bucket, averaging.BUCKET
    try:
        got = pieces(template, list(template))
    finally:
        averaging.BUCKET = before
    assert all(sum(hi - lo for _, lo, hi in piece) <= bucket for piece in got)
    covered = [(k, i) for piece in got for k, lo, hi in piece for i in range(lo, hi)]
    assert covered == [(k, i) for k, t in template.items() for i in range(t.numel())]  # in order, each once


def test_pairwise_l2_of_a_tensor_larger_than_a_bucket(monkeypatch):
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3)) for _ in range(3)]
    monkeypatch.setattr(averaging, "BUCKET", 64)  # the embedding's 400 elements over several pieces
    got = ReplicaWorld(3).pairwise_l2(dict(enumerate(models)), 3, models[0])
    flat = [torch.cat([p.detach().reshape(-1).double() for p in m.parameters()]) for m in models]
    want = [float((flat[i] - flat[j]).norm()) for i in range(3) for j in range(i + 1, 3)]
    assert got == pytest.approx(want, rel=1e-12)
