"""Smaller models their own library loads, without hf-sms (docs/checkpoints.md, "Smaller models").

A smaller model cut in place (its library's config cannot state the widths, ``ShrinkRecord.cut_in_place``) is
saved with a plain route beside its weights, the first of these that gives the model's outputs:

- ``"timm"``: ``pruned.txt``, the weight shape of every conv, norm and linear layer in the form of timm's own
  ``adapt_model_from_string`` (how timm's ``*_pruned`` EfficientNets load): ``create_model``, adapt, then
  ``load_state_dict`` of the plain ``model.safetensors`` (dense format only). timm rebuilds depthwise but not
  grouped convolutions (RegNet's), so some timm models take the next route.
- ``"torch.export"``: ``model.pt2``, a ``torch.export`` program of the eval forward on the model's usual inputs
  (by name where the model takes a dict), batch size free (and sequence length, for token inputs), which runs with
  torch alone: the forward only (no ``generate``, no training), outputs as plain dicts (transformers' ``logits``...),
  its own copy of the weights. It holds no pickle (no sample inputs, no pickled tensor), so the card's lines can
  refuse, before ``torch.export.load``, any archive that does (:mod:`hf_sms.checkpoint.program_check`).

Each route is checked before it is offered: what it loads computes the saved model's outputs on the example batch
(the exported program also on a batch twice as large).
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import warnings

import torch
from torch import nn

from ..atomic import atomic_write
from ..shrinking.shrink import eval_output, main_output
from .constants import PROGRAM, TIMM_WIDTHS, WEIGHTS_NAME
from .program_check import check_program

logger = logging.getLogger("hf_sms")


def timm_widths(model: nn.Module) -> str:
    """``model``'s layer widths in timm's ``adapt_model_from_string`` form (``name.weight:[shape]***...``)."""
    layers = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)
    return "***".join(
        f"{name}.weight:[{', '.join(map(str, m.weight.shape))}]"
        for name, m in model.named_modules()
        if isinstance(m, layers) and m.weight is not None
    )


def write_plain_route(model: nn.Module, folder: str, library: str, fmt: str, example) -> dict:
    """Write the first plain route that reproduces ``model`` (saved in ``folder`` by its family, config final);
    returns what the record says of it (``ShrinkRecord.plain``, and ``program_inputs``: the names an exported
    program takes), or ``{}`` (the log says why)."""
    inputs = _inputs(model, example)
    if inputs is not None and _batch(inputs) == 1:  # export specialises a batch of one: its program takes only one
        inputs = _doubled(inputs)
    if inputs is None:
        logger.info("[hf-sms] no plain route for this smaller model: pass example_inputs to save_sparse to export it")
        return {}
    try:
        expected = eval_output(model, inputs)
    except (ValueError, RuntimeError, TypeError) as e:
        logger.warning("[hf-sms] this smaller model loads with hf-sms only: it does not run on the example (%s)", e)
        return {}
    if library == "timm" and fmt == "dense" and os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
        if _timm_route(model, folder, inputs, expected):
            return {"plain": "timm"}
    why = _export_route(model, folder, inputs, expected)
    if why is None:
        return {"plain": "torch.export", "program_inputs": list(inputs) if isinstance(inputs, dict) else None}
    logger.warning("[hf-sms] this smaller model loads with hf-sms only: torch.export %s", why)
    return {}


def _inputs(model: nn.Module, example):
    """The batch the model's forward takes, labels left out (the program computes outputs, not a loss); a
    sequence-to-sequence model gets the decoder inputs its labels imply."""
    device = next(model.parameters()).device  # the program is exported and checked where the model is
    if not isinstance(example, dict):
        return example.to(device) if torch.is_tensor(example) else None
    inputs = {k: v.to(device) for k, v in example.items() if k not in ("labels", "label") and torch.is_tensor(v)}
    shift = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if "labels" in example and "decoder_input_ids" not in inputs and shift is not None:
        inputs["decoder_input_ids"] = shift(labels=example["labels"].to(device))
    return inputs or None


def _matches(expected: torch.Tensor, got) -> bool:
    got = main_output(got).float()
    scale = float(expected.abs().max().clamp_min(1e-12))
    return got.shape == expected.shape and float((got.to(expected.device) - expected).abs().max()) <= 1e-4 * scale


def _call(module, inputs):
    return module(**inputs) if isinstance(inputs, dict) else module(inputs)


@torch.no_grad()
def _timm_route(model: nn.Module, folder: str, inputs, expected: torch.Tensor) -> bool:
    import timm
    from safetensors.torch import load_file
    from timm.models import adapt_model_from_string

    widths = timm_widths(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rebuilt = adapt_model_from_string(timm.create_model(f"local-dir:{folder}", pretrained=False), widths)
            rebuilt.load_state_dict(load_file(os.path.join(folder, WEIGHTS_NAME)))
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as e:  # a layer timm's form cannot state
        logger.info("[hf-sms] timm's adapt_model_from_string cannot rebuild this model (%s)", str(e)[:160])
        return False
    device = next(model.parameters()).device
    if not _matches(expected, _call(rebuilt.to(device).eval(), inputs)):
        logger.info("[hf-sms] timm's adapt_model_from_string rebuilds other outputs than the smaller model")
        return False
    with open(os.path.join(folder, TIMM_WIDTHS), "x", encoding="utf-8") as f:
        f.write(widths)
    return True


def _dynamic(inputs):
    """Batch size free for every input; the sequence length too for token inputs (2-D integer tensors), and an
    image's height and width where the model allows (``AUTO``: export keeps what the graph specialises)."""
    auto = torch.export.Dim.AUTO

    def dims(t):
        if t.dim() == 2 and not t.is_floating_point():
            return {0: auto, 1: auto}
        return {0: auto, 2: auto, 3: auto} if t.dim() == 4 and t.is_floating_point() else {0: auto}

    return {k: dims(v) for k, v in inputs.items()} if isinstance(inputs, dict) else (dims(inputs),)


