"""The recipes end to end on tiny models and local files (no Hub): T5, timm ResNet/MaxViT, smp PSPNet, and
ResNet-18 / WRN-20 on CIFAR-shaped data with pretraining, CIFAR-C and subgroups (tests/test_smoke.py runs
every recipe's --smoke as a subprocess)."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_cnn, make_image_dataset
from PIL import Image

from hf_sms import SparseSoupConfig, load_sparse
from hf_sms.cli.scripts import DataArguments, OODArguments, parse_args, prepared_splits, pretrain
from hf_sms.cli.smoke import smoke_classification

RECIPES = Path(__file__).parent.parent / "recipes"


def _recipe(name):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _types(module) -> tuple:
    """The dataclasses a recipe's __main__ parses (cifar also takes OODArguments)."""
    ood = (OODArguments,) if getattr(module, "OODArguments", None) is OODArguments else ()
    return (module.ModelArguments, DataArguments, *ood, SparseSoupConfig)


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "run"),
        target_sparsity=0.5,
        n_phases=1,
        num_replicas=2,
        max_steps=2,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-3,
        optim="adamw_torch",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return SparseSoupConfig(**{**base, **kw})


def _check_run(tmp_path, metric_range=(0.0, 100.0)):
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    row = results["rows"]["sms_uniform"][0]
    assert row["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert metric_range[0] <= row["test"] <= metric_range[1]
    assert (tmp_path / "run" / "final_soup" / "sparsity.json").is_file()
    return results


def test_parse_args_reads_yaml_and_flags_override(tmp_path):
    t5 = _recipe("t5_wmt16")
    config = tmp_path / "c.yaml"
    config.write_text("output_dir: x\nnum_replicas: 5\ntarget_lang: ro\n")
    model, data, args = parse_args(
        t5.ModelArguments, DataArguments, SparseSoupConfig, argv=["--config", str(config), "--num_replicas", "2"]
    )
    assert (model.target_lang, args.num_replicas, args.output_dir) == ("ro", 2, "x")
    config.write_text("output_dir: x\nnum_replica: 5\n")
    with pytest.raises(ValueError, match=r"unknown keys \['num_replica'\]"):
        parse_args(t5.ModelArguments, DataArguments, SparseSoupConfig, argv=["--config", str(config)])


def test_shipped_configs_parse():
    shipped = {  # config: (recipe, the split reported as test)
        "t5_wmt16": ("t5_wmt16", "test"),
        "resnet50_imagenet": ("image_classification", "validation"),
        "maxvit_imagenet": ("image_classification", "validation"),
        "pspnet_cityscapes": ("pspnet_segmentation", "validation"),
        "resnet18_cifar10": ("cifar", "test"),
        "wrn20_cifar100": ("cifar", "test"),
        "resnet18_celeba": ("cifar", "test"),
        "llama_wikitext2": ("causal_lm", "test"),
    }
    llr = {"llama_wikitext2"}  # a public LLM whose original schedule is not known: LLR, as the paper's code falls to
    assert {p.stem for p in (RECIPES / "configs").glob("*.yaml")} == set(shipped)
    for name, (recipe, test_split) in shipped.items():
        module = _recipe(recipe)
        argv = ["--config", str(RECIPES / "configs" / f"{name}.yaml"), "--bf16", "false"]
        model, data, *_, args = parse_args(*_types(module), argv=argv)
        assert (
            (args.retrain_schedule == "llr")
            if name in llr
            else (args.retrain_schedule == "allr" and args.pretrain_epochs > 0)
        )
        assert data.test_split == test_split == data.with_defaults(**module.DATA_DEFAULTS).test_split


def test_recipes_share_one_data_arguments():
    data_fields = {f.name for f in dataclasses.fields(DataArguments)}
    for name in ("t5_wmt16", "image_classification", "pspnet_segmentation", "cifar", "causal_lm"):
        module = _recipe(name)
        assert module.DataArguments is DataArguments
        assert not data_fields & {f.name for f in dataclasses.fields(module.ModelArguments)}, name
        assert set(module.DATA_DEFAULTS) <= data_fields, name
        # every field of the dataclasses is a flag, with no name taken twice
        model, data, *_ = parse_args(*_types(module), argv=["--output_dir", "o"])
        assert isinstance(data, DataArguments) and data.test_split is None


def test_data_arguments_defaults_and_limits():
    import datasets

    t5 = _recipe("t5_wmt16")
    resolved = DataArguments(test_split="newstest").with_defaults(**t5.DATA_DEFAULTS)
    # the paper validates on 10% of train: no validation split by default (de-en, as the paper)
    assert (resolved.dataset_name, resolved.dataset_config, resolved.validation_split, resolved.test_split) == (
        "wmt16",
        "de-en",
        None,
        "newstest",
    )
    assert resolved.hub_datasets == ["wmt16"]
    local = DataArguments(train_file="train.jsonl", validation_file="dev.jsonl").with_defaults(**t5.DATA_DEFAULTS)
    assert (local.dataset_name, local.validation_split, local.hub_datasets) == (None, "validation", [])

    raw = datasets.DatasetDict({s: datasets.Dataset.from_dict({"a": list(range(20))}) for s in ("train", "test")})
    data = DataArguments(test_split="test", max_train_samples=5, max_eval_samples=1, max_test_samples=3)
    train, val, test = prepared_splits(raw, lambda data, training: data, SparseSoupConfig("o"), data)
    assert (len(train), len(val), len(test)) == (5, 1, 3)
    train, val, test = prepared_splits(raw, lambda data, training: data, SparseSoupConfig("o"), DataArguments())
    assert (len(train), len(val), test) == (18, 2, None)  # validation_fraction 0.1 of train; no test split named


@pytest.mark.parametrize("validation_file", [False, True], ids=["split-off", "own-file"])
def test_t5_recipe_on_local_json(tmp_path, validation_file):
    from conftest import make_t5
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    make_t5().save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    for split, n in (("train", 40), ("dev", 6), ("test", 8)):
        lines = [json.dumps({"translation": {"en": f"{split} {i}", "de": f"Haus {i}"}}) for i in range(n)]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines))
    t5 = _recipe("t5_wmt16")
    model = t5.ModelArguments(
        model_name_or_path=str(tmp_path / "model"),
        target_lang="de",
        source_prefix="",  # keeps each short source whole, so the test can tell which file it came from
        max_source_length=16,
        max_target_length=8,
    )
    data = DataArguments(
        train_file=str(tmp_path / "train.jsonl"),
        validation_file=str(tmp_path / "dev.jsonl") if validation_file else None,
        test_file=str(tmp_path / "test.jsonl"),
    )
    runner = t5.main(model, data, _args(tmp_path))
    _check_run(tmp_path)
    assert (tmp_path / "run" / "final_soup" / "tokenizer_config.json").is_file()
    val_sources = {tok.decode(item["input_ids"], skip_special_tokens=True) for item in runner.eval_dataset}
    assert len(runner.test_dataset) == 8
    if validation_file:  # the dataset's own dev split; train stays whole
        assert len(runner.train_dataset) == 40
        assert val_sources == {f"dev {i}" for i in range(6)}
    else:  # validation_fraction of train, the rest trains
        assert (len(runner.train_dataset), len(runner.eval_dataset)) == (36, 4)
        train_sources = {tok.decode(item["input_ids"], skip_special_tokens=True) for item in runner.train_dataset}
        assert val_sources.isdisjoint(train_sources) and all("train" in s for s in val_sources)


