"""The per-tensor codec: exact round trips in every code, near the entropy bound, loud on corruption."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from conftest import float_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_sms.checkpoint import index_format
from hf_sms.checkpoint.codec import (
    BITMASK,
    DENSE,
    ELIAS_FANO,
    decode_tensor,
    encode_tensor,
    index_info,
    index_mask,
    parse_index,
    position_chunks,
    restamp_index,
    verified,
)
from hf_sms.checkpoint.masks import MaskDigest, _mask_digest


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
    assert torch.equal(float_bits(out), float_bits(t))
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


@contextlib.contextmanager
def _chunk_bits(bits: int):
    old, index_format.CHUNK_BITS = index_format.CHUNK_BITS, bits
    try:
        yield
    finally:
        index_format.CHUNK_BITS = old


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    density=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]) | st.floats(0.0, 1.0),
    code=st.sampled_from([BITMASK, ELIAS_FANO]),
    bits=st.sampled_from([8, 16, 64, 1 << 18]),
    window=st.sampled_from([8, 24, 1 << 18]),
    seed=st.integers(0, 2**16),
)
def test_positions_decode_chunk_by_chunk_to_the_mask_and_its_digest(shape, density, code, bits, window, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < density)
    values, index = encode_tensor(t, code)
    head, _, payload = verified(values, index, "t")
    with _chunk_bits(bits):
        chunks = list(position_chunks(head, payload, "t"))
        assert torch.equal(decode_tensor(values, index), t) and torch.equal(index_mask(index), t != 0)
    assert all(0 < len(c) <= bits for c in chunks)  # many chunks when they are small, none empty
    flat = t.reshape(-1)
    positions = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    assert np.array_equal(positions, torch.nonzero(flat).reshape(-1).numpy())
    digest = MaskDigest(flat.numel(), window)
    for chunk in chunks:
        digest.add(chunk)
    assert digest.digest() == _mask_digest((flat != 0).numpy())  # the digest sparsity.json records


@pytest.mark.parametrize("code", [BITMASK, ELIAS_FANO])
def test_a_flipped_position_bit_with_a_matching_checksum_never_yields_bad_positions(code):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(12, 20, generator=g) * (torch.rand(12, 20, generator=g) < 0.15)
    values, index = encode_tensor(t, code)
    start = len(index) - len(parse_index(index, "t")[1])
    for byte in range(start, len(index)):
        for bit in range(8):
            forged = index.clone()
            forged[byte] ^= 1 << bit
            forged = restamp_index(forged, values)  # as if written so: the checksum agrees
            head, _, payload = verified(values, forged, "t")
            try:
                with _chunk_bits(8):
                    positions = np.concatenate(list(position_chunks(head, payload, "t")) or [np.zeros(0, np.int64)])
            except ValueError as e:
                assert "corrupted" in str(e)
                continue
            # decodable: then exactly nnz positions, increasing, inside the tensor (safe for CSR kernels)
            assert len(positions) == values.numel() and (np.diff(positions) > 0).all()
            assert len(positions) == 0 or 0 <= positions[0] and positions[-1] < t.numel()


# -- the weight file writer -----------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from(["float32", "bfloat16", "float16", "int64", "bool", "uint8"]), min_size=6),
    fmt=st.sampled_from(["bitmask", "dense"]),
    seed=st.integers(0, 2**16),
)
def test_the_spooled_writer_writes_files_safetensors_reads_as_written(shapes, dtypes, fmt, seed):
    """WeightsWriter spools each tensor to disk as it comes and writes the file at the end: safetensors' own reader
    gives back every tensor (dtype, shape, bytes) and the metadata, the data starts 8-byte aligned, and a bitmask
    file decodes to the tensors given."""
    import json
    import struct
    import tempfile

    from safetensors import safe_open

    from hf_sms.checkpoint.constants import INDEX_SUFFIX
    from hf_sms.checkpoint.safetensors_io import WeightsWriter
    from hf_sms.checkpoint.safetensors_raw import CRC_KEY

    g = torch.Generator().manual_seed(seed)
    given_tensors = {}
    for k, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        t = (torch.randn(shape, generator=g) * 3).round()  # zeros among them
        name = f"layer{k}.weight" if len(shape) == 2 else f"layer{k}.bias"
        given_tensors[name] = t.to(getattr(torch, dtype))
    with tempfile.TemporaryDirectory() as d:
        writer = WeightsWriter(fmt, spool_dir=d)
        for name, t in given_tensors.items():
            writer.add(name, t)
        path = f"{d}/model.safetensors"
        writer.save(path)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        assert n % 8 == 0
        with safe_open(path, "pt") as f:
            stored = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        assert set(header) - {"__metadata__"} == set(stored)
        assert json.loads(meta[CRC_KEY]).keys() <= set(stored)
        for name, t in given_tensors.items():
            if name + INDEX_SUFFIX in stored:  # encoded: its index places its values
                back = decode_tensor(stored[name], stored[name + INDEX_SUFFIX], name)
            else:
                back = stored[name]
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
