"""What the sparse checkpoint format adds to a family's own folder (:mod:`hf_sms.families`): hf-sms's
``quantization_config`` in ``config.json`` where transformers reads the family's folders, and the lines that load
a folder (its library's own loader, :func:`hf_sms.load_sparse`, or a smaller model's plain route)."""

from __future__ import annotations

import copy
import inspect
import os

from ..families import Family, is_class_name, literal
from . import program_check
from .constants import CONFIG_NAME, FORMAT_VERSION, PROGRAM, QUANT_METHOD, QUANT_METHODS, TIMM_WIDTHS, WEIGHTS_NAME
from .folder import read_json, write_json


def patch_config(family: Family, config: dict, fmt: str) -> dict:
    """``config.json`` for ``fmt``: the family's own, with (bitmask) or without (dense) hf-sms's
    quantization_config where transformers loads the family's folders."""
    config = family.own_config(config)
    if not family.transformers_loadable:
        return config
    if (config.get("quantization_config") or {}).get("quant_method") in QUANT_METHODS:
        del config["quantization_config"]
    if fmt == "bitmask":
        config["quantization_config"] = {
            "quant_method": QUANT_METHOD,
            "format": "bitmask",
            "version": FORMAT_VERSION,
            "dequantize": True,
        }
    return config


def write_config(family: Family, folder: str, fmt: str) -> None:
    """Apply :func:`patch_config` to the folder's ``config.json``; the file is rewritten only if it changes."""
    path = os.path.join(folder, CONFIG_NAME)
    config = read_json(path)
    if config is not None:
        patched = patch_config(family, copy.deepcopy(config), fmt)
        if patched != config:
            write_json(path, patched)


def plain_route_lines(route: str, location: str, hub: bool) -> list[str]:
    """The lines that load a smaller model cut in place by its plain ``route`` (:mod:`hf_sms.checkpoint.plain`)
    from ``location`` without hf-sms."""
    head = ["from huggingface_hub import hf_hub_download"] if hub else []

    def path(name: str) -> str:
        return f"hf_hub_download({literal(location)}, {literal(name)})" if hub else literal(f"{location}/{name}")

    if route == "timm":
        source = literal(f"{'hf-hub' if hub else 'local-dir'}:{location}")
        return [
            "import timm",
            *head,
            "from safetensors.torch import load_file",
            "from timm.models import adapt_model_from_string",
            "",
            f"model = timm.create_model({source}, pretrained=False)",
            f"model = adapt_model_from_string(model, open({path(TIMM_WIDTHS)}).read())",
            f"model.load_state_dict(load_file({path(WEIGHTS_NAME)}))",
        ]
    check = inspect.getsource(program_check.check_program).splitlines()
    return [
        "import ast",
        "import json",
        "import re",
        "import zipfile",
        "",
        "import torch",
        *head,
        "",
        "",
        *check,
        "",
        "",
        f"path = {path(PROGRAM)}",
        "check_program(path)  # torch.export.load unpickles some entries: refuse an archive that holds any",
        "model = torch.export.load(path).module()  # the forward only: no generate, no training",
    ]


def load_snippet(
    family: Family,
    architecture: str,
    fmt: str,
    location: str,
    hub: bool = True,
    own: bool = True,
    plain: str | None = None,
) -> str:
    """Python code that loads the checkpoint (shown in model cards and by ``hf-sms inspect``).

    Args:
        family: the checkpoint's family.
        architecture: the checkpoint's architecture.
        fmt: ``"bitmask"`` or ``"dense"``.
        location: the Hub repository id, or a local folder.
        hub: whether ``location`` is a Hub repository.
        own: the family's own loader where it has one; ``False``: :func:`hf_sms.load_sparse` (a smaller model
            cut in place), or its plain route.
        plain: a smaller model cut in place: the route that loads it without hf-sms (``ShrinkRecord.plain``).
    """
    if not own and plain is not None:
        return "\n".join(plain_route_lines(plain, location, hub))
    lines = family.own_loader(architecture, fmt, location, hub) if own else None
    if lines is None:
        source = f"snapshot_download({literal(location)})" if hub else literal(location)
        template = ", model=MyModel(...)" if family.library == "torch" else ""  # plain models need a template
        download = ["from huggingface_hub import snapshot_download"] if hub else []
        lines = ["import hf_sms", *download, ""]
        if template and architecture is not None and not is_class_name(architecture):  # e.g. a local class
            lines.append("# the model's class cannot be imported by name: MyModel is a model of your own class")
        lines.append(f"model = hf_sms.load_sparse({source}{template})")
    return "\n".join(lines)
