"""Shared fixtures: tiny models built from configs (no downloads), small datasets, trainer arguments."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

# A run must not fail by chance: each property test draws its examples from a seed fixed by its code, the same in CI
# and here (HYPOTHESIS_PROFILE=explore draws fresh ones, to look for new counterexamples).
# (No health check times example generation either: a loaded machine is not a failing property.)
settings.register_profile(
    "fixed", derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

ROOT = Path(__file__).parent.parent


def finished(out: Path, name: str = "sparsity.json") -> list[Path]:
    """The files ``name`` of finished results under ``out``: not those in a temporary ``.hf_sms-*`` folder, which a
    kill can leave mid-write and a resumed run rightly removes."""
    from hf_sms.checkpoint.constants import TMP_PREFIX

    return sorted(p for p in out.rglob(name) if not any(part.startswith(TMP_PREFIX) for part in p.parts))


# Tiny models run faster on one thread than on two fighting ones; so do the processes tests start (torch reads
# OMP_NUM_THREADS when it is imported): two threads beside another job ran 2.5x slower (docs/benchmarks.md, issue 21).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


class TinyCNN(nn.Module):
    """A plain ``nn.Module`` with every kind of parameter the pruning code must tell apart."""

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 8)
        self.fc1 = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.gn(self.conv2(x)))
        x = x.mean(dim=(2, 3))
        return self.fc2(torch.relu(self.ln(self.fc1(x))))


def eval_output(model, batch):
    """``model``'s eval-mode output on ``batch`` (logits where it has them), as float."""
    model.eval()
    with torch.no_grad():
        out = model(**batch) if isinstance(batch, dict) else model(batch)
    return (out.logits if hasattr(out, "logits") else out).float()