def _batch(inputs) -> int | None:
    first = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs
    return first.shape[0] if torch.is_tensor(first) and first.dim() > 0 else None


def _doubled(inputs):
    if isinstance(inputs, dict):
        return {k: torch.cat([v, v]) for k, v in inputs.items()}
    return torch.cat([inputs, inputs])


def _plain_outputs(model: nn.Module, inputs) -> nn.Module:
    """``model`` with its outputs as plain dicts and tuples (a program holding a library's output class,
    transformers' ``ModelOutput``, needs that library to load), taking the batch's inputs by their names (export
    names its guards after them: ``**kwargs`` breaks them)."""

    # a cache object is no program output: the program computes logits (no generate)
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs, **extra)
        return {k: v for k, v in out.items()} if isinstance(out, dict) else out

    names = list(inputs) if isinstance(inputs, dict) else ["x"]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    forward.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in ["self", *names]])
    wrapper = type("PlainOutputs", (nn.Module,), {"forward": forward})()
    wrapper.model = model
    return wrapper


@torch.no_grad()
def _export_route(model: nn.Module, folder: str, inputs, expected: torch.Tensor) -> str | None:
    """Export, check, save: ``None`` when ``model.pt2`` is written, else why not."""
    was_training = model.training
    model.eval()
    try:
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
        dynamic = _dynamic(inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(
                _plain_outputs(model, inputs), args, kwargs, dynamic_shapes=dynamic, strict=False
            )
        exported = program.module()
        if not _matches(expected, _call(exported, inputs)):
            return "gives other outputs than the model"
        if not _matches(eval_output(model, _doubled(inputs)), _call(exported, _doubled(inputs))):
            return "does not take a larger batch"
        program.example_inputs = None  # saved as a pickle otherwise: the archive holds JSON and raw tensors only
        path = os.path.join(folder, PROGRAM)
        archive = io.BytesIO()  # torch's C++ writer aborts the process on a full disk: Python writes the bytes
        torch.export.save(program, archive)
        with atomic_write(path, "wb") as f:
            f.write(archive.getbuffer())
        del archive
        try:
            check_program(path)  # what the card's lines check before loading it
        except ValueError as e:
            os.remove(path)
            return f"wrote an archive the card's check refuses ({e})"
        return None
    except OSError:  # the disk (full, read-only): the save fails with its own clear error, nothing half-written kept
        raise
    except Exception as e:  # noqa: BLE001 - export fails in many ways (data-dependent branches, unsupported ops)
        return f"failed ({type(e).__name__}: {str(e)[:160]})"
    finally:
        model.train(was_training)
