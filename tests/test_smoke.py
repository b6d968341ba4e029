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
from conftest import untimed

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
    "llama_wikitext2": "causal_lm",
}
RUNS = {  # id: (recipe, extra flags, the named test sets every row must carry)
    **{name: (name, [], ["test"]) for name in ("t5_wmt16", "image_classification", "pspnet_segmentation", "cifar")},
    **{f"config-{c}": (r, ["--config", str(CONFIGS / f"{c}.yaml")], ["test"]) for c, r in RECIPE_OF.items()},
    # a LLaMA whose replicas train MaskLoRA adapters (replica_params), perplexity
    "causal_lm": ("causal_lm", ["--replica_params", "mask_lora"], ["test"]),
    # ImageNet-C's folder layout read from disk
    "image_classification-ood": ("image_classification", ["--ood"], ["test", "ood"]),
    # WRN-20 with CIFAR-C made on the fly; CelebA's subgroup recall
    "config-wrn20_cifar100": ("cifar", ["--config", str(CONFIGS / "wrn20_cifar100.yaml"), "--ood"], ["test", "ood"]),
    "config-resnet18_celeba": (
        "cifar",
        ["--config", str(CONFIGS / "resnet18_celeba.yaml")],
        ["test", "subgroups", "balanced"],
    ),
}


def _offline_env(scratch: Path) -> dict:
    """A subprocess's environment: offline, this checkout importable, ``scratch`` as its temporary folder."""
    return {
        **os.environ,
        "TMPDIR": str(scratch),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",  # tiny models: two OpenMP threads on shared cores run many times slower
    }


def _smoke(tmp_path, recipe, flags, nproc=1, fork_server=None):
    scratch = tmp_path / "tmp"  # the run's temporary folder, removed at its exit
    scratch.mkdir()
    out = tmp_path / "run"
    script = [str(ROOT / "recipes" / f"{recipe}.py"), "--smoke", *flags, "--output_dir", str(out)]
    if fork_server is not None:  # fresh processes (torchrun's variables for several), without paying the imports
        env = {"TMPDIR": str(scratch)}
        proc = fork_server.run(script[0], script[1:], cwd=tmp_path, env=env, timeout=600, nproc=nproc)
    else:
        env = _offline_env(scratch)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        command = (launcher if nproc > 1 else [sys.executable]) + script
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not list(scratch.glob("hf-sms-smoke-*")), "the smoke data outlived the run"
    return out, proc.stdout


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory, fork_server):
    """``run(recipe, flags, nproc=1) -> (output folder, stdout)``, each distinct run once per module."""
    done = {}

    def run(recipe, flags, nproc=1):
        key = (recipe, tuple(flags), nproc)
        if key not in done:
            done[key] = _smoke(tmp_path_factory.mktemp(recipe), recipe, flags, nproc, fork_server)
        return done[key]

    return run


# A config whose smoke run takes the recipe's plain path again runs with -m slow (every config parses in CI:
# tests/test_recipes.py::test_shipped_configs_parse); the others exercise a model or metric of their own.
SAME_PATH = {
    "config-t5_wmt16",
    "config-resnet50_imagenet",
    "config-pspnet_cityscapes",
    "config-resnet18_cifar10",
    "config-llama_wikitext2",
}


@pytest.mark.parametrize(
    ("recipe", "flags", "tests"),
    [pytest.param(*run, id=name, marks=[pytest.mark.slow] if name in SAME_PATH else []) for name, run in RUNS.items()],
)
def test_smoke_run(smoke_runs, recipe, flags, tests):
    out, stdout = smoke_runs(recipe, flags)
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
        assert table.startswith("| method | phase 1 (target 29.3%) | phase 2 (target 50.0%) |"), stdout[-2000:]
        assert "| dense (unpruned) |" in table and "| SMS (uniform) |" in table and "| IMP |" in table
    soup = json.loads((out / "final_soup" / "sparsity.json").read_text())
    assert soup["sparsity"] == pytest.approx(0.5, abs=1e-3) and soup["recipe"]["phases"][-1] == 0.5
    assert not (out.parent / "run-dense").exists()  # smoke pretraining stays in the temporary folder
    if recipe == "pspnet_segmentation":  # its size beside the paper's, where the run's records say what it trained
        assert any("M weights" in n and "68M" in n for n in results["notes"]), results["notes"]
        card = (out / "final_soup" / "README.md").read_text()
        assert "the paper's has 68M" in card


