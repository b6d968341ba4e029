"""Replicas larger than one device (issue 35 item 5): FSDP2 (``fully_shard``) on 2 CPU processes with gloo. Masks
are sharded like their weights, pruned weights stay exactly zero after every step (optimizers that keep zeros and
one that does not), the soup is averaged shard by shard, saved from the shards, and equals the soup of the same
replicas trained in one process without sharding."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import launch
from sharded_task import OPTIMS, REPLICAS, STEPS, batch, build, pruned_start

from hf_sms import load_sparse
from hf_sms.pruning.enforcement import ExactMasking, MaskEnforcer
from hf_sms.pruning.masks import masks_from_model
from hf_sms.soup import average_state_dicts

REPO = str(Path(__file__).parent.parent)
SCRIPT = Path(__file__).parent / "scripts" / "fsdp_replicas.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def _reference(optim: str) -> dict:
    """The same replicas in one process, unsharded, on whole batches; their uniform soup."""
    start, masks = pruned_start()
    states = []
    for i in range(REPLICAS):
        model = build()
        model.load_state_dict(start.state_dict())
        policy = ExactMasking()
        policy.bind(MaskEnforcer(model, masks))
        opt = OPTIMS[optim](model.parameters())
        policy.start(opt)
        for step in range(STEPS):
            x, y = batch(i, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            policy.before_step()
            opt.step()
            policy.after_step(opt)
            opt.zero_grad()
        states.append(model.state_dict())
    return average_state_dicts(states)


@pytest.mark.parametrize("optim", ["adamw", "rmsprop"])
def test_fsdp2_replicas_keep_the_mask_and_soup_as_one_process_does(tmp_path, optim):
    launch(SCRIPT, tmp_path, optim, nproc=2)
    checks = json.loads((tmp_path / "checks.json").read_text())
    kept = sum(int(m.sum()) for m in pruned_start()[1].values()) / sum(m.numel() for m in pruned_start()[1].values())
    assert [checks.pop(f"logged_sparsity{i}") for i in range(REPLICAS)] == [pytest.approx(1 - kept)] * REPLICAS
    assert checks == {"exact_after_every_step": True, "mask_shard_shapes": True, "soup_mask_is_the_mask": True}
    soup = load_sparse(str(tmp_path / "soup"), model=build())
    expected = _reference(optim)
    _, masks = pruned_start()
    for k, v in soup.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6)
    found = masks_from_model(soup)
    assert all(torch.equal(found[k], masks[k]) for k in masks)  # the soup's zeros are exactly the mask
    assert not torch.equal(soup.state_dict()["head.weight"], pruned_start()[0].state_dict()["head.weight"])


def test_replicas_are_sharded_block_by_block_outermost_first():
    """The units a replica is sharded by (replica_sharding="fsdp"): a LLaMA's decoder layers (transformers'
    _no_split_modules), timm's residual blocks (not the downsample inside one), a plain Sequential's layers."""
    from conftest import make_resnet
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_sms.training.sharding import _blocks

    def units(model):
        names = frozenset(getattr(model, "_no_split_modules", None) or ())
        found = {id(m) for m in _blocks(model, names)}
        return [n for n, m in model.named_modules() if id(m) in found]

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    assert units(LlamaForCausalLM(config)) == ["model.layers.0", "model.layers.1"]
    assert units(make_resnet()) == [f"layer{i}.0" for i in (1, 2, 3, 4)]
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    assert units(plain) == ["0", "2"]


def test_causal_lm_replica_sharded_over_two_processes(tmp_path, fork_server):
    """--replica_sharding fsdp in the causal-LM recipe on 2 processes, m = 1, one phase (transformers' decoder layers
    sharded one by one, tied embeddings in the root): every row equals the same group training data-parallel, and the
    soup loads with plain transformers. (Here, not in test_smoke.py: this file is short, so its worker is not the
    last.)"""
    from conftest import untimed
    from transformers import AutoModelForCausalLM

    import hf_sms

    runs, logs = {}, {}
    for mode in ("none", "fsdp"):
        runs[mode] = tmp_path / mode
        argv = ["--smoke", "--num_replicas", "1", "--n_phases", "1", "--replica_sharding", mode, "--output_dir",
                str(runs[mode])]  # fmt: skip
        proc = fork_server.run(Path(REPO) / "recipes" / "causal_lm.py", argv, cwd=tmp_path,
                               env={"TMPDIR": str(tmp_path)}, timeout=600, nproc=2)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        logs[mode] = proc.stderr
    plain, sharded = (json.loads((runs[m] / "results.json").read_text()) for m in ("none", "fsdp"))
    assert untimed(sharded["rows"]) == untimed(plain["rows"])
    assert {"sms_uniform", "imp", "imp_mx"} <= set(sharded["rows"])
    assert logs["fsdp"].count("sharded over 2 processes (FSDP2)") == 3 * 2  # SMS, IMP, IMP_mx; 2 ranks
    assert "FSDP2" not in logs["none"]
    model = AutoModelForCausalLM.from_pretrained(runs["fsdp"] / "final_soup")
    assert hf_sms.sparsity_report(model)["sparsity"] == pytest.approx(0.5, abs=1e-3)


def test_the_trainer_binds_its_masks_again_when_the_model_is_sharded_as_training_starts(tmp_path):
    """transformers' ``fsdp`` arguments: accelerate shards the model in place when training starts, after the trainer
    bound its masks to the parameters it had; the masks must follow the new (DTensor) parameters, and save_model's
    gathered plain model must hold the trained tensors (a GPU ran the real path: docs/benchmarks.md, step (i))."""
    from transformers import LlamaForCausalLM

    script = Path(__file__).parent / "scripts" / "trainer_sharded_late.py"
    launch(script, tmp_path, nproc=2)
    checks = json.loads((tmp_path / "checks.json").read_text())
    assert checks.pop("plain_class") == "LlamaForCausalLM"
    assert all(checks.values()), checks
    saved = load_sparse(str(tmp_path / "saved"))
    assert isinstance(saved, LlamaForCausalLM) and saved.lm_head.weight is saved.model.embed_tokens.weight
