"""Every recipe's ``--smoke`` run as a user starts it, alone and on top of every shipped config: a subprocess,
offline, on CPU, tiny model and data.

Each run writes its tiny data to a temporary folder and reads it through the same ``datasets`` path as real
data (JSON lines, imagefolder, ``save_to_disk``), pretrains where the recipe does, runs SMS (2 phases to
50%, m=2) with IMP and IMP_mx beside it, prints the table and saves the final soup.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "recipes" / "configs"
RECIPE_OF = {  # every shipped config, on its recipe's smoke data
    "t5_wmt16": "t5_wmt16",
    "resnet50_imagenet": "image_classification",
    "maxvit_imagenet": "image_classification",
    "pspnet_cityscapes": "pspnet_segmentation",
    "resnet18_cifar10": "cifar",
    "wrn20_cifar100": "cifar",
    "resnet18_celeba": "cifar",
}
RUNS = {  # id: (recipe, extra flags, the named test sets every row must carry)
    **{name: (name, [], ["test"]) for name in ("t5_wmt16", "image_classification", "pspnet_segmentation", "cifar")},
    **{f"config-{c}": (r, ["--config", str(CONFIGS / f"{c}.yaml")], ["test"]) for c, r in RECIPE_OF.items()},
    # WRN-20 with CIFAR-C made on the fly; CelebA's subgroup recall
    "config-wrn20_cifar100": ("cifar", ["--config", str(CONFIGS / "wrn20_cifar100.yaml"), "--ood"], ["test", "ood"]),
    "config-resnet18_celeba": ("cifar", ["--config", str(CONFIGS / "resnet18_celeba.yaml")], ["test", "subgroups"]),
}


def _smoke(tmp_path, recipe, flags):
    scratch = tmp_path / "tmp"  # the run's temporary folder, removed at its exit
    scratch.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(scratch),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",  # tiny models: two OpenMP threads on shared cores run many times slower
    }
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), "--smoke", *flags, "--output_dir", str(out)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not list(scratch.glob("hf-sms-smoke-*")), "the smoke data outlived the run"
    return out, proc.stdout


@pytest.mark.parametrize(("recipe", "flags", "tests"), list(RUNS.values()), ids=list(RUNS))
def test_smoke_run(tmp_path, recipe, flags, tests):
    out, stdout = _smoke(tmp_path, recipe, flags)
    results = json.loads((out / "results.json").read_text())
    assert results["phases"] == pytest.approx([1 - 0.5**0.5, 0.5])
    for method in ("sms_uniform", "best_candidate", "mean_candidate", "imp", "imp_mx"):
        rows = results["rows"][method]
        assert [r["phase"] for r in rows] == [1, 2], method
        assert rows[-1]["sparsity"] == pytest.approx(0.5, abs=1e-3), method
        assert sorted(rows[-1]["tests"]) == sorted(tests) and rows[-1]["val"] is not None, method
    assert sorted(results["dense"]["tests"]) == sorted(tests) and results["dense"]["sparsity"] < 1e-3
    for name in tests:  # finish() prints one table per test set, dense model first
        table = stdout.split(f"{name} after each phase:\n", 1)[1]
        assert table.startswith("| method | phase 1 (29.3%) | phase 2 (50.0%) |"), stdout[-2000:]
        assert "| dense (unpruned) |" in table and "| SMS (uniform) |" in table and "| IMP |" in table
    soup = json.loads((out / "final_soup" / "sparsity.json").read_text())
    assert soup["sparsity"] == pytest.approx(0.5, abs=1e-3) and soup["recipe"]["phases"][-1] == 0.5
    assert not (tmp_path / "run-dense").exists()  # smoke pretraining stays in the temporary folder


def test_every_shipped_config_has_a_smoke_run():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(RECIPE_OF)
