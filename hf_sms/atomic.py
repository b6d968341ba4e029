"""Every file hf-sms writes outside a folder of its own making goes through here: a temp file created exclusively
(``mkstemp``: ``O_EXCL``, a fresh random name, never through a planted link) beside the target, given the user's
umask, then renamed over the target (a rename replaces a link at the target itself, never what it points to). A kill
leaves the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

TMP_PREFIX = ".hf_sms-tmp-"  # starts as checkpoint.constants.TMP_PREFIX: run folders remove stale ones on resume


def umask() -> int:
    """The process's umask (reading it sets it: put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def user_mode(path: str, directory: bool = False) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would (0666 or 0777 less the umask): ``mkstemp`` and
    safetensors' ``save_file`` leave 0600."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask(), follow_symlinks=False)


def user_modes(folder: str) -> None:
    """:func:`user_mode` for ``folder`` and everything in it (links left alone)."""
    user_mode(folder, directory=True)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                user_mode(os.path.join(root, name), directory=True)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                user_mode(os.path.join(root, name))


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A fresh temp path beside ``path`` (created empty, exclusively) for a writer that takes a file name
    (``save_file``, ``savefig``); on success it replaces ``path``, on error it is removed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    suffix = os.path.splitext(path)[1]  # matplotlib picks the format from it
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=suffix, dir=folder)
    os.close(fd)
    try:
        yield tmp
        user_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", encoding: str | None = "utf-8"):
    """``open(path, mode)`` that writes a temp file exclusively created beside ``path`` and renames it over
    ``path`` when the block ends without error (``mode``: ``"w"`` or ``"wb"``)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes whole files: mode 'w' or 'wb', got {mode!r}")
    with atomic_path(path) as tmp, open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
        yield f


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`atomic_write`)."""
    with atomic_write(path) as f:
        f.write(text)