def test_prepared_splits_refuses_test_as_validation():
    import datasets

    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"a": list(range(10))})})
    raw["validation"] = raw["train"]
    data = DataArguments(validation_split="validation", test_split="validation")
    with pytest.raises(ValueError, match="cannot also be the validation set"):
        prepared_splits(raw, lambda data, training: data, SparseSoupConfig("o"), data)


def _imagefolder(root: Path, n: int = 8, size: int = 24):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for label, shade in (("dark", 40), ("light", 210)):
            (root / split / label).mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(rng.normal(shade, 20, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / label / f"{i}.png")


@pytest.mark.parametrize(
    ("model_name", "model_kwargs"),
    [
        ("resnet10t", None),
        (
            "maxvit_rmlp_nano_rw_256",
            '{"img_size": 32, "embed_dim": [8, 8, 8, 8], "depths": [1, 1, 1, 1], '
            '"stem_width": 8, "transformer_dim_head": 4}',
        ),
    ],
    ids=["resnet", "maxvit"],
)
def test_image_classification_recipe_on_an_imagefolder(tmp_path, model_name, model_kwargs):
    import random

    import datasets
    import timm

    _imagefolder(tmp_path / "images")
    recipe = _recipe("image_classification")
    model = recipe.ModelArguments(
        model_name=model_name, pretrained=False, model_kwargs=model_kwargs, image_size=32, label_smoothing=0.1
    )
    data = DataArguments(dataset_name="imagefolder", data_dir=str(tmp_path / "images"), test_split="test")
    args = _args(tmp_path, optim="sgd", learning_rate=0.01)
    runner = recipe.main(model, data, OODArguments(), args)
    _check_run(tmp_path)
    if model_kwargs:  # the tiny MaxViT from model_kwargs, not the 15M-parameter default
        assert sum(p.numel() for p in runner.pretrained.parameters()) < 50_000

    # Validation is split off the raw train images and gets the deterministic eval transform.
    raw = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "images"))["train"]
    raw = raw.train_test_split(test_size=args.validation_fraction, seed=args.seed)
    data_cfg = {**timm.data.resolve_data_config(model=runner.pretrained), "input_size": (3, 32, 32)}
    eval_tf = timm.data.create_transform(**data_cfg, is_training=False)
    train_tf = timm.data.create_transform(**data_cfg, is_training=True)
    assert (len(runner.train_dataset), len(runner.eval_dataset)) == (len(raw["train"]), len(raw["test"]))
    for i, item in enumerate(runner.eval_dataset):
        assert torch.equal(item["x"], runner.eval_dataset[i]["x"])
        assert torch.equal(item["x"], eval_tf(raw["test"][i]["image"].convert("RGB")))
        assert item["labels"] == raw["test"][i]["label"]

    # Train items are random crops: the training transform under the same seeds, not the eval one.
    def seeded(fn, seed):
        random.seed(seed)  # timm's random-resized crop draws from random, torchvision's flips from torch
        torch.manual_seed(seed)
        return fn()

    image = raw["train"][0]["image"].convert("RGB")
    x0, x1 = (seeded(lambda: runner.train_dataset[0]["x"], seed) for seed in (0, 1))
    assert torch.equal(x0, seeded(lambda: train_tf(image), 0))
    assert not torch.equal(x0, x1) and not torch.equal(x0, eval_tf(image))