def without_hf_sms(code: str) -> str:
    """Run ``code`` in a new Python that fails if it ever imports hf_sms; its stdout."""
    guard = "import sys\nclass _No:\n    def find_spec(self, name, *a):\n        if name.split('.')[0] == 'hf_sms':\n"
    guard += "            raise ImportError('hf_sms imported')\nsys.meta_path.insert(0, _No())\n"
    result = subprocess.run([sys.executable, "-c", guard + code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def make_cnn(num_classes: int = 4, seed: int = 0) -> TinyCNN:
    torch.manual_seed(seed)
    return TinyCNN(num_classes)


def make_resnet(num_classes: int = 4, seed: int = 0):
    """A timm ResNet-18 layout with one block per stage and narrow channels (~10k parameters)."""
    import timm

    torch.manual_seed(seed)
    return timm.create_model(
        "resnet18",
        pretrained=False,
        num_classes=num_classes,
        layers=(1, 1, 1, 1),
        channels=(8, 16, 16, 16),
        stem_width=8,
    )


def make_pspnet(seed: int = 0):
    """An smp PSPNet with a 3-stage timm ResNet-18 encoder and 16 PSP channels, 2 classes (0.7M weights: smp's own
    ``resnet18`` would keep its two unused stages, 11M weights that only cost time and disk)."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(seed)
    return smp.PSPNet(encoder_name="tu-resnet18", encoder_weights=None, encoder_depth=3, classes=2, psp_out_channels=16)


def make_t5(seed: int = 0):
    """A 1+1 layer T5 with d_model=16 over ByT5's byte vocabulary (384 ids); lm_head is tied to shared."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=384,
        d_model=16,
        d_ff=32,
        d_kv=8,
        num_heads=2,
        num_layers=1,
        num_decoder_layers=1,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        initializer_factor=0.1,  # keeps the initial loss near log(384) so a few steps show learning
    )
    return T5ForConditionalGeneration(config)


_SAME_WIDTH_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


# A minimal results.json of one run, one phase, one process (hf-sms table / timeline).
RUN = {
    "phases": [0.5],
    "rows": {"sms_uniform": [{"sparsity": 0.5, "test": 90.0}]},
    "world": {
        "processes": 1,
        "groups": 1,
        "seconds": 2.0,
        "jobs": [{"job": "sms/phase1/replica0", "rank": 0, "group": 0, "kind": "train", "start": 0.0, "end": 1.5}],
    },
}


def forget_manifest(folder) -> None:
    """Make a folder's sparsity.json one saved before the manifest (format version 1, no ``files``): a test that
    rewrites a weight file on purpose reaches the checks behind the manifest's (which refuses any rewrite; a
    version-2 folder without its manifest is refused outright)."""
    import json
    from pathlib import Path

    path = Path(folder) / "sparsity.json"
    info = json.loads(path.read_text())
    info.pop("files", None)
    info["hf_sms_format_version"] = 1
    path.write_text(json.dumps(info))


def untimed(rows: dict) -> dict:
    """A run's rows without their measured speedups (timings differ between runs; everything else must not)."""
    return {m: [{k: v for k, v in r.items() if k != "measured_speedup"} for r in rs] for m, rs in rows.items()}


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor with -0.0 folded into +0.0 (pruned weights load as +0.0)."""
    return (t + 0.0).view(_SAME_WIDTH_INT[t.dtype])


@pytest.fixture(autouse=True)
def _old_objects_frozen():
    """What is alive before a test (imported libraries, session fixtures) leaves the cyclic collector's scans: the
    loop collects after every replica (so does accelerate), and a full scan of transformers' objects takes 0.25 s."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def cnn():
    return make_cnn()


@pytest.fixture
def resnet():
    return make_resnet()


@pytest.fixture
def t5():
    return make_t5()


@pytest.fixture(scope="session")
def byt5_tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()  # byte-level: needs no vocabulary file


@pytest.fixture(scope="session")
def t5_dataset(byt5_tokenizer):
    """A copy task: the target is the input bytes."""
    words = ["sparse", "model", "soups", "prune", "merge", "train", "hello", "world"]
    enc = byt5_tokenizer(words, padding="max_length", max_length=8, truncation=True, return_tensors="pt")
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    return [
        {"input_ids": enc.input_ids[i], "attention_mask": enc.attention_mask[i], "labels": labels[i]} for i in range(8)
    ]


def make_image_dataset(n: int = 32, num_classes: int = 4, size: int = 8, seed: int = 0) -> list[dict]:
    """Images whose class is the colour channel holding a bright blob (channel 0 for class 3), plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g) * 0.5
    y = torch.arange(n) % num_classes
    for i in range(n):
        x[i, int(y[i]) % 3, 2:6, 2:6] += 2.0 if y[i] < 3 else -2.0
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


@pytest.fixture(scope="session")
def image_dataset():
    return make_image_dataset()


@pytest.fixture
def out_dir(tmp_path):
    return str(tmp_path / "out")


def training_args(output_dir: str, cls=None, **overrides):
    """TrainingArguments (or ``cls``, e.g. SparseSoupConfig) for fast, quiet, offline CPU tests."""
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=output_dir,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        per_device_train_batch_size=8,
        max_steps=10,
        learning_rate=1e-2,
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return (cls or TrainingArguments)(**kwargs)


@pytest.fixture
def make_args(out_dir):
    """``make_args(cls=None, **overrides)``: :func:`training_args` writing to the test's temp dir."""
    return lambda cls=None, **overrides: training_args(out_dir, cls, **overrides)


def sms_config(tmp_path, **overrides):
    """A SparseSoupConfig for fast CPU runs of the SMS loop on digits, in ``tmp_path / "run"`` (or the given
    ``output_dir``); tests override what they exercise."""
    from hf_sms import SparseSoupConfig

    base = dict(
        output_dir=str(tmp_path / "run") if tmp_path is not None else None,
        target_sparsity=0.8,
        n_phases=2,
        num_replicas=2,
        max_steps=4,
        per_device_train_batch_size=32,
        learning_rate=0.05,
        optim="sgd",
        use_cpu=True,
        disable_tqdm=True,
        report_to="none",
        seed=0,
    )
    return SparseSoupConfig(**{**base, **overrides})


@contextmanager
def fake_hub(repo_id: str = "me/r"):
    """``HfApi.create_repo`` and ``create_commit`` mocked: yields ``{"files": {path in repo: bytes}, "create",
    "commit"}`` of what push_to_hub would send (the bytes read as huggingface_hub reads them)."""
    sent: dict = {"files": {}}

    def commit(self, **kwargs):
        for op in kwargs["operations"]:
            source = op.path_or_fileobj
            if isinstance(source, str):
                with open(source, "rb") as f:
                    source = f.read()
            sent["files"][op.path_in_repo] = source
        sent["commit_kwargs"] = kwargs
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc", pr_url=None)

    create = mock.patch("huggingface_hub.HfApi.create_repo", return_value=SimpleNamespace(repo_id=repo_id))
    with create as sent["create"], mock.patch("huggingface_hub.HfApi.create_commit", commit):
        with mock.patch("huggingface_hub.HfApi._validate_yaml", create=True):  # a card's YAML checked online
            yield sent


def copy_task_rows(n: int = 40) -> list[dict]:
    """A byte-level seq2seq task for tiny T5s: "copy i" -> "i" (ByT5's tokenizer needs no files)."""
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    src = tok([f"copy {i}" for i in range(n)], padding="max_length", max_length=12)
    tgt = tok([f"{i}" for i in range(n)], padding="max_length", max_length=6)["input_ids"]
    return [
        {"input_ids": torch.tensor(s), "attention_mask": torch.tensor(a), "labels": torch.tensor(t)}
        for s, a, t in zip(src["input_ids"], src["attention_mask"], tgt)
    ]


@torch.no_grad()
def neg_loss(model, dataset) -> float:
    """A metric for models that return their loss: minus the loss on the whole dataset in one batch."""
    model.eval()
    return -float(model(**{k: torch.stack([r[k] for r in dataset]) for k in dataset[0]}).loss)


# A top-1 accuracy ``evaluate`` module as a local script: evaluate.load(path) needs no download.
TOP1_METRIC_SCRIPT = """
import datasets
import evaluate


class Top1(evaluate.Metric):
    def _info(self):
        features = datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")})
        return evaluate.MetricInfo(description="top-1", citation="", inputs_description="", features=features)

    def _compute(self, predictions, references):
        return {"accuracy": sum(int(p == r) for p, r in zip(predictions, references)) / len(references)}
"""


# -- a fork server: Python scripts as fresh processes without paying their imports each time ---------------------
_ZYGOTE = r"""
import atexit, json, os, sys, tempfile, traceback
import torch, transformers, timm, peft, datasets, hf_sms
from hf_sms import SparseSoupTrainer, run_sms  # noqa: F401  (the lazy names scripts reach)
import gc
gc.collect()
gc.freeze()  # the imports leave the cyclic collector's scans (and stay shared with the children, as Python advises)


def child(request, rank):
    code = 1
    try:
        os.environ.update(request["env"])
        suffix = ""
        if rank is not None:  # what torchrun gives each of its processes
            n = str(request["ranks"])
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=n, LOCAL_WORLD_SIZE=n, GROUP_RANK="0",
                              ROLE_RANK=str(rank), ROLE_WORLD_SIZE=n, MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(request["port"]))
            suffix = f".{rank}"
        tempfile.tempdir = None  # TMPDIR as the request sets it
        os.chdir(request["cwd"])
        for fd, name in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(name + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = [request["script"], *request["argv"]]
        sys.path[0] = os.path.dirname(request["script"])
        source = compile(open(request["script"]).read(), request["script"], "exec")
        exec(source, {"__name__": "__main__", "__file__": request["script"]})
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the script registered (a temporary folder, its process group's end)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    pids = []
    for rank in range(request["ranks"]) if request.get("ranks") else [None]:
        pid = os.fork()
        if pid == 0:
            child(request, rank)
        pids.append(pid)
    print(json.dumps({"pids": pids}), flush=True)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(json.dumps({"status": next((c for c in codes if c), 0)}), flush=True)
"""


class ForkServer:
    """Runs Python scripts as ``python script argv...`` would, each in a process of its own forked from one that
    imported torch, transformers and hf_sms once: a script costs its own work, not ~5-9 s of imports."""

    def __init__(self):
        import json

        self._json = json
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )

    def _reply(self, timeout: float):
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self._json.loads(self.proc.stdout.readline()) if ready else None

    def run(self, script, argv=(), cwd=".", env=None, timeout: float = 600, nproc: int = 1) -> SimpleNamespace:
        """``returncode``, ``stdout``, ``stderr`` of the script; ``returncode`` None if it ran past ``timeout``.
        ``nproc`` > 1: that many processes with torchrun's variables (rank, world size, a free port), their outputs
        joined in rank order, the first non-zero exit code."""
        result = self._run(script, argv, cwd, env, timeout, nproc)
        if nproc > 1 and result.returncode and "address already in use" in result.stderr.lower():
            # the free port was taken by another test's process between our probe and rank 0's bind: once more
            result = self._run(script, argv, cwd, env, timeout, nproc)
        return result

    def _run(self, script, argv, cwd, env, timeout, nproc) -> SimpleNamespace:
        import signal
        import socket
        import tempfile

        out = tempfile.mkdtemp(dir=cwd)
        request = {"script": str(script), "argv": [str(a) for a in argv], "cwd": str(cwd), "env": dict(env or {})}
        request.update(stdout=os.path.join(out, "stdout"), stderr=os.path.join(out, "stderr"))
        if nproc > 1:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                request.update(ranks=nproc, port=s.getsockname()[1])
        self.proc.stdin.write(self._json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pids, done = self._reply(60)["pids"], self._reply(timeout)
        if done is None:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            self._reply(60)
        suffixes = [f".{r}" for r in range(nproc)] if nproc > 1 else [""]

        def read(name):
            return "".join(open(request[name] + suffix).read() for suffix in suffixes)

        return SimpleNamespace(returncode=done and done["status"], stdout=read("stdout"), stderr=read("stderr"))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


_SERVER: list[ForkServer] = []


def fork_server_of_this_process() -> ForkServer:
    """This test process's fork server, started when first needed and stopped at its exit."""
    if not _SERVER:
        import atexit

        _SERVER.append(ForkServer())
        atexit.register(_SERVER[0].close)
    return _SERVER[0]


@pytest.fixture(scope="session")
def fork_server():
    return fork_server_of_this_process()


def launch(script, *args, nproc: int = 1, timeout: float = 300, cwd=None) -> str:
    """``python script args`` (``torchrun --nproc_per_node nproc`` for several processes) as a fresh process forked
    from this process's fork server; its stdout; the test fails with its output if it fails."""
    import tempfile

    cwd = cwd or tempfile.mkdtemp()
    proc = fork_server_of_this_process().run(script, args, cwd=cwd, timeout=timeout, nproc=nproc)
    if proc.returncode is None:
        pytest.fail(f"{script} ran longer than {timeout} s:\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.fixture(scope="session")
def smaller_folder(tmp_path_factory):
    """A Bloom whose FFN its config cannot state, cut in place at 50%: saved with the defaults, ``model.pt2``."""
    from zoo import _hf, _tokens

    import hf_sms

    model = _hf("BloomForCausalLM", "BloomConfig", vocab_size=64, hidden_size=16, n_layer=2, n_head=2)().eval()
    x = _tokens()
    hf_sms.apply_masks(model, hf_sms.compute_masks(model, 0.5, structure="neurons", example_inputs=x))
    folder = tmp_path_factory.mktemp("bloom") / "small"
    hf_sms.save_sparse(hf_sms.shrink(model, x, structure="neurons"), str(folder), "dense", example_inputs=x)
    assert (folder / "model.pt2").is_file()
    return folder
