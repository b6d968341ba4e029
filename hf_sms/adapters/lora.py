"""LoRA that keeps a pruned layer's zeros, on peft's own layer (``peft.tuners.lora.Linear``, a ``LoraVariant``).

Two variants of PERP (Zimmer et al., 2023), registered with peft as custom layers for ``nn.Linear``:

- **MaskLoRA**: ``W + M * (s B A)``, ``M = (W != 0)`` the layer's mask: pruned entries never move, and training sees
  exactly what the merge writes.
- **ScaleLoRA**: ``W * (1 + s B A)``, a low-rank multiplicative scaling that starts at all ones (peft's usual init,
  ``B = 0``): zero stays zero. PERP writes ``W * (B A)`` with ``B A`` starting at ones; with ``1 + B A`` the usual
  LoRA init gives the ones and its random ``A`` breaks the symmetry an all-ones start leaves between B's columns.

Both are ``W + G * (s B A)`` with a gate ``G`` (the mask or the weight itself), computed by one autograd function
that never keeps the dense ``G * B A`` for backward (it is rebuilt there): training memory is the frozen base, the
adapters and the activations, as with plain LoRA. peft's ``merge``/``merge_and_unload``/``unmerge`` go through the
variant, so they keep the zeros too.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraVariant
from torch import nn


def gate_of(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``M = (W != 0)`` for ``"mask"``, ``W`` for ``"scale"`` (in ``weight``'s dtype)."""
    return (weight != 0).to(weight.dtype) if kind == "mask" else weight


def _gated(product: torch.Tensor, weight: torch.Tensor, kind: str, scaling: float) -> torch.Tensor:
    """``product * G * s`` in place (the same products in the same order as out of place: the same bits), so a step
    allocates one dense layer-sized tensor where it would allocate four."""
    product.mul_(weight != 0 if kind == "mask" else weight.to(product.dtype))
    return product.mul_(scaling)


BLOCK = 1 << 20
"""Elements of a dense gated product (or a soup's update) made at a time on the CPU (4 MiB in fp32): see
:class:`_GatedLowRank`."""