def test_pspnet_recipe_on_a_saved_dataset(tmp_path):
    import datasets

    rng = np.random.default_rng(0)

    def split(n):
        images, masks = [], []
        for _ in range(n):
            mask = np.zeros((24, 24), dtype=np.uint8)
            mask[:, 12:] = 1
            mask[0, 0] = 255  # ignored
            images.append(Image.fromarray((rng.random((24, 24, 3)) * 50 + mask[..., None] * 150).astype(np.uint8)))
            masks.append(Image.fromarray(mask))
        return datasets.Dataset.from_dict({"image": images, "mask": masks}).cast_column("image", datasets.Image())

    datasets.DatasetDict({"train": split(8), "validation": split(4)}).save_to_disk(tmp_path / "seg")
    recipe = _recipe("pspnet_segmentation")
    model = recipe.ModelArguments(encoder_name="tu-resnet18", encoder_weights=None, num_classes=2, crop_size=32)
    model.encoder_depth, model.output_stride = 3, 32  # small: the data path is what is checked
    data = DataArguments(dataset_path=str(tmp_path / "seg"))
    args = _args(tmp_path, optim="sgd", learning_rate=0.01)
    runner = recipe.main(model, data, args)
    _check_run(tmp_path)

    # Validation comes from the raw train split, resized and normalised but never flipped.
    raw = datasets.load_from_disk(tmp_path / "seg")["train"]
    raw = raw.train_test_split(test_size=args.validation_fraction, seed=args.seed)

    def resized(image):
        x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
        x = torch.nn.functional.interpolate(x[None], (32, 32), mode="bilinear", align_corners=False)[0]
        return (x - recipe.MEAN) / recipe.STD

    assert (len(runner.train_dataset), len(runner.eval_dataset)) == (len(raw["train"]), len(raw["test"]))
    for i, item in enumerate(runner.eval_dataset):
        assert torch.equal(item["x"], resized(raw["test"][i]["image"]))
        assert item["labels"][0, 0] == -100 and item["labels"].shape == (32, 32)
    # Train items are flipped at random: both orientations show up over a few draws.
    plain = resized(raw["train"][0]["image"])
    torch.manual_seed(0)
    draws = [runner.train_dataset[0]["x"] for _ in range(12)]
    assert any(torch.equal(x, plain) for x in draws) and any(torch.equal(x, plain.flip(-1)) for x in draws)
    assert all(torch.equal(x, plain) or torch.equal(x, plain.flip(-1)) for x in draws)


def test_smoke_flag_layers_over_yaml_under_flags(tmp_path):
    t5 = _recipe("t5_wmt16")
    config = tmp_path / "c.yaml"
    config.write_text("output_dir: real-run\nnum_replicas: 5\nmax_source_length: 99\nbf16: true\n")

    def smoke(folder):
        assert Path(folder).is_dir()
        return {"max_source_length": 7, "not_a_field_of_this_recipe": 1}

    argv = ["--config", str(config), "--smoke", "--num_replicas", "4"]
    model, data, args = parse_args(t5.ModelArguments, DataArguments, SparseSoupConfig, argv=argv, smoke=smoke)
    assert model.max_source_length == 7  # the hook beats the YAML
    assert (args.num_replicas, args.output_dir, args.use_cpu, args.bf16) == (4, "smoke-output", True, False)
    with pytest.raises(ValueError, match="no --smoke"):
        parse_args(t5.ModelArguments, DataArguments, SparseSoupConfig, argv=["--smoke"])


