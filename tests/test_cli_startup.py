"""``import hf_sms``, ``hf-sms --help`` and ``hf-sms inspect`` start without torch (what makes them answer in well
under 2 s: ``benchmarks/cli_startup.py`` times them), and importing nothing up front loses nothing: a bitmask folder
still loads through ``from_pretrained`` after ``import hf_sms``, and ``inspect`` reports what the torch readers do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from torch import nn

import hf_sms
from hf_sms.checkpoint.reader import SparseCheckpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _soup(folder: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).to(torch.bfloat16)
    hf_sms.apply_masks(model, hf_sms.compute_masks(model, 0.7))
    with torch.no_grad():
        model[0].weight[0, :] = -0.0  # negative zeros count as zeros, as `tensor != 0` says
        model[0].bias[0] = -0.0
    return hf_sms.save_sparse(model, folder)


def test_help_and_inspect_import_no_torch(tmp_path):
    folder = _soup(str(tmp_path / "soup"))
    code = (
        "import sys, json\n"
        "from hf_sms.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        f"assert main(['inspect', {folder!r}, '--json']) == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout[done.stdout.index("{\n") :])
    assert report["integrity"] == "verified" and report["sparsity_json"] == "matches"
    # the same figures as the torch reader measures
    ckpt = SparseCheckpoint(folder)
    stats = ckpt.mask_stats(n for n in ckpt.names() if n.endswith("weight")).summary()
    assert (report["nnz"], report["numel"], report["mask_hash"]) == (stats["nnz"], stats["numel"], stats["mask_hash"])


def test_import_hf_sms_imports_no_torch_and_from_pretrained_still_decodes(tmp_path):
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37))
    hf_sms.apply_masks(model, hf_sms.compute_masks(model, 0.6))
    folder = hf_sms.save_sparse(model, str(tmp_path / "bert"))
    code = (
        "import sys\n"
        "import hf_sms\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "from transformers import AutoModel\n"
        f"loaded = AutoModel.from_pretrained({folder!r})\n"
        "w = loaded.encoder.layer[0].intermediate.dense.weight\n"
        "print(float((w == 0).float().mean()))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) > 0.5
