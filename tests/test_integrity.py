"""One integrity check for every reader (issue 30): each kind of corruption (a byte of an encoded value, of a
tensor stored as it is, two tensors swapped in a header, an encoded pair swapped, a weight file from another save,
a wrong checksum) is refused by load_sparse, from_pretrained after import hf_sms (bitmask and dense folders), merge,
convert, inspect and speed, each naming the tensor or file."""

import json
import shutil
import struct

import pytest
import torch
from conftest import make_t5
from transformers import AutoModelForSeq2SeqLM

import hf_sms
from hf_sms import load_sparse, prune, save_sparse
from hf_sms.checkpoint.merge import convert_checkpoint, merge_checkpoints
from hf_sms.cli import main

ENCODED = "encoder.block.0.layer.0.SelfAttention.q.weight"  # same shape as its key projection
ENCODED_TWIN = "encoder.block.0.layer.0.SelfAttention.k.weight"
PLAIN = "encoder.block.0.layer.0.layer_norm.weight"  # stored as it is, same shape as the other norms
PLAIN_TWIN = "encoder.block.0.layer.1.layer_norm.weight"


def _model(seed: int):
    model = make_t5(seed)
    for p in model.parameters():  # norms that differ, so a swap changes values
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.01)
    prune(model, 0.5)
    return model


def _header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path, header, data) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _flip(path, key, header_of=None) -> None:
    header, data = _header(path)
    start = header[key]["data_offsets"][0]
    data = bytearray(data)
    data[start] ^= 0x01
    _write_header(path, header, bytes(data))


def _swap(path, a, b) -> None:
    header, data = _header(path)
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    _write_header(path, header, data)


def _wrong_crc(path, key) -> None:
    header, data = _header(path)
    crcs = json.loads(header["__metadata__"]["hf_sms_crc32"])
    crcs[key] ^= 1
    header["__metadata__"]["hf_sms_crc32"] = json.dumps(crcs)
    _write_header(path, header, data)


def _other_save(folder, tmp_path) -> None:
    other = save_sparse(_model(7), str(tmp_path / "other"))
    shutil.copyfile(f"{other}/model.safetensors", folder / "model.safetensors")


CORRUPTIONS = {
    "flipped encoded value": lambda f, tmp: _flip(f / "model.safetensors", ENCODED),
    "flipped plain tensor": lambda f, tmp: _flip(f / "model.safetensors", PLAIN),
    "swapped plain tensors": lambda f, tmp: _swap(f / "model.safetensors", PLAIN, PLAIN_TWIN),
    "swapped encoded pairs": lambda f, tmp: [
        _swap(f / "model.safetensors", ENCODED + s, ENCODED_TWIN + s) for s in ("", ".sp_index")
    ],  # fmt: skip
    "file from another save": _other_save,
    "wrong checksum": lambda f, tmp: _wrong_crc(f / "model.safetensors", PLAIN),
}
NAMED = {  # what the error names
    "flipped encoded value": ENCODED,
    "flipped plain tensor": PLAIN,
    "swapped plain tensors": "model.safetensors",
    "swapped encoded pairs": "model.safetensors",
    "file from another save": "model.safetensors",
    "wrong checksum": "model.safetensors",
}


def _from_pretrained(folder):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(str(folder))


READERS = {
    "load_sparse": lambda f, tmp: load_sparse(str(f)),
    "from_pretrained": lambda f, tmp: _from_pretrained(f),
    "merge": lambda f, tmp: merge_checkpoints([str(f), str(tmp / "clean")], str(tmp / "merged")),
    "convert": lambda f, tmp: convert_checkpoint(str(f), str(tmp / "converted")),
}


@pytest.fixture
def folders(tmp_path):
    model = _model(0)
    clean = save_sparse(model, str(tmp_path / "clean"))
    bad = tmp_path / "bad"
    shutil.copytree(clean, bad)
    return tmp_path, bad


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_every_reader_refuses_every_corruption_naming_it(folders, kind, capsys):
    tmp_path, bad = folders
    assert main(["inspect", str(bad)]) == 0  # verified before
    capsys.readouterr()
    CORRUPTIONS[kind](bad, tmp_path)
    for reader, read in READERS.items():
        with pytest.raises(ValueError) as e:
            read(bad, tmp_path)
        assert NAMED[kind] in str(e.value), (kind, reader, str(e.value))
    for name in ("merged", "converted"):
        assert not (tmp_path / name).exists()  # nothing written
    code = main(["inspect", str(bad)])  # 1: corrupted bytes listed; 2: files not the recorded ones, an error
    said = "".join(capsys.readouterr())
    assert code != 0 and NAMED[kind] in said and "Traceback" not in said, (kind, said)


def test_speed_refuses_a_corrupted_folder(folders, capsys):
    tmp_path, bad = folders
    CORRUPTIONS["flipped encoded value"](bad, tmp_path)
    assert main(["speed", str(bad), "--repeats", "1", "--seq-len", "8"]) == 2
    assert ENCODED in capsys.readouterr().err


def test_a_dense_folder_checks_its_bytes_and_its_recorded_checksums(tmp_path, capsys):
    folder = tmp_path / "dense"
    save_sparse(_model(0), str(folder), format="dense")
    info = json.loads((folder / "sparsity.json").read_text())
    assert set(info["files"]) == {"model.safetensors"} and "crc32" in info
    shutil.copytree(folder, tmp_path / "edited")
    shutil.copytree(folder, tmp_path / "swapped")
    assert AutoModelForSeq2SeqLM.from_pretrained(str(folder)) is not None  # untouched: loads, checked
    _flip(folder / "model.safetensors", PLAIN)  # a byte of the family's own file
    for read in (load_sparse, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(ValueError, match=PLAIN):
            read(str(folder))
    assert main(["inspect", str(folder)]) == 1 and PLAIN in capsys.readouterr().out
    edited = tmp_path / "edited"  # a wrong checksum in sparsity.json, the bytes intact
    info["crc32"][PLAIN] ^= 1
    (edited / "sparsity.json").write_text(json.dumps(info))
    for read in (load_sparse, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(ValueError, match=PLAIN):
            read(str(edited))
    assert main(["inspect", str(edited)]) == 1
    _swap(tmp_path / "swapped" / "model.safetensors", PLAIN, PLAIN_TWIN)  # names no longer the recorded ones
    for read in (load_sparse, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(ValueError, match="model.safetensors"):
            read(str(tmp_path / "swapped"))


def test_a_clean_folder_reads_everywhere_and_inspect_says_verified(folders, capsys):
    tmp_path, bad = folders  # untouched copy
    assert main(["inspect", str(bad)]) == 0 and "integrity:    verified" in capsys.readouterr().out
    for read in READERS.values():
        read(bad, tmp_path)
    assert hf_sms.sparsity_report(load_sparse(str(tmp_path / "merged")))["sparsity"] == pytest.approx(0.5, abs=0.01)