def test_pretrain_follows_the_pretrain_shape_and_is_reused(tmp_path):
    from transformers import TrainerCallback

    from hf_sms.training.schedules import PRETRAIN_SHAPES

    class Rates(TrainerCallback):
        def __init__(self):
            self.rates = []

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            self.rates.append(optimizer.param_groups[0]["lr"])

    data = make_image_dataset(n=32)  # 4 steps per epoch at batch 8
    args = _args(tmp_path, pretrain_epochs=5, pretrain_schedule="step", pretrain_learning_rate=0.1, optim="sgd")
    args = dataclasses.replace(args, learning_rate=0.05, per_device_train_batch_size=8, max_steps=2)
    model, rates, folder = make_cnn(), Rates(), str(tmp_path / "dense")
    assert pretrain(model, args, data, folder, callbacks=[rates]) is model
    # 20 steps (max_steps is the retraining's), from eta_max along the very shape ALLR/LRW/SLR are told
    assert rates.rates == pytest.approx([PRETRAIN_SHAPES["step"](k / 20, 0.1, 0.0) for k in range(20)])
    assert rates.rates[9:11] == pytest.approx([0.1, 0.01]) and rates.rates[-1] == pytest.approx(0.001)

    again, rates = make_cnn(seed=1), Rates()
    pretrain(again, args, data, folder, callbacks=[rates])  # a rerun loads the finished pretraining
    assert rates.rates == [] and all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))
    with pytest.raises(ValueError, match="pretrained with"):
        pretrain(make_cnn(), dataclasses.replace(args, pretrain_epochs=6), data, folder)


def test_cifar_models():
    from hf_sms.families import family_of

    cifar = _recipe("cifar")
    resnet = cifar.build_model(cifar.ModelArguments(), 10)  # timm's resnet18 with the CIFAR stem
    assert (resnet.conv1.kernel_size, resnet.conv1.stride, type(resnet.maxpool)) == ((3, 3), (1, 1), torch.nn.Identity)
    assert sum(p.numel() for p in resnet.parameters()) == 11_173_962  # the paper's "11 Mio"
    assert family_of(resnet).library == "torch"  # timm would rebuild the ImageNet stem from its config
    assert resnet(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    imagenet = cifar.build_model(cifar.ModelArguments(cifar_stem=False), 2)
    assert family_of(imagenet).library == "timm" and imagenet.conv1.kernel_size == (7, 7)
    wrn = cifar.build_model(cifar.ModelArguments(model_name="wrn20"), 100)  # depth 22, widen 10, as the paper's code
    assert sum(p.numel() for p in wrn.parameters()) == 26_863_460  # the paper's "26 Mio"
    assert sum(isinstance(m, cifar.WideBlock) for m in wrn.modules()) == 9
    assert wrn(torch.zeros(2, 3, 32, 32)).shape == (2, 100)


def test_cifar_recipe_reads_cifar_c_and_saves_a_loadable_soup(tmp_path):
    cifar = _recipe("cifar")
    rng = np.random.default_rng(0)
    root = tmp_path / "CIFAR-10-C"  # the published layout: <corruption>.npy (5 severities stacked), labels.npy
    root.mkdir()
    for name in ("gaussian_noise", "contrast"):
        np.save(root / f"{name}.npy", rng.integers(0, 256, (5 * 6, 32, 32, 3), dtype=np.uint8))
    np.save(root / "labels.npy", np.tile(np.arange(6) % 4, 5))

    model_args = cifar.ModelArguments(model_kwargs='{"layers": [1, 1, 1, 1], "channels": [8, 16, 16, 16]}')
    data = DataArguments(image_column="img", **smoke_classification(str(tmp_path)))
    ood = OODArguments(ood=True, ood_dir=str(root), ood_severities=[1, 5])
    args = _args(tmp_path, optim="sgd", learning_rate=0.05, pretrain_epochs=1, retrain_schedule="allr")
    runner = cifar.main(model_args, data, ood, args)
    results = _check_run(tmp_path)
    assert (tmp_path / "run-dense" / "sparsity.json").is_file()  # pretrained beside the run, not inside it
    details = results["rows"]["sms_uniform"][0]["details"]["ood"]
    assert set(details["per_corruption"]) == {"gaussian_noise", "contrast"} and set(details["per_severity"]) == {
        "1",
        "5",
    }
    assert results["dense"]["tests"]["ood"] == pytest.approx(
        np.mean(list(results["dense"]["details"]["ood"]["per_set"].values()))
    )
    soup = load_sparse(str(tmp_path / "run" / "final_soup"), model=cifar.build_model(model_args, 4))
    assert all(torch.equal(a, b) for a, b in zip(soup.state_dict().values(), runner.final_soup.state_dict().values()))
