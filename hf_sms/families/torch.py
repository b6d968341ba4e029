"""Plain torch: any other ``nn.Module``. Its code builds it (no config states its widths: a smaller one is cut in
place); saved as its state dict (shared tensors once) in ``model.safetensors``; loads into a template."""

from __future__ import annotations

import os

from .base import WEIGHTS_NAME, Family
from .state import unique_tensors


class TorchFamily(Family):
    library = "torch"

    def save(self, model, folder):
        from safetensors.torch import save_file

        tensors, aliases = unique_tensors(model)
        save_file(tensors, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
        return f"{type(model).__module__}.{type(model).__qualname__}", aliases

    def instantiate(self, ckpt, **kwargs):
        raise ValueError(
            f"{ckpt.directory} holds a plain torch model ({ckpt.architecture}); pass a template: "
            "load_sparse(directory, model=MyModel(...))"
        )