def row_blocks(weight: torch.Tensor) -> list[slice]:
    """The output rows of ``weight`` in blocks of at most :data:`BLOCK` elements on the CPU, one block elsewhere."""
    out, inp = weight.shape
    rows = out if weight.device.type != "cpu" else max(1, BLOCK // max(inp, 1))
    return [slice(s, min(s + rows, out)) for s in range(0, out, rows)]


class _GatedLowRank(torch.autograd.Function):
    """``x @ (G * (s B A)).T`` with G built from the frozen weight; saves x, A, B and W (already held), not the dense
    product. On the CPU the dense product is made a block of output rows at a time: glibc serves these layer-sized
    temporaries from its heap, where the small tensors freed around them fragment it, so a step of whole-layer
    products grows the process by about a model's bytes that it no longer uses (benchmarks/replica_memory.py)."""

    @staticmethod
    def forward(ctx, x, a, b, weight, scaling: float, kind: str):
        ctx.save_for_backward(x, a, b, weight)
        ctx.scaling, ctx.kind = scaling, kind
        blocks = row_blocks(weight)
        if len(blocks) == 1:
            return x @ _gated(b @ a, weight, kind, scaling).T
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for rows in blocks:
            out[..., rows] = x @ _gated(b[rows] @ a, weight[rows], kind, scaling).T
        return out

    @staticmethod
    def backward(ctx, grad):
        x, a, b, weight = ctx.saved_tensors
        grad = grad.to(a.dtype)  # under autocast the incoming gradient may be half precision
        grad2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(a.dtype)
        grad_x = x2.new_zeros(x2.shape) if ctx.needs_input_grad[0] else None
        grad_a, grad_b = torch.zeros_like(a), torch.empty_like(b)
        for rows in row_blocks(weight):
            if grad_x is not None:
                grad_x.addmm_(grad2[:, rows], _gated(b[rows] @ a, weight[rows], ctx.kind, ctx.scaling))
            # dL/d(BA) = s * G * (grad^T x), summed over every leading dimension
            g = _gated(grad2[:, rows].T @ x2, weight[rows], ctx.kind, ctx.scaling)
            grad_b[rows] = g @ a.T
            grad_a.addmm_(b[rows].T, g)
        grad_x = grad_x.reshape(x.shape).to(x.dtype) if grad_x is not None else None
        return grad_x, grad_a, grad_b, None, None, None


class _GatedVariant(LoraVariant):
    kind = "mask"

    @staticmethod
    def init(module, adapter_name, **kwargs) -> None:
        pass  # peft's init of A and B (B = 0): the update starts at zero, the scaling at ones

    @classmethod
    def delta(cls, module, adapter: str, weight: torch.Tensor) -> torch.Tensor:
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        compute = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
        product = b.to(compute) @ a.to(compute)
        return (product * gate_of(weight, cls.kind).to(compute) * module.scaling[adapter]).to(weight.dtype)

    @classmethod
    def merge_safe(cls, module, active_adapter, orig_weight):
        return orig_weight + cls.delta(module, active_adapter, orig_weight)

    @classmethod
    def merge_unsafe(cls, module, active_adapter, orig_weight) -> None:
        orig_weight.data += cls.delta(module, active_adapter, orig_weight.data)

    @classmethod
    def unmerge(cls, module, active_adapter, orig_weight):
        # ScaleLoRA: W' = W (1 + D) gives W = W' / (1 + D) where 1 + D is nonzero; MaskLoRA: W' - M D (M unchanged)
        if cls.kind == "scale":
            a, b = module.lora_A[active_adapter].weight, module.lora_B[active_adapter].weight
            factor = 1 + (b.float() @ a.float()) * module.scaling[active_adapter]
            return (orig_weight.float() / factor).to(orig_weight.dtype)
        return orig_weight - cls.delta(module, active_adapter, orig_weight)

    @classmethod
    def forward(cls, module, active_adapter, x, result, **kwargs):
        a, b = module.lora_A[active_adapter].weight, module.lora_B[active_adapter].weight
        weight = module.get_base_layer().weight
        x = module.lora_dropout[active_adapter](x)
        update = _GatedLowRank.apply(x, a, b, weight, module.scaling[active_adapter], cls.kind)
        return result + update.to(result.dtype)

    def supports_lora_conversion(self) -> bool:
        return False  # its update is not a plain low-rank product


class MaskLoraVariant(_GatedVariant):
    kind = "mask"


class ScaleLoraVariant(_GatedVariant):
    kind = "scale"


class MaskLoraLinear(LoraLinear):
    """peft's LoRA ``Linear`` whose update is ``M * (s B A)`` (MaskLoRA)."""

    variant = MaskLoraVariant

    def resolve_lora_variant(self, *, config, **kwargs):
        return self.variant()

    def get_delta_weight(self, adapter) -> torch.Tensor:
        return self.variant.delta(self, adapter, self.get_base_layer().weight)

    def __repr__(self) -> str:
        return "mask_" + super().__repr__()


class ScaleLoraLinear(MaskLoraLinear):
    """peft's LoRA ``Linear`` whose weight is ``W * (1 + s B A)`` (ScaleLoRA)."""

    variant = ScaleLoraVariant

    def __repr__(self) -> str:
        return "scale_" + LoraLinear.__repr__(self)


LAYERS = {"mask_lora": MaskLoraLinear, "scale_lora": ScaleLoraLinear}


def lora_config(kind: str, rank: int, alpha: float, targets: list[str], dropout: float = 0.0):
    """A peft ``LoraConfig`` whose ``nn.Linear`` targets become :class:`MaskLoraLinear` or :class:`ScaleLoraLinear`
    (``kind``: ``"mask_lora"`` or ``"scale_lora"``)."""
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout, bias="none")
    config._register_custom_module({nn.Linear: LAYERS[kind]})  # peft's (experimental) custom layer hook
    return config
