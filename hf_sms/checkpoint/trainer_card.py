"""The card of a folder transformers' Trainer writes a card into too (``create_model_card``, ``push_to_hub``):
hf-sms's card first, which says whether loading needs hf-sms, then what the Trainer says of its training."""

from __future__ import annotations

import os

from ..atomic import write_text
from .card import model_card
from .constants import CARD_NAME
from .folder import read_sparsity

TRAINER_MARK = "generated automatically according to the information the Trainer had access to"
HEADING = "## Training (transformers' Trainer)"


def read_card(folder: str) -> str:
    """The model card in ``folder`` (transformers' ``create_model_card`` wrote it), or ``""``."""
    path = os.path.join(folder, CARD_NAME)
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def trainer_section(text: str) -> str | None:
    """The part of a card that transformers' Trainer wrote, under :data:`HEADING`; ``None`` if it wrote none."""
    if HEADING in text:  # a card merged before: its Trainer part as it is
        return text[text.index(HEADING) :].strip() + "\n"
    if TRAINER_MARK not in text:
        return None
    body = text
    if body.startswith("---"):  # the Trainer's front matter: hf-sms's card has its own
        end = body.find("\n---", 3)
        body = body[end + 4 :] if end != -1 else body
    return f"{HEADING}\n\n{body.strip()}\n"


def merge_trainer_card(folder: str, text: str) -> bool:
    """Rewrite ``folder``'s card as hf-sms's card followed by the Trainer's part of ``text`` (a card the Trainer
    wrote or one merged before); nothing where ``text`` has no Trainer part or ``folder`` no ``sparsity.json``.
    Returns whether it wrote."""
    section = trainer_section(text)
    if section is None or read_sparsity(folder) is None:
        return False
    card = model_card(folder, os.path.basename(os.path.abspath(folder)))
    path = os.path.join(folder, CARD_NAME)
    write_text(path, card.rstrip() + "\n\n" + section)  # a kill leaves the old card or the new one
    return True
