"""hf-sms's log lines (``logging.getLogger("hf_sms")``: phases, replicas, the table, warnings) shown by default.

transformers' Trainer shows its progress without any set-up; a run of hf-sms used to print nothing of its own
unless the user configured ``logging``. Where nothing is configured (no handler on the root logger or on
``hf_sms``), one handler writes ``hf_sms``'s lines to stderr at ``HF_SMS_VERBOSITY`` (default ``info``;
``warning`` or ``error`` to quiet it). A program that configures logging itself (``logging.basicConfig``, a
framework, pytest) keeps full control: nothing is added then.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def show_logs_by_default() -> None:
    """Add the default handler where logging is not configured (once; see the module's doc)."""
    logger = logging.getLogger("hf_sms")
    if logger.handlers or logging.getLogger().handlers:
        return
    name = os.environ.get("HF_SMS_VERBOSITY", "info").lower()
    if name not in LEVELS:
        raise ValueError(f"HF_SMS_VERBOSITY={name!r} is not one of {sorted(LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(LEVELS[name])
    logger.propagate = False  # a handler added to the root later would print every line twice