def test_every_shipped_config_has_a_smoke_run():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(RECIPE_OF)


# timm's 2-process path is in CI through tests/test_loop_parallel.py (every family); its smoke run is -m slow
@pytest.mark.parametrize(
    "recipe",
    ["t5_wmt16", pytest.param("image_classification", marks=pytest.mark.slow), "pspnet_segmentation", "cifar"],
)
def test_smoke_run_on_two_processes(smoke_runs, recipe):
    # every family saves the replicas its process owns (transformers writes only on rank 0 unless told)
    runs = {n: smoke_runs(recipe, [], nproc=n)[0] for n in (1, 2)}
    one, two = (json.loads((runs[n] / "results.json").read_text()) for n in (1, 2))
    if recipe == "cifar":  # pretraining is data-parallel: the same global batch, another summation order
        assert {k: [r["sparsity"] for r in v] for k, v in two["rows"].items()} == {
            k: [r["sparsity"] for r in v] for k, v in one["rows"].items()
        }
    else:
        assert untimed(two["rows"]) == untimed(one["rows"]) and two["dense"] == one["dense"]
    replicas = sorted(str(p.parent.relative_to(runs[2])) for p in runs[2].glob("sms/phase*/replica*/sparsity.json"))
    assert replicas == [f"sms/phase{p}/replica{i}" for p in (1, 2) for i in (0, 1)]  # replica1: written by rank 1
    if recipe == "t5_wmt16":  # the soup of a 2-process run loads with plain transformers after `import hf_sms`
        from transformers import AutoModelForSeq2SeqLM

        import hf_sms  # noqa: F401

        model = AutoModelForSeq2SeqLM.from_pretrained(runs[2] / "final_soup")
        assert hf_sms.sparsity_report(model)["sparsity"] == pytest.approx(0.5, abs=1e-3)


def _weights_hash(folder: Path) -> str:
    """SHA-256 of a saved soup's weights as the model loads them, in name order (bit patterns, -0.0 as +0.0)."""
    import hashlib

    from conftest import float_bits

    import hf_sms

    model = hf_sms.load_sparse(str(folder))
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        bits = float_bits(tensor) if tensor.is_floating_point() else tensor
        digest.update(name.encode() + bits.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_causal_lm_recipe_soup_is_the_same_on_one_and_two_processes(smoke_runs, tmp_path):
    """Issue 54 item 11: the causal-LM recipe's smoke run (MaskLoRA replicas) on 1 process, on ``torchrun
    --nproc_per_node 2`` and on ``accelerate launch --cpu --num_processes 2`` (which starts one process without
    MPI, and says so): the same soup, bit for bit."""
    flags = ["--replica_params", "mask_lora"]
    one, _ = smoke_runs("causal_lm", flags)
    two, _ = smoke_runs("causal_lm", flags, nproc=2)
    scratch, out = tmp_path / "tmp", tmp_path / "run"
    scratch.mkdir()
    env = _offline_env(scratch)
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    accelerate += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    script = [str(ROOT / "recipes" / "causal_lm.py"), "--smoke", *flags, "--output_dir", str(out)]
    proc = subprocess.run(accelerate + script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "started one process" in proc.stderr and "torchrun --nproc_per_node N" in proc.stderr, proc.stderr[-4000:]
    # subset replicas save their trained tensors only; replica1 is written by rank 1
    replicas = sorted(str(p.parent.relative_to(two)) for p in two.glob("sms/phase*/replica*/replica.safetensors"))
    assert replicas == [f"sms/phase{p}/replica{i}" for p in (1, 2) for i in (0, 1)]
    runs = {"1 process": one, "torchrun 2": two, "accelerate 2": out}
    hashes = {name: _weights_hash(run / "final_soup") for name, run in runs.items()}
    assert len(set(hashes.values())) == 1, hashes
