"""What a model card says of loading a checkpoint: whether it needs hf-sms, and the lines that load it (its
family's own loader, hf-sms's, or a smaller model's plain route: :mod:`hf_sms.checkpoint.plain`)."""

from __future__ import annotations

from ..families import FAMILIES, Family
from .family_files import load_snippet
from .shrink_record import ShrinkRecord


def family_of_info(info: dict) -> Family:
    """The family a ``sparsity.json`` names (plain torch for one it does not know)."""
    library = info.get("library")
    return FAMILIES.get(library) if library in FAMILIES else FAMILIES.get("torch")


def loading_line(info: dict) -> str:
    """The card's first words: whether loading needs hf-sms, and how to get a copy that does not."""
    family, shrunk = family_of_info(info), ShrinkRecord.of(info)
    smaller = shrunk is not None and shrunk.smaller
    if shrunk is not None and shrunk.cut_in_place and shrunk.plain is not None:
        return _plain_line(shrunk)
    if family.library == "torch":
        return (
            "**Loading needs hf-sms and the model's code**: `pip install hf-sms`, then "
            "`hf_sms.load_sparse(DIR, model=MyModel(...))` with a model of the same architecture."
        )
    if shrunk is not None and shrunk.cut_in_place:
        return (
            "**Loading needs hf-sms**: a smaller model with whole units cut out where its library's config cannot "
            "state the widths. `pip install hf-sms`, then `hf_sms.load_sparse(DIR)`, which builds the model and cuts "
            "it to the stored widths."
        )
    if info.get("format") == "dense":
        what = "a smaller model with whole units cut out (`hf_sms.shrink`)" if smaller else "pruned weights as zeros"
        return f"**No hf-sms needed**: a plain `{family.library}` checkpoint, {what}; load it as any other."
    return (
        "**Loading needs hf-sms**: the weights are stored in hf-sms's compact sparse format. `pip install hf-sms`, "
        "then `import hf_sms` before `from_pretrained` (or `hf_sms.load_sparse(DIR)`). A plain dense copy that "
        "loads without hf-sms: `hf-sms convert DIR --output DENSE_DIR --format dense`."
    )


def _plain_line(shrunk: ShrinkRecord) -> str:
    """A smaller model cut in place that loads without hf-sms (:mod:`hf_sms.checkpoint.plain`)."""
    head = "a smaller model with whole units cut out where its library's config cannot state the widths"
    if shrunk.plain == "timm":
        return (
            f"**No hf-sms needed**: {head}; `pruned.txt` states them in the form of timm's own "
            "`adapt_model_from_string` (how timm loads its pruned EfficientNets): the timm lines below load it."
        )
    names = shrunk.program_inputs
    takes = f"by name: {', '.join(f'`{n}`' for n in names)}" if names else "one input tensor"
    return (
        f"**No hf-sms needed to run it**: {head}. `model.pt2` is a `torch.export` program of its forward ({takes}; "
        "any batch size, and sequence length for token inputs) that runs with torch alone: the forward only, no "
        "`generate`, no training. To fine-tune or generate, `pip install hf-sms`, then `hf_sms.load_sparse(DIR)` "
        "(plain torch: `model=MyModel(...)`) cuts the model to the stored widths."
    )


def how_to_load(info: dict, repo: str) -> str:
    """The card's loading code for the Hub repository ``repo``."""
    shrunk = ShrinkRecord.of(info)
    in_place = shrunk is not None and shrunk.cut_in_place  # hf-sms rebuilds a cut in place, or its plain route
    plain = shrunk.plain if in_place else None
    snippet = load_snippet(
        family_of_info(info), info.get("architecture"), info.get("format"), repo, True, not in_place, plain
    )
    return "```python\n" + snippet + "\n```"
