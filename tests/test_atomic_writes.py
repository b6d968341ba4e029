"""Every file hf-sms writes goes through one helper (hf_sms/atomic.py): a temp file created exclusively beside the
target, never through a link planted at any name a writer uses, and the user's umask on what it leaves."""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import stat
import tempfile

import pytest
import torch
from conftest import RUN, make_cnn

from hf_sms import save_sparse
from hf_sms.atomic import atomic_path, atomic_write
from hf_sms.checkpoint.trainer_card import TRAINER_MARK, merge_trainer_card
from hf_sms.checkpoint.trainer_masks import save_masks
from hf_sms.records.results import plot_results, save_results, timeline_command

# every temp name a writer of hf-sms used before the helper, and the names the helper itself tries first (below)
PLANTED = ("timeline.png.tmp.png", "results.json.tmp", "results.png.tmp.png", "sparse_masks.safetensors.tmp",
           "README.md.hf_sms-tmp", "model.safetensors.new")  # fmt: skip
CANDIDATES = ["aaaaaaaa", "bbbbbbbb"]


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A victim file, and a link to it at every temp name: the old fixed ones and the helper's first candidates
    (tempfile's name generator made predictable, so the links sit exactly where mkstemp tries first)."""
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: iter(CANDIDATES * 1 + [f"c{i}" for i in range(99)]))

    def plant(folder: pathlib.Path, suffixes=(".json", ".png", ".safetensors", ".md", "")):
        folder.mkdir(parents=True, exist_ok=True)
        for name in PLANTED:
            os.symlink(victim, folder / name)
        for cand in CANDIDATES[:1]:
            for suffix in suffixes:
                os.symlink(victim, folder / f".hf_sms-tmp-{cand}{suffix}")
        return folder

    return victim, plant


def _untouched(victim, folder):
    assert victim.read_text() == "untouched\n"
    for name in PLANTED:
        assert os.path.islink(folder / name)  # left as it was: neither followed nor replaced


def test_timeline_writes_nothing_through_a_planted_link(planted, tmp_path, capsys):
    victim, plant = planted
    run = plant(tmp_path / "run")
    (run / "results.json").write_text(json.dumps(RUN))
    os.symlink(victim, run / "timeline.png")  # a link at the target itself is replaced, its target kept
    assert timeline_command(argparse.Namespace(run_dir=str(run))) == 0
    _untouched(victim, run)
    picture = run / "timeline.png"
    assert not picture.is_symlink() and picture.read_bytes()[:4] == b"\x89PNG"


def test_results_and_plots_write_nothing_through_a_planted_link(planted, tmp_path):
    victim, plant = planted
    run = plant(tmp_path / "run")
    save_results(RUN, str(run / "results.json"))
    plot_results([RUN], str(run / "results.png"))
    _untouched(victim, run)
    assert json.loads((run / "results.json").read_text()) == RUN
    assert (run / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_trainer_files_write_nothing_through_a_planted_link(planted, tmp_path):
    victim, plant = planted
    folder = plant(tmp_path / "ckpt")
    save_masks({"w": torch.ones(3, dtype=torch.bool)}, str(folder))
    _untouched(victim, folder)
    model = make_cnn()
    save_sparse(model, str(tmp_path / "soup"))
    plant(tmp_path / "soup")
    assert merge_trainer_card(str(tmp_path / "soup"), f"---\nx: 1\n---\nTrainer {TRAINER_MARK}.\n")
    _untouched(victim, tmp_path / "soup")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(str(path)) as f:
        f.write("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]
    with pytest.raises(ValueError, match="whole files"), atomic_write(str(path), "a"):
        pass


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        save_results(RUN, str(tmp_path / "results.json"))
        with atomic_path(str(tmp_path / "x.bin")) as tmp:
            pathlib.Path(tmp).write_bytes(b"1")
        save_sparse(make_cnn(), str(tmp_path / "soup"))
    finally:
        os.umask(old)
    for path in [tmp_path / "results.json", tmp_path / "x.bin", *(tmp_path / "soup").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path  # save_file alone leaves model.safetensors 0600
    assert stat.S_IMODE((tmp_path / "soup").stat().st_mode) == 0o750


def test_no_module_writes_a_file_but_through_the_helper():
    """``os.replace`` and ``open(..., "w")`` live in hf_sms/atomic.py (and the folder renames of checkpoint/folder.py)
    only: a new writer has to use the helper."""
    root = pathlib.Path(__file__).parent.parent / "hf_sms"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "atomic.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if func in ("os.replace", "os.rename") and path.name != "folder.py":
                offenders.append(f"{path.name}:{node.lineno} {func}")
            mode = node.args[1] if func == "open" and len(node.args) > 1 else None
            mode = mode or next((k.value for k in node.keywords if k.arg == "mode"), None) if func == "open" else None
            if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wa+"):  # "x" creates exclusively: safe
                offenders.append(f"{path.name}:{node.lineno} open(..., {mode.value!r})")
    assert offenders == []
