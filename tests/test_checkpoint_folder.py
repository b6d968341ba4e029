"""Checkpoint folders: atomic writes in every mode, one sparsity.json schema, and the model-family registry."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TinyCNN, make_cnn, make_resnet, make_t5

from hf_sms import apply_masks, compute_masks, load_sparse, save_sparse
from hf_sms.checkpoint import FORMAT_VERSION, merge_checkpoints
from hf_sms.checkpoint.family_files import load_snippet
from hf_sms.checkpoint.folder import atomic_folder, check_target
from hf_sms.families import FAMILIES, Family, family_of, family_of_config, register_family


def _files(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir()}


def _write(folder: str, **files: str) -> None:
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def test_atomic_folder_installs_only_when_complete(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_folder(str(target)) as tmp:
        _write(tmp, **{"model.safetensors": "half"})
        raise RuntimeError("failed half way")
    assert not target.exists() and list(tmp_path.iterdir()) == []  # no half-written folder, no temporary one
    with atomic_folder(str(target)) as tmp:
        _write(tmp, **{"model.safetensors": "w"})
    assert _files(target) == {"model.safetensors": b"w"} and list(tmp_path.iterdir()) == [target]


def test_atomic_folder_modes(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    _write(str(target), **{"model.safetensors": "old", "pytorch_model.bin": "old", "notes.txt": "mine"})
    with pytest.raises(ValueError, match="not empty"):
        with atomic_folder(str(target), "new"):
            raise AssertionError("never reached: refused before writing")
    with atomic_folder(str(target), "update") as tmp:  # save_sparse: weights replaced, other files kept
        _write(tmp, **{"model.safetensors": "new", "sparsity.json": "{}"})
    assert _files(target) == {"model.safetensors": b"new", "sparsity.json": b"{}", "notes.txt": b"mine"}
    with atomic_folder(str(target), "replace") as tmp:  # merge --overwrite: swapped out whole
        _write(tmp, **{"model.safetensors": "soup"})
    assert _files(target) == {"model.safetensors": b"soup"} and list(tmp_path.iterdir()) == [target]
    (tmp_path / "file").write_text("x")
    for mode in ("new", "update", "replace"):
        with pytest.raises(ValueError, match="existing file"):
            check_target(str(tmp_path / "file"), mode)
    assert (tmp_path / "file").read_text() == "x"


def test_save_and_merge_write_one_sparsity_json_schema(tmp_path):
    base = make_resnet()
    apply_masks(base, compute_masks(base, 0.8, "uniform"))
    dirs = [save_sparse(base, str(tmp_path / f"r{i}"), recipe={"m": 2}) for i in range(2)]
    merge_checkpoints(dirs, str(tmp_path / "soup"))
    saved, merged = (json.loads((tmp_path / d / "sparsity.json").read_text()) for d in ("r0", "soup"))
    assert list(saved) == list(merged)
    assert saved["hf_sms_format_version"] == merged["hf_sms_format_version"] == FORMAT_VERSION
    assert merged["per_tensor"] == saved["per_tensor"] and merged["mask_hash"] == saved["mask_hash"]


@pytest.mark.parametrize(
    ("make", "library"),
    [(make_t5, "transformers"), (make_resnet, "timm"), (make_cnn, "torch")],
    ids=["transformers", "timm", "torch"],
)
def test_families_detect_models_and_their_folders(tmp_path, make, library):
    model = make()
    assert family_of(model).library == library
    save_sparse(model, str(tmp_path), "dense")
    config = json.loads((tmp_path / "config.json").read_text()) if library != "torch" else None
    found = family_of_config(config)
    assert (found[0].library if found else "torch") == library


def test_a_new_family_is_one_registered_entry(tmp_path):
    class TinyCNNFamily(Family):
        library = "tiny_cnn"

        def detects(self, model):
            return isinstance(model, TinyCNN)

        def save(self, model, folder):
            return FAMILIES["torch"].save(model, folder)

        def instantiate(self, ckpt, **kwargs):
            return make_cnn(seed=1)

    family = register_family(TinyCNNFamily())
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_family(TinyCNNFamily())
        model = make_cnn()
        save_sparse(model, str(tmp_path))
        assert json.loads((tmp_path / "sparsity.json").read_text())["library"] == "tiny_cnn"
        loaded = load_sparse(str(tmp_path))  # built by the family: no template needed
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
        assert "hf_sms.load_sparse" in load_snippet(family, "TinyCNN", "bitmask", "me/tiny")
    finally:
        FAMILIES.remove("tiny_cnn")


def test_a_mapped_read_is_the_stored_tensor_and_never_writes_the_file(tmp_path):
    from safetensors.torch import save_file

    from hf_sms.checkpoint.safetensors_io import SafetensorsFile

    path = str(tmp_path / "w.safetensors")
    tensors = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.randn(4, 5), "c": torch.zeros(0)}
    save_file(tensors, path)
    before = open(path, "rb").read()
    f = SafetensorsFile(path)
    for key, t in tensors.items():
        assert torch.equal(f.read(key, mapped=True), t) and torch.equal(f.read(key), t)
    mapped = f.read("b", mapped=True)
    mapped += 1  # copy-on-write: the loaded model may change its tensors, the file stays as saved
    assert open(path, "rb").read() == before and torch.equal(SafetensorsFile(path).read("b"), tensors["b"])
    f.data_start += 1  # an offset no float32 can be read from in place: read (copied, aligned), not mapped
    assert f.read("b", mapped=True).data_ptr() % 4 == 0


def test_the_shrink_record_reads_what_it_wrote_and_nothing_else():
    """recipe["shrunk"] is read through one typed record (issue 37 item 6): written fields round-trip, entries of
    the wrong type from a foreign file are dropped, a pruned save is never 'cut in place', and it needs no torch."""
    import subprocess
    import sys

    from hf_sms.checkpoint.shrink_record import IN_PLACE, SMALLER, ShrinkRecord

    record = ShrinkRecord(SMALLER, structure="filters", cut=IN_PLACE, units={"filters": {"sparsity": 0.5}},
                          parameters=10, dense_parameters=20, parameter_ratio=0.5)  # fmt: skip
    assert ShrinkRecord.of({"recipe": {"shrunk": record.to_json()}}) == record and record.cut_in_place
    assert not record.as_pruned("no").cut_in_place and record.as_pruned("no").why == "no"
    hostile = {"saved": "smaller", "cut": 3, "units": "x", "parameters": True, "why": ["a"], "extra": 1}
    assert ShrinkRecord.of({"recipe": {"shrunk": hostile}}) == ShrinkRecord(SMALLER)
    assert ShrinkRecord.of({"recipe": "x"}) is None and ShrinkRecord.of(None) is None
    blocked = "import sys; sys.modules['torch'] = None; import hf_sms.checkpoint.shrink_record"
    assert subprocess.run([sys.executable, "-c", blocked], capture_output=True).returncode == 0


def test_the_transformers_check_refuses_only_a_smaller_model_cut_in_place(tmp_path):
    """A final soup that fell back to the pruned (full-size) model keeps its record's cut: "in place", and
    transformers may load it; only a smaller model whose widths its config cannot state is refused."""
    import json

    from hf_sms.checkpoint.transformers_integration import check_dense_folder

    record = {"format": "bitmask", "recipe": {"shrunk": {"saved": "pruned", "cut": "in place", "why": "x"}}}
    (tmp_path / "sparsity.json").write_text(json.dumps(record))
    check_dense_folder(str(tmp_path))  # the pruned model: its config states every width
    record = {"format": "dense", "recipe": {"shrunk": {"saved": "smaller", "cut": "in place"}}}
    (tmp_path / "sparsity.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="cut in place"):
        check_dense_folder(str(tmp_path))
