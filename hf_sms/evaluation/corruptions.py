"""Common corruptions for out-of-distribution accuracy (Hendrycks & Dietterich, ICLR 2019).

The paper reports accuracy on CIFAR-100-C and ImageNet-C: 15 corruptions x 5 severities. Two ways in:

- the published test sets, read by ``load_cifar_c`` (CIFAR-10-C / CIFAR-100-C ``.npy`` folders) and
  ``imagenet_c_files`` (the ImageNet-C image tree); use these for numbers comparable with the paper;
- corruptions made on the fly by ``corrupt`` / ``corrupted_dataset``, through the ``imagecorruptions``
  package (``pip install 'hf-sms[ood]'``). Its parameter tables are ImageNet-C's, made for 224 px images:
  on 32 px images they are much harsher than CIFAR-10-C / CIFAR-100-C, which Hendrycks made with
  separate tables (``make_cifar_c.py``: e.g. gaussian_noise sigma 0.04-0.10 there, 0.08-0.38 here;
  defocus_blur radius 0.3-1.5 there, 3-10 here), and its ``motion_blur`` / ``elastic_transform`` are
  re-implementations, so generated sets resemble the published ones without reproducing them.

``glass_blur``, ``fog`` and ``gaussian_blur`` no longer run in imagecorruptions 1.1.2 (they call
scikit-image's removed ``multichannel=`` and numpy 2's removed ``np.float_``); they are re-implemented
here following imagecorruptions (itself Hendrycks' ``imagenet_c/corruptions.py``), same parameter tables
and the same draws from numpy's global random state, so a seed gives what the package would give.
``impulse_noise`` is the package's call with a seeded Generator: scikit-image no longer draws from numpy's
global state, so the package's version cannot be made reproducible.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..seeding import derive_seed

CORRUPTIONS = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
)
EXTRA_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")  # Hendrycks' held-out four
ALL_CORRUPTIONS = CORRUPTIONS + EXTRA_CORRUPTIONS
SEVERITIES = (1, 2, 3, 4, 5)
_IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


def _check_severities(severities) -> tuple[int, ...]:
    severities = tuple(int(s) for s in severities)
    if not severities or any(s not in SEVERITIES for s in severities):
        raise ValueError(f"severities must be among {SEVERITIES}, got {severities}")
    return severities


def load_cifar_c(root, corruptions=None, severities=SEVERITIES) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """Read CIFAR-10-C / CIFAR-100-C: ``{(corruption, severity): (images, labels)}``.

    ``root`` holds ``<corruption>.npy`` (N x 32 x 32 x 3 uint8, the 5 severities stacked, severity 1 first)
    and ``labels.npy``. ``corruptions=None`` takes every ``.npy`` there but ``labels.npy``. Images are
    read-only memory maps (sliced lazily, nothing unpickled); labels are int64.
    """
    root = Path(root)
    severities = _check_severities(severities)
    labels_path = root / "labels.npy"
    if not labels_path.is_file():
        raise FileNotFoundError(f"{labels_path} is missing (CIFAR-C folders ship one labels.npy)")
    all_labels = np.load(labels_path, allow_pickle=False).astype(np.int64)
    if corruptions is None:
        corruptions = sorted(p.stem for p in root.glob("*.npy") if p.stem != "labels")
        if not corruptions:
            raise ValueError(
                f"{root} holds labels.npy but no corruption files (<corruption>.npy, e.g. gaussian_noise.npy): is it "
                "the unpacked CIFAR-10-C / CIFAR-100-C folder?"
            )
    out = {}
    for name in corruptions:
        path = root / f"{name}.npy"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing")
        images = np.load(path, mmap_mode="r", allow_pickle=False)
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3 or len(images) % 5:
            raise ValueError(f"{path}: expected uint8 (5*n, H, W, 3), got {images.dtype} {images.shape}")
        n = len(images) // 5
        # The published labels.npy repeats the test labels once per severity; accept one copy as well.
        if len(all_labels) not in (n, 5 * n):
            raise ValueError(f"{labels_path} has {len(all_labels)} labels; {path} needs {n} or {5 * n}")
        for s in severities:
            rows = slice((s - 1) * n, s * n)
            out[name, s] = images[rows], all_labels[rows] if len(all_labels) == 5 * n else all_labels
    return out


def imagenet_c_files(root, corruptions=None, severities=SEVERITIES) -> dict[tuple[str, int], list[tuple[Path, str]]]:
    """List ImageNet-C: ``{(corruption, severity): [(path, wnid), ...]}`` sorted by wnid, then file name.

    ``root`` is the tree ``<corruption>/<severity>/<class wnid>/<file>.JPEG``; ``corruptions=None`` takes
    every folder in ``root``. Nothing is opened: decoding and the wnid -> class index map are the recipe's.
    """
    root = Path(root)
    severities = _check_severities(severities)
    if corruptions is None:
        corruptions = sorted(p.name for p in root.iterdir() if p.is_dir())
    out = {}
    for name in corruptions:
        for s in severities:
            folder = root / name / str(s)
            if not folder.is_dir():
                raise FileNotFoundError(f"{folder} is missing")
            out[name, s] = [
                (path, wnid.name)
                for wnid in sorted(p for p in folder.iterdir() if p.is_dir())
                for path in sorted(wnid.iterdir())
                if path.suffix.lower() in _IMAGE_SUFFIXES
            ]
    return out


def _resource_filename(package: str, name: str) -> str:
    return os.path.join(os.path.dirname(sys.modules[package].__file__), name)


def _package():
    """``imagecorruptions``, imported on first use so that hf_sms imports without the ``ood`` extra."""
    module = sys.modules.get("imagecorruptions")
    if module is not None:
        return module
    if importlib.util.find_spec("imagecorruptions") is None:
        raise ImportError("corruptions need the ood extra: pip install 'hf-sms[ood]' (imagecorruptions, scikit-image)")
    stand_in = None
    if importlib.util.find_spec("pkg_resources") is None:
        # imagecorruptions 1.1.2 imports pkg_resources.resource_filename (only to find its frost images),
        # which setuptools >= 81 no longer ships. A stand-in for that one function serves the import and is
        # removed after it, so no other import sees it and users need not downgrade setuptools.
        stand_in = types.ModuleType("pkg_resources")
        stand_in.resource_filename = _resource_filename
        sys.modules["pkg_resources"] = stand_in
    try:
        with warnings.catch_warnings():  # its scipy.ndimage.interpolation import warns; nothing a user can fix
            warnings.simplefilter("ignore", DeprecationWarning)
            import imagecorruptions
    finally:
        if stand_in is not None and sys.modules.get("pkg_resources") is stand_in:
            del sys.modules["pkg_resources"]
    return imagecorruptions


def _plasma_fractal(mapsize: int, wibbledecay: float) -> np.ndarray:
    """Diamond-square height map in [0, 1] (imagecorruptions' ``plasma_fractal``, float64 for ``np.float_``)."""
    maparray = np.empty((mapsize, mapsize), dtype=np.float64)
    maparray[0, 0] = 0
    stepsize, wibble = mapsize, 100.0

    def wibbledmean(array):
        return array / 4 + wibble * np.random.uniform(-wibble, wibble, array.shape)

    while stepsize >= 2:
        half = stepsize // 2
        corners = maparray[0:mapsize:stepsize, 0:mapsize:stepsize]
        squares = corners + np.roll(corners, shift=-1, axis=0)
        squares += np.roll(squares, shift=-1, axis=1)
        maparray[half:mapsize:stepsize, half:mapsize:stepsize] = wibbledmean(squares)
        centres = maparray[half:mapsize:stepsize, half:mapsize:stepsize]
        corners = maparray[0:mapsize:stepsize, 0:mapsize:stepsize]
        # Sums grouped as the reference groups them, so the floats match it bit for bit.
        left = (centres + np.roll(centres, 1, axis=0)) + (corners + np.roll(corners, -1, axis=1))
        maparray[0:mapsize:stepsize, half:mapsize:stepsize] = wibbledmean(left)
        top = (centres + np.roll(centres, 1, axis=1)) + (corners + np.roll(corners, -1, axis=0))
        maparray[half:mapsize:stepsize, 0:mapsize:stepsize] = wibbledmean(top)
        stepsize //= 2
        wibble /= wibbledecay
    maparray -= maparray.min()
    return maparray / maparray.max()


def _fog(x: np.ndarray, severity: int) -> np.ndarray:
    strength, decay = [(1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4)][severity - 1]
    h, w = x.shape[:2]
    mapsize = 1 << (max(h, w) - 1).bit_length()  # the next power of two, as imagecorruptions sizes it
    x = x / 255.0
    max_val = x.max()
    x += strength * _plasma_fractal(mapsize, decay)[:h, :w, np.newaxis]
    return np.clip(x * max_val / (max_val + strength), 0, 1) * 255


def _gaussian_blur(x: np.ndarray, severity: int) -> np.ndarray:
    from skimage.filters import gaussian

    sigma = [1, 2, 3, 4, 6][severity - 1]
    return np.clip(gaussian(x / 255.0, sigma=sigma, channel_axis=-1), 0, 1) * 255


def _glass_blur(x: np.ndarray, severity: int) -> np.ndarray:
    from skimage.filters import gaussian

    sigma, delta, iterations = [(0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)][severity - 1]
    x = np.uint8(gaussian(x / 255.0, sigma=sigma, channel_axis=-1) * 255)
    h, w = x.shape[:2]
    rows, cols = np.arange(h - delta, delta, -1), np.arange(w - delta, delta, -1)
    # Pixels in the reference's order (passes, rows then columns, both downwards) as flat indices, and one
    # draw of all (dx, dy): the same numbers as its randint(size=(2,)) per pixel.
    targets = np.tile((rows[:, None] * w + cols[None, :]).ravel(), iterations)
    dx, dy = np.random.randint(-delta, delta, size=(len(targets), 2)).T
    # The reference's tuple "swap" of numpy views copies x[h', w'] into x[h, w] and leaves x[h', w'] as it
    # was; ImageNet-C was made that way, so it is kept. The copies are sequential (a pixel copied earlier may
    # be copied again), so they run in Python, on a list of which source pixel each pixel holds: flat int
    # lists, as lists of pairs make the garbage collector rescan the heap (10x slower with torch imported).
    source = list(range(h * w))
    for target, origin in zip(targets.tolist(), (targets + dy * w + dx).tolist()):
        source[target] = source[origin]
    x = x.reshape(h * w, -1)[source].reshape(x.shape)
    return np.clip(gaussian(x / 255.0, sigma=sigma, channel_axis=-1), 0, 1) * 255


def _impulse_noise(x: np.ndarray, severity: int) -> np.ndarray:
    from skimage.util import random_noise

    amount = [0.03, 0.06, 0.09, 0.17, 0.27][severity - 1]
    # imagecorruptions' table and call, but scikit-image >= 0.19 draws from its own unseeded Generator: its
    # seed is taken from numpy's global state, so ``seed`` governs this corruption like the others.
    x = random_noise(x / 255.0, mode="s&p", amount=amount, rng=np.random.randint(2**32, dtype=np.uint64))
    return np.clip(x, 0, 1) * 255


_OWN = {"glass_blur": _glass_blur, "fog": _fog, "gaussian_blur": _gaussian_blur, "impulse_noise": _impulse_noise}


def corrupt(image, corruption: str, severity: int, seed: int | None = None) -> np.ndarray:
    """``image`` (uint8 H x W x 3, H and W >= 32) with ``corruption`` at ``severity`` 1-5, as uint8 H x W x 3.

    Corruptions are the 15 of ImageNet-C (``CORRUPTIONS``) and the 4 held-out ones (``EXTRA_CORRUPTIONS``),
    from imagecorruptions but for the four re-implemented here (see the module docstring). They draw
    from numpy's global random state; with ``seed`` it is seeded for this call and restored after (not
    thread-safe: do not corrupt from several threads at once), so the output is reproducible.
    """
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 H x W x 3 image, got {image.dtype} {image.shape}")
    if min(image.shape[:2]) < 32:  # imagecorruptions' own limit (its crops and kernels assume it)
        raise ValueError(f"images must be at least 32 x 32 pixels, got {image.shape[:2]}")
    if corruption not in ALL_CORRUPTIONS:
        raise ValueError(f"unknown corruption {corruption!r}; choose from {ALL_CORRUPTIONS}")
    severity = _check_severities([severity])[0]
    if corruption in _OWN:
        function = _OWN[corruption]
    else:
        from PIL import Image

        package_function = _package().corruption_dict[corruption]

        def function(x, s):
            return package_function(Image.fromarray(x), s)

    state = np.random.get_state() if seed is not None else None
    try:
        if seed is not None:
            np.random.seed(seed)
        out = np.asarray(function(image, severity), dtype=np.float64)
    finally:
        if state is not None:
            np.random.set_state(state)
    # Truncation, as imagecorruptions and Hendrycks' scripts cast with np.uint8.
    return np.clip(out, 0, 255).astype(np.uint8, order="C")


def corrupted_dataset(images, labels, corruption: str, severity: int, seed: int = 0) -> list[dict]:
    """``[{"image": uint8 H x W x 3, "labels": int}, ...]``: each image corrupted with its own seed.

    Image ``i``'s seed is derived from ``(seed, corruption, severity, i)``, so an item does not depend on
    which others are made or in what order. A recipe turns the arrays into model inputs.
    """
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    return [
        {
            "image": corrupt(image, corruption, severity, seed=derive_seed(seed, corruption, severity, i)),
            "labels": int(y),
        }
        for i, (image, y) in enumerate(zip(images, labels))
    ]


class ArrayImages(torch.utils.data.Dataset):
    """Items ``{"x": transform(PIL image), "labels": int}`` of uint8 ``(N, H, W, 3)`` images and their labels
    (numpy arrays or memory maps, e.g. the corrupted test sets of :mod:`hf_sms.evaluation.corruptions`)."""

    def __init__(self, images, labels, transform: Callable):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        return {"x": self.transform(Image.fromarray(np.asarray(self.images[i]))), "labels": int(self.labels[i])}


class ImageFiles(torch.utils.data.Dataset):
    """Items ``{"x": transform(PIL image), "labels": int}`` of image files, each labelled by the index of its class
    folder among ``classes`` (ImageNet-C's ``<wnid>`` folders: the wnids sorted, as ImageNet's labels are)."""

    def __init__(self, files: list, classes: list[str], transform: Callable):
        index = {c: i for i, c in enumerate(classes)}
        self.files, self.labels, self.transform = [p for p, _ in files], [index[c] for _, c in files], transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        with Image.open(self.files[i]) as image:
            return {"x": self.transform(image.convert("RGB")), "labels": self.labels[i]}
